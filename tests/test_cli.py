"""The command line end to end on tiny-llama, and every bad input it must refuse cleanly."""

import errno
import json
import shutil
import struct
import subprocess
import sys

import onnx
import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.formats.engine_file import FORMAT_VERSION


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(result, message):
    """Exit 2, one error line on stderr naming the fault (after any progress lines), no traceback."""
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("llmc: ") or
              line.startswith("llmc: error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_inspect_shows_manifest(tiny_llama_engine):
    manifest = json.loads(llmc("inspect", tiny_llama_engine, "--json").stdout)
    assert manifest["backend"] == "onnxruntime" and manifest["format_version"] == FORMAT_VERSION
    assert manifest["geometry"] == {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                                    "vocab_size": 258, "max_positions": 512}
    assert len(manifest["source"]["sha256"]) == 64
    text = llmc("inspect", tiny_llama_engine).stdout
    assert "4 layers, 4 heads, 2 kv heads" in text and "section       tokenizer.json" in text


def test_run_json_matches_python_api(tiny_llama_engine):
    import llmc as api

    result = llmc("run", tiny_llama_engine, "--prompt", "def fibonacci(", "--prompt", "x = 1",
                  "--max-new-tokens", 12, "--json")
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    expected = api.LLM(tiny_llama_engine).generate(["def fibonacci(", "x = 1"],
                                                   api.SamplingParams(max_new_tokens=12))
    assert [r["token_ids"] for r in records] == [c.token_ids for c in expected]
    assert all(len(r["token_ids"]) == 12 and r["finish_reason"] == "length" for r in records)


def test_run_without_speculation_gives_the_same_tokens(tiny_llama_engine):
    runs = [llmc("run", tiny_llama_engine, "--prompt", "abcabcabc", "--max-new-tokens", 24, "--json", *option)
            for option in ([], ["--speculative-tokens", "0"], ["--speculative-tokens", "7"])]
    assert all(r.exit_code == 0 for r in runs), [r.stderr for r in runs]
    assert len({r.stdout for r in runs}) == 1


def test_stream_json_gives_the_same_tokens(tiny_llama_engine):
    plain = json.loads(llmc("run", tiny_llama_engine, "--prompt", "abc", "--max-new-tokens", 8,
                            "--json").stdout)
    streamed = [json.loads(line) for line in
                llmc("run", tiny_llama_engine, "--prompt", "abc", "--max-new-tokens", 8, "--json",
                     "--stream").stdout.splitlines()]
    assert [r["token_id"] for r in streamed] == plain["token_ids"]
    assert "".join(r["text"] for r in streamed) == plain["text"]
    assert streamed[-1]["finish_reason"] == "length"


def test_prompts_file_text_and_jsonl(tiny_llama_engine, tmp_path):
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "first"}\n{"prompt": "second"}\n')
    outs = [llmc("run", tiny_llama_engine, "--prompts-file", tmp_path / name, "--json",
                 "--max-new-tokens", 4).stdout for name in ("p.txt", "p.jsonl")]
    assert outs[0] == outs[1]
    assert [json.loads(line)["prompt"] for line in outs[0].splitlines()] == ["first", "second"]


def test_console_script_runs_end_to_end(tiny_llama_onnx, tmp_path):
    engine = tmp_path / "e.plan"
    done = subprocess.run(["llmc", "compile", tiny_llama_onnx, "-o", engine], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(["llmc", "run", engine, "--prompt", "hi", "--max-new-tokens", "3", "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and len(json.loads(done.stdout)["token_ids"]) == 3
    # The command's own process runs on one shared spinning pool (formats/sessions.py); called
    # here, in pytest's process, `main` keeps per-session pools. Same greedy tokens either way.
    in_process = llmc("run", engine, "--prompt", "hi", "--max-new-tokens", "3", "--json")
    assert json.loads(in_process.stdout)["token_ids"] == json.loads(done.stdout)["token_ids"]


SHARED_POOL = """
import onnxruntime as ort
from llmc.errors import LlmcError
from llmc.formats.sessions import session_options, share_threads
assert session_options(2).use_per_session_threads
share_threads(2)
share_threads(2)  # the same size again: a no-op
assert not session_options(2).use_per_session_threads
try:
    share_threads(1)
except LlmcError as error:
    print(error)
"""


def test_shared_thread_pool_is_set_once():
    done = subprocess.run([sys.executable, "-c", SHARED_POOL], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "threads: this process already shares a pool of 2 threads, cannot change it to 1"


# --- bad input -------------------------------------------------------------------------------

def test_export_unknown_model(tmp_path):
    result = llmc("export", "no-such-model", "-o", tmp_path / "m.onnx")
    assert_refused(result, "no-such-model")
    assert "tiny-llama" in result.stderr  # lists the valid names
    assert list(tmp_path.iterdir()) == []


def test_compile_missing_file(tmp_path):
    assert_refused(llmc("compile", tmp_path / "nope.onnx", "-o", tmp_path / "e.plan"), "nope.onnx: no such file")
    assert list(tmp_path.iterdir()) == []


def test_compile_file_that_is_not_onnx(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xffnot a protobuf" * 10)
    assert_refused(llmc("compile", tmp_path / "junk.onnx", "-o", tmp_path / "e.plan"),
                   "junk.onnx: not a readable ONNX model")
    assert not (tmp_path / "e.plan").exists()


def test_compile_graph_that_is_not_a_decoder(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(onnx.helper.make_model(graph), tmp_path / "relu.onnx")
    assert_refused(llmc("compile", tmp_path / "relu.onnx", "-o", tmp_path / "e.plan"),
                   "relu.onnx: not a decoder with past: no input 'input_ids'")
    assert not (tmp_path / "e.plan").exists()


def test_compile_decoder_without_geometry(tiny_llama_onnx, tmp_path):
    model = onnx.load(tiny_llama_onnx)
    del model.metadata_props[:]
    onnx.save(model, tmp_path / "bare.onnx")
    assert_refused(llmc("compile", tmp_path / "bare.onnx", "-o", tmp_path / "e.plan"),
                   "cannot tell the model's num_heads and max_positions")
    assert not (tmp_path / "e.plan").exists()


def test_compile_unknown_backend(tiny_llama_onnx, tmp_path):
    assert_refused(llmc("compile", tiny_llama_onnx, "-o", tmp_path / "e.plan", "--backend", "cuda"),
                   "--backend: unknown backend 'cuda'")


@pytest.fixture
def engine_copy(tiny_llama_engine, tmp_path):
    return shutil.copy(tiny_llama_engine, tmp_path / "engine.plan")


def test_run_truncated_engine(engine_copy):
    data = open(engine_copy, "rb").read()
    open(engine_copy, "wb").write(data[: len(data) // 2])
    assert_refused(llmc("run", engine_copy, "--prompt", "a"), "engine.plan: truncated engine file")


def test_run_corrupted_engine(engine_copy):
    data = bytearray(open(engine_copy, "rb").read())
    data[len(data) // 2] ^= 0x5A  # in the weights, whose checksum is verified while generating
    open(engine_copy, "wb").write(bytes(data))
    result = llmc("run", engine_copy, "--prompt", "a")
    assert_refused(result, "engine.plan: corrupted engine file (checksum mismatch in section 'model.onnx.data')")
    assert result.stdout == ""  # no completion from corrupted weights


def test_run_newer_engine_format(engine_copy):
    data = bytearray(open(engine_copy, "rb").read())
    struct.pack_into("<I", data, 8, 99)
    open(engine_copy, "wb").write(bytes(data))
    assert_refused(llmc("inspect", engine_copy), "engine format version 99 is newer")
    assert_refused(llmc("run", engine_copy, "--prompt", "a"), "engine format version 99 is newer")


def test_run_onnx_file_given_as_engine(tiny_llama_onnx):
    assert_refused(llmc("run", tiny_llama_onnx, "--prompt", "a"), "not an llmc engine file")


def test_run_prompt_longer_than_positions(tiny_llama_engine):
    assert_refused(llmc("run", tiny_llama_engine, "--prompt", "ok", "--prompt", "x" * 600),
                   "prompt 1: 601 tokens leave no room in the engine's 512 positions")


@pytest.mark.parametrize("option,value,message", [
    ("--temperature", "-1", "temperature must be ≥ 0"),
    ("--top-p", "1.5", "top_p must be in (0, 1]"),
    ("--top-k", "-2", "top_k must be an integer ≥ 0"),
    ("--max-new-tokens", "0", "max_new_tokens must be an integer ≥ 1"),
    ("--speculative-tokens", "-1", "--speculative-tokens: must be an integer ≥ 0, got -1"),
])
def test_run_invalid_sampling_option(tiny_llama_engine, option, value, message):
    assert_refused(llmc("run", tiny_llama_engine, "--prompt", "a", option, value), message)


def test_run_without_prompts(tiny_llama_engine):
    assert_refused(llmc("run", tiny_llama_engine), "--prompt: give at least one prompt")


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", b'{"prompt": "ok"}\n{"text": 3}\n', "bad.jsonl:2: expected an object with a string 'prompt'"),
    ("bad.jsonl", b'{"prompt": "ok"}\n\n["not", "an", "object"]\n', "bad.jsonl:3: expected an object"),
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": 7}\n', "bad.jsonl:2: expected an object with a string 'prompt'"),
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": "cut\n', "bad.jsonl:2: not valid JSON (Unterminated string"),
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "bad.jsonl:2: not UTF-8 text (byte 0xe9)"),
    ("bad.txt", b"first\nsecond\ncaf\xe9\n", "bad.txt:3: not UTF-8 text (byte 0xe9)"),
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": "\\ud800x"}\n', "prompt 1: not valid text: lone surrogate U+D800"),
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": ""}\n', "prompt 1: empty"),
])
def test_run_bad_prompts_file(tiny_llama_engine, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    assert_refused(llmc("run", tiny_llama_engine, "--prompts-file", tmp_path / name), message)


def test_prompts_file_with_byte_order_mark_and_crlf(tiny_llama_engine, tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a\\u2028b"}\r\n{"prompt": "c"}\r\n')
    result = llmc("run", tiny_llama_engine, "--prompts-file", tmp_path / "p.jsonl", "--json", "--max-new-tokens", 1)
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == ["a\u2028b", "c"]


def test_run_prompt_that_is_not_utf8(tiny_llama_engine):
    # Linux hands a non-UTF-8 argv byte to Python as a surrogate escape: b"\xff" arrives as "\udcff".
    assert_refused(llmc("run", tiny_llama_engine, "--prompt", "ok", "--prompt", "ab\udcff"),
                   "prompt 1: not valid text: byte 0xff is not UTF-8 (character 2)")


def test_run_prompt_that_is_not_utf8_from_a_real_argv(tiny_llama_engine):
    done = subprocess.run([b"llmc", b"run", bytes(tiny_llama_engine), b"--prompt", b"caf\xe9"], capture_output=True)
    assert done.returncode == 2
    assert done.stderr == b"llmc: error: prompt 0: not valid text: byte 0xe9 is not UTF-8 (character 3)\n"


def test_run_empty_prompt(tiny_llama_engine):
    assert_refused(llmc("run", tiny_llama_engine, "--prompt", ""), "prompt 0: empty")


def test_run_prompt_at_the_length_limit(tiny_llama_engine):
    # 512 positions; the tokenizer adds BOS: 510 bytes are 511 tokens, the longest that leaves room for one more.
    result = llmc("run", tiny_llama_engine, "--prompt", "x" * 510, "--max-new-tokens", 8, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert len(record["prompt_token_ids"]) == 511 and len(record["token_ids"]) >= 1
    assert_refused(llmc("run", tiny_llama_engine, "--prompt", "x" * 511),
                   "prompt 0: 512 tokens leave no room in the engine's 512 positions")


def test_export_failure_leaves_no_output(tmp_path, monkeypatch):
    import llmc.formats.onnx_io as onnx_io

    class DiskFills:
        """A file that takes a few bytes, then runs out of space."""

        def __init__(self, path, mode):
            self.file = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_io, "open", DiskFills, raising=False)  # the exporter saves through onnx_io
    assert_refused(llmc("export", "tiny-llama", "-o", tmp_path / "m.onnx", "--no-check"), "no space left on device")
    assert list(tmp_path.iterdir()) == []


def test_compile_json_is_one_summary_a_ci_job_can_record(tiny_llama_onnx, tmp_path):
    import hashlib

    engine = tmp_path / "engine.plan"
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(engine), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # stdout holds the JSON alone; progress went to stderr
    assert summary["engine"] == str(engine) and summary["bytes"] == engine.stat().st_size
    assert summary["sha256"] == hashlib.sha256(engine.read_bytes()).hexdigest()
    assert summary["backend"] == "onnxruntime" and summary["dtype"] == "float32" and summary["precision"] is None
    assert summary["geometry"]["num_layers"] == 4 and summary["paged"]["block_size"] == 16
    assert summary["passes"]["fuse-attention"] == 4 and summary["nodes"]["final"] < summary["nodes"]["source"]
    assert summary["build_s"] > 0 and summary["warnings"] == []
    quantized = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "q.plan"), "--json",
                                          "--weights", "int8", "--weights-symmetric", "--force"])
    assert quantized.exit_code == 0, quantized.output
    # qkv, o, gate+up (merged siblings), down per layer, and lm_head
    assert json.loads(quantized.stdout)["precision"]["linears"] == {"int8-weights": 4 * 4 + 1}
    assert json.loads(quantized.stdout)["precision"]["weights_symmetric"] is True


def test_dry_run_json_exits_2_with_the_nodes_at_fault(tiny_llama_onnx, tmp_path, monkeypatch):
    from llmc.compiler import tensorrt_support

    monkeypatch.delitem(tensorrt_support.PARSER_OPS, "RotaryEmbedding")  # as if the parser lacked it
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "e.plan"), "--backend",
                                       "tensorrt", "--dry-run", "--json"])
    assert result.exit_code == 2
    check = json.loads(result.stdout)
    assert check["dry_run"] and check["unsupported"]
    assert all("no importer for RotaryEmbedding" in u for u in check["unsupported"]), check["unsupported"]
    assert not (tmp_path / "e.plan").exists()


def test_inspect_json_says_whether_the_engine_runs_here(engine_copy):
    result = llmc("inspect", engine_copy, "--json")
    assert result.exit_code == 0, result.output
    deploy = json.loads(result.stdout)["deploy"]
    assert deploy["runs_here"] and {c["check"] for c in deploy["checks"]} >= {"engine file", "onnxruntime", "numba"}
    data = bytearray(open(engine_copy, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(engine_copy, "wb").write(bytes(data))
    result = llmc("inspect", engine_copy, "--json")
    assert result.exit_code == 2
    (failed,) = [c for c in json.loads(result.stdout)["deploy"]["checks"] if not c["ok"]]
    assert failed["check"] == "engine file" and "checksum mismatch in section 'model.onnx.data'" in failed["detail"]
