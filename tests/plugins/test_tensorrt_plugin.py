"""The TensorRT plugin ``llmc::paged_attention``.

TensorRT cannot be installed on CI or development machines, so this file checks the plugin
statically: its declared tensors against the op's contract (parsed from plugins/paged_attention.py),
the kernel's parameters against TensorRT's launch order, and the AOT kernel's PTX compiled with
Triton for targets without a GPU. TensorRT's own calls into the plugin run through TensorRT 11.4's
real tensorrt.plugin package in test_tensorrt_plugin_package.py.
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
    runtime = list(tensorrt_plugin.triton_signature("fp16", "fp32", dict.fromkeys(
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
from llmc.plugins import tensorrt_plugin as tp
results = []
for float_type, head_dim, heads, capability in json.loads(sys.argv[1]):
    cfg, kernel = tp.aot_kernel(float_type, float_type, dict.fromkeys(tp.INPUT_NAMES[5:], "i64"),
                                num_heads=heads, num_kv_heads=8, head_dim=head_dim, block_size=16,
                                scale=head_dim ** -0.5, capability=capability)
    entry = re.search(r"\\.entry\\s+" + kernel["name"] + r"\\s*\\((.*?)\\)", kernel["ptx"], re.S)
    results.append({"params": len([p for p in entry.group(1).split(",") if p.strip()]),
                    "shared": kernel["shared"], "threads": kernel["threads"], "num_warps": cfg.num_warps,
                    "version": re.search(r"^\\.version (\\S+)$", kernel["ptx"], re.M).group(1),
                    "target": re.search(r"^\\.target (\\S+)$", kernel["ptx"], re.M).group(1)})
print(json.dumps(results))
"""


def test_aot_kernel_fits_tensorrt_for_head_dim_128():
    """Compiles without a GPU, in a fresh process: the interpreter tests in this pytest process set
    TRITON_INTERPRET, which must not leak into real compilation. head_dim 128 with 4 query heads
    per kv head (the package tests take 64), for an Ampere and a Blackwell target."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'llmc[gpu]')")
    import json
    import os

    # fp32 compiles slowly (~10 s): the GPU check compiles it.
    cases = [("fp16", 128, 32, 80), ("bf16", 128, 32, 120)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE, json.dumps(cases)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.splitlines()[-1])
    for result in results:
        assert result["params"] == 8 + len(tensorrt_plugin.EXTRA_ARG_NAMES) + 1
        assert result["shared"] <= tensorrt_plugin.SHARED_MEM_LIMIT
        assert result["threads"] == result["num_warps"] * 32
    assert [(r["target"], r["version"]) for r in results] == [("sm_80", "8.0"), ("sm_120a", "9.0")]


def test_ptx_version_covers_each_target():
    """PTX ISA 8.0 introduced sm_90a; 8.6 sm_100a, 8.7 sm_120a (NVIDIA's PTX ISA release notes);
    LLVM aborts the process on a target its ISA lacks, so none may be below."""
    first_isa = {80: 70, 86: 71, 89: 78, 90: 80, 100: 86, 120: 87}
    for capability, isa in first_isa.items():
        assert tensorrt_plugin.ptx_version(capability) >= isa
    # and no higher than the CUDA 13.0 driver loads
    assert max(tensorrt_plugin.ptx_version(c) for c in first_isa) == 90
