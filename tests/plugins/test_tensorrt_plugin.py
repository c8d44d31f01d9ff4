"""The TensorRT plugin ``llmc::paged_attention``.

TensorRT cannot be installed on CI or development machines, so this file checks the plugin
statically: its declared tensors against the op's contract (parsed from plugins/paged_attention.py)
and the AOT kernel's PTX compiled with Triton for an sm_90 target (no GPU needed). Its
registration runs under TensorRT 11.4's real tensorrt.plugin package in
tests/compiler/test_tensorrt_api.py.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

from llmc.errors import LlmcError
from llmc.plugins import paged_attention, tensorrt_plugin



def contract_section(title: str) -> list[str]:
    """Names listed under one heading (Inputs, Attributes, Output) of the contract docstring."""
    lines = paged_attention.__doc__.splitlines()
    start = lines.index(title) + 1
    names = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        match = re.match(r"^ {4}(\w+)\s", line)
        if match:
            names.append(match.group(1))
    return names


def test_declared_tensors_follow_the_contract():
    assert contract_section("Inputs") == list(tensorrt_plugin.INPUT_NAMES)
    assert contract_section("Attributes") == list(tensorrt_plugin.ATTRIBUTE_NAMES)
    assert contract_section("Output") == list(tensorrt_plugin.OUTPUT_NAMES)


def test_importing_llmc_plugins_imports_neither_tensorrt_nor_triton():
    code = ("import sys, llmc.plugins, llmc.plugins.paged_attention, llmc.plugins.tensorrt_plugin; "
            "print(sorted(m for m in ('tensorrt', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kernel_parameters_are_in_tensorrt_launch_order():
    from llmc.plugins.paged_attention_triton import _paged_attention_kernel

    params = list(inspect.signature(_paged_attention_kernel).parameters)
    runtime = list(tensorrt_plugin.triton_signature("fp16", dict.fromkeys(
        tensorrt_plugin.INPUT_NAMES[5:], "i32")))
    assert params[:len(runtime)] == runtime
    assert runtime == [*tensorrt_plugin.INPUT_NAMES, *tensorrt_plugin.EXTRA_ARG_NAMES,
                       *tensorrt_plugin.OUTPUT_NAMES]


PTX = """.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3
)
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b32 \t%r1, [k_param_1];
\tBODY
}
"""


def test_strip_unused_trailing_params():
    stripped = tensorrt_plugin.strip_unused_trailing_params(PTX.replace("BODY", ""), "k", 2)
    assert "k_param_1" in stripped and "k_param_2" not in stripped and "k_param_3" not in stripped
    with pytest.raises(LlmcError, match="reads its hidden parameter k_param_3"):
        tensorrt_plugin.strip_unused_trailing_params(
            PTX.replace("BODY", "ld.param.b64 %rd2, [k_param_3];"), "k", 2)


AOT_COMPILE = """
import json, re, sys
from triton.backends.compiler import GPUTarget
from llmc.plugins import tensorrt_plugin as tp
results = []
for float_type, head_dim, heads, window, softcap in json.loads(sys.argv[1]):
    cfg, kernel = tp.aot_kernel(float_type, dict.fromkeys(tp.INPUT_NAMES[5:], "i64"),
                                num_heads=heads, num_kv_heads=8, head_dim=head_dim,
                                block_size=16, scale=head_dim ** -0.5,
                                target=GPUTarget("cuda", 90, 32), window=window,
                                softcap=softcap)
    entry = re.search(r"\\.entry\\s+" + kernel["name"] + r"\\s*\\((.*?)\\)", kernel["ptx"], re.S)
    results.append({"params": len([p for p in entry.group(1).split(",") if p.strip()]),
                    "shared": kernel["shared"], "threads": kernel["threads"],
                    "num_warps": cfg.num_warps})
print(json.dumps(results))
"""


def test_aot_kernel_compiles_to_ptx_in_tensorrt_launch_order():
    """Compiles for sm_90 without a GPU, in a fresh process: the interpreter tests in this
    session set TRITON_INTERPRET, which must not leak into real compilation."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'llmc[gpu]')")
    import json
    import os

    # fp32 compiles slowly (~10 s): GPU check. A sliding window and soft-capping keep the
    # launch order.
    cases = [("fp16", 128, 32, 0, 0.0), ("bf16", 64, 16, 4096, 50.0)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE, json.dumps(cases)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    for result in json.loads(out.stdout.splitlines()[-1]):
        assert result["params"] == 8 + 2 + 1  # inputs, int32 scalars, output
        assert result["shared"] <= tensorrt_plugin.SHARED_MEM_LIMIT
        assert result["threads"] == result["num_warps"] * 32
