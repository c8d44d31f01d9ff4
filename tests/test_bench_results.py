"""bench/results.py: RESULTS.md and README's results block rendered from the benchmarks' JSON files."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


results = _load("results")
record = _load("record")

RECORD = {"command": "python bench/latency_bench.py --model smollm2", "utc_start": "2030-01-02T03:04:05+00:00",
          "utc_end": "2030-01-02T03:34:05+00:00",
          "machine": {"cpu": "Test CPU 9000", "cores": 2, "memory_gib": 23.5, "loadavg_start": [0.5, 0.4, 0.3],
                      "loadavg_end": [1.25, 1.0, 0.9]},
          "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True}, "versions": {}}
LATENCY = {
    "benchmark": "latency", "sizes": {"batch": 16, "long_prompt": 2048},
    "table": [
        {"measure": "decode, batch 1, fp32 (tok/s)", "key": "decode_tok_s", "precision": "fp32",
         "llmc": 60.0, "genai": 40.0, "ratio": 1.5, "higher_is_better": True},
        {"measure": "decode, static batch of 16 (tok/s)", "key": "batch_decode_tok_s", "precision": "fp32",
         "llmc": 440.0, "genai": 550.0, "ratio": 0.8, "higher_is_better": True},
        {"measure": "decode on real text (chat), batch 1, fp32 (tok/s)", "key": "text_decode_tok_s",
         "precision": "fp32", "llmc": 50.0, "genai": 40.0, "ratio": 1.25, "higher_is_better": True},
        {"measure": "load + first token (s)", "key": "load_first_token_s", "precision": "fp32",
         "llmc": 1.33, "genai": None, "ratio": None, "higher_is_better": False},
    ],
    "record": RECORD,
}
SERVING = {"benchmark": "serving", "threads": 2,
           "workload": {"requests": 64, "prompt_tokens": 16000, "output_tokens": 4500},
           "systems": {"llmc": {"throughput_tok_s": 800.0, "ttft_ms_p50": 2000.0, "ttft_ms_p99": 5000.0},
                       "genai": {"throughput_tok_s": 400.0},
                       "hf-static": {"throughput_tok_s": 200.0}},
           "interference": None, "errors": {}, "record": {**RECORD, "command": "python bench/serving_bench.py"}}


@pytest.fixture
def tree(tmp_path):
    """A results folder with a latency and a serving file, and a README holding the markers."""
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "latency_smollm2.json").write_text(json.dumps(LATENCY))
    (folder / "serving.json").write_text(json.dumps(SERVING))
    readme = tmp_path / "README.md"
    readme.write_text(f"# llmc\n\nintro\n\n{results.BEGIN}\nold table\n{results.END}\n\nafter\n")
    return folder, tmp_path / "RESULTS.md", readme


def run(tree, *extra: str) -> int:
    folder, output, readme = tree
    return results.main(["--results-dir", str(folder), "--output", str(output), "--readme", str(readme), *extra])


def test_renders_sections_provenance_and_ratios(tree):
    folder, output, readme = tree
    assert run(tree) == 0
    text = output.read_text()
    latency = text.split("## Latency")[1].split("\n## ")[0]
    assert "python bench/latency_bench.py --model smollm2" in latency
    assert "Test CPU 9000, 2 cores, 23.5 GiB memory" in latency
    assert "load average 0.50 at the start, 1.25 at the end" in latency
    assert "`0123456789` (working tree with uncommitted changes)" in latency
    assert "2030-01-02T03:04:05+00:00 to 2030-01-02T03:34:05+00:00" in latency
    assert "| decode, batch 1, fp32 (tok/s) | 60 | 40 | 1.50 |" in latency
    assert "| load + first token (s) | 1.33 | - | - |" in latency
    serving = text.split("## Serving")[1].split("\n## ")[0]
    assert "| hf-static | 200 | - | - | 4.00 |" in serving
    # a benchmark without a file: its description and command, no figures
    product = text.split("## Accuracy of the product's command")[1].split("\n## ")[0]
    assert "python bench/product_command_bench.py --save-json bench/results/product_command.json" in product
    assert results.NOT_RUN in product and "|" not in product


def test_readme_block_holds_the_headline_figures_only(tree):
    _, _, readme = tree
    assert run(tree) == 0
    text = readme.read_text()
    assert text.startswith("# llmc\n\nintro\n\n") and text.endswith("\n\nafter\n")
    block = text[text.index(results.BEGIN):text.index(results.END)]
    assert "old table" not in block
    assert "| measure | llmc | onnxruntime-genai | OpenVINO GenAI | transformers | llmc ÷ peer |" in block
    assert "| Decode, batch 1, SmolLM2 fp32, real text (tok/s) | 50 | 40 | - | - | 1.25 |" in block
    assert "| 60 |" not in block  # batch 1 on random prompts stays in RESULTS.md
    assert "| Decode, batch 16, SmolLM2 fp32 (tok/s) | 440 | 550 | - | - | 0.80 |" in block
    assert "| Serving throughput, 64 requests, 32M Llama (tok/s) | 800 | 400 | - | 200 | 2.00 |" in block
    assert "Perplexity" not in block  # no product-command file: no row
    assert "--backend openvino" not in block  # no OpenVINO figures in the file: no such rows


def test_readme_block_puts_the_openvino_backend_beside_openvino_genai(tree):
    folder, _, readme = tree
    latency = json.loads(json.dumps(LATENCY))
    latency["table"][1] |= {"llmc-openvino": 900.0, "openvino": 750.0, "ratio_llmc-openvino": 1.2}
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    assert run(tree) == 0
    block = readme.read_text()
    assert "| Decode, batch 16, SmolLM2 bf16, `--backend openvino` (tok/s) | 900 | - | 750 | - | 1.20 |" in block
    assert "| Decode, batch 16, SmolLM2 fp32 (tok/s) | 440 | 550 | - | - | 0.80 |" in block
    assert "batch 1, one token a step" not in block  # the file has no OpenVINO figure for it


def test_check_fails_when_results_or_readme_block_drift(tree, capsys):
    folder, output, readme = tree
    assert run(tree, "--check") == 1  # nothing written yet
    assert run(tree) == 0
    assert run(tree, "--check") == 0
    output.write_text(output.read_text().replace("| 60 |", "| 61 |"))
    assert run(tree, "--check") == 1
    assert str(output) in capsys.readouterr().err
    assert run(tree) == 0
    readme.write_text(readme.read_text().replace("| 800 |", "| 900 |"))
    assert run(tree, "--check") == 1
    assert "README.md (the block" in capsys.readouterr().err
    assert run(tree) == 0
    changed = copy.deepcopy(LATENCY)
    changed["table"][0]["llmc"] = 70.0
    (folder / "latency_smollm2.json").write_text(json.dumps(changed))
    assert run(tree, "--check") == 1


def test_missing_field_is_one_line_naming_the_file(tree, capsys):
    folder, output, _ = tree
    broken = copy.deepcopy(SERVING)
    del broken["record"]["machine"]["cpu"]
    (folder / "serving.json").write_text(json.dumps(broken))
    assert run(tree) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {folder / 'serving.json'}: missing field 'record.machine.cpu'"
    assert not output.exists()  # nothing half-written


def test_readme_without_markers_is_skipped_and_said(tree, capsys):
    _, output, readme = tree
    readme.write_text("# llmc\n")
    assert run(tree) == 0
    assert readme.read_text() == "# llmc\n"
    assert "no <!-- results:begin -->" in capsys.readouterr().err
    assert output.is_file()


def test_record_carries_command_machine_load_commit_and_time(tmp_path):
    began = record.begin(["bench/latency_bench.py", "--model", "smollm2"])
    done = record.finish(began)
    assert set(record.FIELDS) <= set(done) and set(record.MACHINE_FIELDS) <= set(done["machine"])
    assert done["command"].endswith("latency_bench.py --model smollm2")
    assert len(done["git"]["commit"]) == 40 and isinstance(done["git"]["dirty"], bool)
    target = tmp_path / "out.json"
    record.write_json(target, {"record": done})
    assert json.loads(target.read_text())["record"] == json.loads(json.dumps(done))
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left behind


def test_record_command_names_the_settings_it_ran_with(monkeypatch):
    """A run with llmc's huge pages off is another measurement: its command says so."""
    monkeypatch.delenv("LLMC_HUGE_PAGES", raising=False)
    assert record.begin(["bench/serving_bench.py"])["command"].startswith("python ")
    monkeypatch.setenv("LLMC_HUGE_PAGES", "0")
    assert record.begin(["bench/serving_bench.py", "--model", "smollm2"])["command"] == \
        "LLMC_HUGE_PAGES=0 python bench/serving_bench.py --model smollm2"


def test_a_file_no_section_renders_is_refused(tree, capsys):
    folder, _, _ = tree
    (folder / "latency.json").write_text(json.dumps(LATENCY))
    assert run(tree) == 2
    assert capsys.readouterr().err.startswith(f"error: {folder / 'latency.json'}: no section renders this file")


def test_a_malformed_row_names_the_file(tree, capsys):
    folder, _, _ = tree
    broken = copy.deepcopy(LATENCY)
    del broken["table"][1]["measure"]
    (folder / "latency_smollm2.json").write_text(json.dumps(broken))
    assert run(tree) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {folder / 'latency_smollm2.json'}: missing or malformed field") and "measure" in err
    assert "\n" not in err


def test_repository_results_match_their_json():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "results.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# A breakdown as runtime/profile.py's `breakdown` gives it (one kind with a bound, one without).
PROFILE = {"machine": {"threads": 2, "memory_bytes_per_s": 12.5e9, "flops_per_s": 150e9},
           "kinds": {"prefill": {"steps": 1, "step_ms": 40.0, "tokens_per_step": 128.0,
                                 "parts_ms": {"onnxruntime": 30.0, "paged attention": 6.0, "python": 3.0,
                                              "sample": 1.0},
                                 "calls_ms": {}, "bound": {"memory_s": 0.001, "compute_s": 0.015, "bound": "compute",
                                                           "fraction": 0.375},
                                 "top_operators": [{"op": "MatMul", "name": "/model/layers.*/mlp/down_proj/MatMul",
                                                    "ms_per_step": 9.5, "calls_per_step": 6.0}]},
                     "decode b1": {"steps": 127, "step_ms": 10.0, "tokens_per_step": 1.0,
                                   "parts_ms": {"onnxruntime": 6.0, "python": 2.0, "sample": 1.0, "schedule": 0.5,
                                                "detokenize": 0.5},
                                   "calls_ms": {}, "top_operators": []}}}


def test_a_profiled_row_gets_where_llmc_s_time_went_and_others_render_as_before(tree):
    folder, output, _ = tree
    assert run(tree) == 0
    before = output.read_text()
    latency, serving = copy.deepcopy(LATENCY), copy.deepcopy(SERVING)
    latency["table"][0]["profile"] = PROFILE
    serving["systems"]["llmc"]["profile"] = {"kinds": PROFILE["kinds"]}  # measured without bounds
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    (folder / "serving.json").write_text(json.dumps(serving))
    assert run(tree) == 0
    text = output.read_text()
    section = text.split("## Latency")[1].split("\n## ")[0]
    assert "Where llmc's time went: decode, batch 1, fp32 (tok/s) (the measurement again under the profiler" in section
    assert ("| prefill | 1 | 40 | onnxruntime 75%, paged attention 15%, python 8% | compute-bound at 38% of peak "
            "| MatMul `/model/layers.*/mlp/down_proj/MatMul`: 9.5 ms |") in section
    assert "| decode b1 | 127 | 10 | onnxruntime 60%, python 20%, sample 10% | - | - |" in section
    assert "(2 threads): memory 12.5 GB/s, fp32 peak 150 GFLOP/s." in section
    assert section.count("Where llmc's time went") == 1  # the other rows have no profile
    serving_section = text.split("## Serving")[1].split("\n## ")[0]
    assert "Where llmc's time went: llmc, useful tok/s" in serving_section
    assert "GFLOP/s" not in serving_section
    # the rest of each section is what it was without a profile
    strip = lambda part: part.split("\nWhere llmc's time went")[0]  # noqa: E731
    assert [strip(part) for part in text.split("\n## ")] == [strip(part) for part in before.split("\n## ")]


def test_openvino_peer_gets_columns_rows_and_the_cpu_flags_while_older_files_render_as_before(tree):
    folder, output, _ = tree
    assert run(tree) == 0
    before = output.read_text()
    for title in ("## Latency", "## Serving"):
        section = before.split(title)[1].split("\n## ")[0]
        assert "OpenVINO" not in section and "CPU flags" not in section
    latency, serving = copy.deepcopy(LATENCY), copy.deepcopy(SERVING)
    latency["record"]["machine"]["cpu_flags"] = ["avx512_bf16", "avx512f", "avx512_vnni"]
    latency["table"][0] |= {"openvino": 50.0, "openvino-f32": 30.0, "ratio_openvino": 1.2, "ratio_openvino-f32": 2.0}
    latency["table"][3] |= {"openvino": None, "openvino-f32": None}  # a row its worker does not measure
    latency["openvino"] = {"versions": {"openvino": "2026.4.1", "openvino-genai": "2026.4.1.0"}}
    latency["peer_errors"] = {"openvino-f32 int4": "RuntimeError: openvino worker exited with 1"}
    serving["record"]["machine"]["cpu_flags"] = []
    serving["systems"] |= {"openvino": {"throughput_tok_s": 1000.0, "ttft_ms_p50": 1500.0, "ttft_ms_p99": 4000.0},
                           "openvino-f32": {"throughput_tok_s": 640.0, "ttft_ms_p50": 2500.0, "ttft_ms_p99": 6000.0}}
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    (folder / "serving.json").write_text(json.dumps(serving))
    assert run(tree) == 0
    text = output.read_text()
    section = text.split("## Latency")[1].split("\n## ")[0]
    assert ("| measure | llmc | onnxruntime-genai | OpenVINO GenAI | OpenVINO GenAI f32 | llmc ÷ genai "
            "| llmc ÷ OpenVINO GenAI | llmc ÷ OpenVINO GenAI f32 |") in section
    assert "| decode, batch 1, fp32 (tok/s) | 60 | 40 | 50 | 30 | 1.50 | 1.20 | 2.00 |" in section
    assert "| decode, static batch of 16 (tok/s) | 440 | 550 | - | - | 0.80 | - | - |" in section
    assert "| load + first token (s) | 1.33 | - | - | - | - | - | - |" in section
    assert "OpenVINO GenAI 2026.4.1.0 on `optimum-cli export openvino`'s model" in section
    assert 'Not measured ("-" above): openvino-f32 int4: RuntimeError: openvino worker exited with 1' in section
    assert "- CPU flags: avx512_bf16 avx512f avx512_vnni\n" in section
    serving_section = text.split("## Serving")[1].split("\n## ")[0]
    assert "| openvino | 1,000 | 1,500 | 4,000 | 0.80 |" in serving_section
    assert "| openvino-f32 | 640 | 2,500 | 6,000 | 1.25 |" in serving_section
    assert "- CPU flags: none of avx512*, amx*\n" in serving_section
    # the sections of files without the peer are what they were
    assert [part for part in text.split("\n## ") if not part.startswith(("Latency", "Serving"))] == \
        [part for part in before.split("\n## ") if not part.startswith(("Latency", "Serving"))]


def test_a_peer_that_could_not_be_installed_renders_dashes_and_the_reason(tree):
    folder, output, _ = tree
    reason = "ExporterUnavailable: pip install openvino-genai==2026.4.1.0 failed: no registry"
    latency, serving = copy.deepcopy(LATENCY), copy.deepcopy(SERVING)
    for row in latency["table"]:
        row |= {"openvino": None, "openvino-f32": None}
    latency["peer_errors"] = {"OpenVINO GenAI install": reason}
    serving["errors"] = {"openvino, openvino-f32": f"install or export: {reason}"}
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    (folder / "serving.json").write_text(json.dumps(serving))
    assert run(tree) == 0
    text = output.read_text()
    section = text.split("## Latency")[1].split("\n## ")[0]
    assert "| decode, batch 1, fp32 (tok/s) | 60 | 40 | - | - | 1.50 | - | - |" in section
    assert f'Not measured ("-" above): OpenVINO GenAI install: {reason}' in section
    serving_section = text.split("## Serving")[1].split("\n## ")[0]
    assert "| openvino | - | - | - | - |" in serving_section and "| openvino-f32 | - | - | - | - |" in serving_section
    assert f"Failed: openvino, openvino-f32: install or export: {reason}" in serving_section


def trained_model_shape() -> tuple[int, int, int, int, int, int]:
    """The trained model's (layers, heads, kv heads, head dim, linear parameters below the LM head,
    LM head parameters), counted from its config.json."""
    config = json.loads((REPO / "data" / "pystdlib-llama" / "config.json").read_text())
    hidden, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                       "vocab_size"))
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    body = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    return layers, heads, kv_heads, head_dim, body, hidden * vocab


def test_latency_rows_get_the_machine_limit_of_their_work(trained_engine):
    """bench/latency_bench.py's limits, against the model's parameters counted from its config."""
    latency_bench = _load("latency_bench")
    layers, heads, kv_heads, head_dim, body, head = trained_model_shape()
    sizes = latency_bench.Sizes(prompt=32, new_tokens=16, long_prompt=256, batch=4, reps=1, takes=1)
    machine = {"memory_bytes_per_s": 1e10, "flops_per_s": 1e11, "threads": 2}
    limits = latency_bench.row_limits(trained_engine, machine, sizes, text_prompt=None)
    assert "text_decode_tok_s" not in limits
    kv_per_position = 2 * layers * kv_heads * head_dim * 4
    # batch 1: reading every weight (fp32, the norms beside them: within 5%) and the context's keys and values
    context = sizes.prompt + sizes.new_tokens / 2
    read_s = ((body + head) * 4 + kv_per_position * (context + 1)) / 1e10
    assert limits["decode_tok_s"]["bound"] == "memory"
    assert limits["decode_tok_s"]["value"] == limits["plain_decode_tok_s"]["value"]
    assert 1 / read_s / 1.05 < limits["decode_tok_s"]["value"] <= 1 / read_s
    # a prompt: 2 FLOPs a parameter a token, the LM head on its last row, and causal attention
    for key, tokens in (("ttft_ms", sizes.prompt), ("ttft_long_ms", sizes.long_prompt)):
        flops = 2 * body * tokens + 2 * head + 4 * heads * head_dim * layers * tokens * (tokens + 1) / 2
        assert limits[key]["bound"] == "compute"
        assert limits[key]["value"] == pytest.approx(flops / 1e11 * 1e3, rel=0.01)
    assert limits["batch_decode_tok_s"]["value"] > limits["decode_tok_s"]["value"]
    assert latency_bench.share_of_limit(50.0, {"value": 200.0}, higher=True) == 0.25
    assert latency_bench.share_of_limit(400.0, {"value": 100.0}, higher=False) == 0.25
    assert latency_bench.share_of_limit(None, {"value": 100.0}, higher=False) is None


def test_a_runs_builds_are_deleted_after_it_failed_or_not_unless_kept(tmp_path):
    """The benchmarks' build folders take ~25 GB at 1B parameters: a run leaves none behind."""
    latency_bench = _load("latency_bench")
    folder = tmp_path / "latency-smollm2"
    (folder / "engine").mkdir(parents=True)
    with pytest.raises(RuntimeError):
        with latency_bench.builds_deleted_after(folder, keep=False):
            raise RuntimeError("a build failed")
    assert not folder.exists()
    (folder / "engine").mkdir(parents=True)
    with latency_bench.builds_deleted_after(folder, keep=True):
        pass
    assert (folder / "engine").is_dir()
    parser = latency_bench.argparse.ArgumentParser()
    latency_bench.add_keep_builds(parser)
    assert parser.parse_args(["--keep-builds"]).keep_builds and not parser.parse_args([]).keep_builds


def test_a_latency_ratio_pairs_each_run_with_its_peers_same_run():
    """Drift moves both systems of a run alike: the paired median holds where the medians' ratio does not."""
    latency_bench = _load("latency_bench")
    mine = [{"run": 0, "rate": 100.0}, {"run": 1, "rate": 60.0}, {"run": 2, "rate": 80.0}]
    theirs = [{"run": 0, "tok": 95.0}, {"run": 1, "tok": 57.0}, {"run": 2, "tok": 100.0}]
    # runs' ratios 1.053, 1.053, 0.8 -> median 1.05; the medians' ratio would be 80/95 = 0.84
    assert latency_bench.paired_ratio(mine, theirs, "rate", "tok") == 1.05
    # a run the peer missed (it failed) pairs with nothing; no common run gives no ratio
    assert latency_bench.paired_ratio(mine, theirs[2:], "rate", "tok") == 0.8
    assert latency_bench.paired_ratio(mine[:1], theirs[1:], "rate", "tok") is None
    assert latency_bench.paired_ratio([{"run": 0, "rate": None}], theirs, "rate", "tok") is None


def test_serving_rounds_run_each_compared_pair_back_to_back():
    """bench/serving_bench.py's order: every system once a round, each pair adjacent, the pair
    running first rotating and each pair's order alternating from round to round."""
    serving_bench = _load("serving_bench")
    names = ["llmc", "llmc-openvino", "llmc-openvino-f32", "genai", "openvino", "openvino-f32", "llmc-kv16"]
    pairs = [pair for pair in serving_bench.PAIRS if all(name in names for name in pair)]
    assert len(pairs) == 3
    orders = [serving_bench.round_order(names, round_) for round_ in range(3)]
    for round_, order in enumerate(orders):
        assert sorted(order) == sorted(names)
        for mine, theirs in pairs:
            assert abs(order.index(mine) - order.index(theirs)) == 1
            assert (order.index(mine) < order.index(theirs)) == (round_ % 2 == 0)
    assert len({tuple(sorted(order[:2])) for order in orders}) == 3  # each pair goes first once
    assert serving_bench.round_order(["llmc", "openvino"], 1) == ["openvino", "llmc"]  # no pair here


def test_a_serving_workload_gets_the_machine_limit_of_its_tokens(trained_engine):
    """bench/serving_bench.py's limit: every token through the model once, or the longest output's
    steps each reading the weights, whichever takes longer."""
    serving_bench = _load("serving_bench")
    layers, heads, kv_heads, head_dim, body, head = trained_model_shape()
    workload = [serving_bench.BenchRequest(list(range(10)), 4), serving_bench.BenchRequest(list(range(30)), 8)]
    flops = 0
    for prompt, output in ((10, 4), (30, 8)):
        attended = prompt * (prompt + 1) / 2 + sum(range(prompt + 1, prompt + output))
        flops += 2 * body * (prompt + output - 1) + 2 * head * output + 4 * heads * head_dim * layers * attended
    compute = serving_bench.workload_limit(trained_engine, {"memory_bytes_per_s": 1e15, "flops_per_s": 1e11,
                                                             "threads": 2}, workload)
    assert compute["bound"] == "compute"
    assert compute["value"] == pytest.approx(12 / (flops / 1e11), rel=0.01)
    memory = serving_bench.workload_limit(trained_engine, {"memory_bytes_per_s": 1e9, "flops_per_s": 1e15,
                                                            "threads": 2}, workload)
    read_s = 8 * (body + head) * 4 / 1e9  # the longest output's 8 steps, fp32 weights (the norms: within 5%)
    assert memory["bound"] == "memory"
    assert 12 / read_s / 1.05 < memory["value"] <= 12 / read_s


def rendered_section(tree, file: str, result: dict, title: str) -> str:
    """The section under `title` of RESULTS.md rendered with `result` as the results folder's `file`."""
    folder, output, _ = tree
    (folder / file).write_text(json.dumps(result))
    assert run(tree) == 0
    return output.read_text().split(title)[1].split("\n## ")[0]


def test_serving_renders_each_systems_share_of_the_machine_limit(tree):
    serving = copy.deepcopy(SERVING)
    serving["systems"]["llmc"]["share_of_limit"] = 0.5
    serving["limit"] = {"value": 1600.0, "bound": "compute"}
    serving["machine_limits"] = {"used": {"memory_bytes_per_s": 3.2e10, "flops_per_s": 2.0e11, "threads": 2}}
    section = rendered_section(tree, "serving.json", serving, "## Serving")
    assert "| llmc ÷ system | of the machine limit |" in section
    assert "| llmc | 800 | 2,000 | 5,000 | 1.00 | 50% |" in section
    assert "| genai | 400 | - | - | 2.00 | - |" in section  # a system without its share (not measured so)
    assert "Machine limit: 1,600 useful tok/s (compute-bound), from this run's measured bandwidth (32.0 GB/s)" in section


def test_latency_limits_render_as_two_columns_and_a_note(tree):
    folder, output, _ = tree
    latency = copy.deepcopy(LATENCY)
    latency["table"][0] |= {"limit": {"value": 80.0, "bound": "memory"}, "llmc_share_of_limit": 0.75}
    latency["table"][1] |= {"limit": {"value": 1100.0, "bound": "compute"}, "llmc_share_of_limit": 0.4}
    latency["machine_limits"] = {"used": {"memory_bytes_per_s": 3.55e10, "flops_per_s": 1.98e11, "threads": 2}}
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    assert run(tree) == 0
    section = output.read_text().split("## Latency")[1].split("\n## ")[0]
    assert "| llmc ÷ genai | machine limit | llmc of the limit |" in section
    assert "| decode, batch 1, fp32 (tok/s) | 60 | 40 | 1.50 | 80 (memory) | 75% |" in section
    assert "| decode, static batch of 16 (tok/s) | 440 | 550 | 0.80 | 1,100 (compute) | 40% |" in section
    assert "| load + first token (s) | 1.33 | - | - | - | - |" in section
    assert "measured bandwidth (35.5 GB/s) and fp32 peak (198 GFLOP/s), 2 threads" in section


def test_llmc_openvino_backend_rows_render_beside_openvino_genai(tree):
    folder, output, _ = tree
    latency = copy.deepcopy(LATENCY)
    # the ÷ columns print the benchmark's paired ratios (0.97, 1.02), not the medians' (60/64, 48/46)
    latency["table"][0] |= {"openvino": 64.0, "openvino-f32": 46.0, "llmc-openvino": 60.0, "llmc-openvino-f32": 48.0,
                            "ratio_llmc-openvino": 0.97, "ratio_llmc-openvino-f32": 1.02,
                            "limit": {"value": 70.0, "bound": "memory"}, "llmc_share_of_limit": 0.86,
                            "llmc-openvino_share_of_limit": 0.857, "llmc-openvino-f32_share_of_limit": 0.686}
    latency["table"][3] |= {"openvino": None, "openvino-f32": None}
    latency["machine_limits"] = {"used": {"memory_bytes_per_s": 3.8e10, "flops_per_s": 2.0e11, "threads": 2}}
    # each run's ratio against the same run's peer (run 1's peer is faster: 0.90, not 60/62)
    latency["runs"] = {"llmc-openvino": {"fp32": [{"run": 0, "decode_tok_s": 60.0}, {"run": 1, "decode_tok_s": 62.0}]},
                       "openvino": {"fp32": [{"run": 1, "decode_tok_s": 68.9}, {"run": 0, "decode_tok_s": 57.1}]}}
    (folder / "latency_smollm2.json").write_text(json.dumps(latency))
    assert run(tree) == 0
    section = output.read_text().split("## Latency")[1].split("\n## ")[0]
    assert ("| measure | llmc --backend openvino --bf16 | OpenVINO GenAI | ÷ | pairs' ÷ | llmc --backend openvino "
            "--kv-cache-dtype fp16 | OpenVINO GenAI f32 | ÷ | pairs' ÷ | machine limit |") in section
    assert ("| decode, batch 1, fp32 (tok/s) | 60 | 64 | 0.97 | 0.90–1.05 | 48 | 46 | 1.02 | - | 70 (memory) "
            "| 86% | 69% |") in section
    assert section.count("| decode, static batch of 16") == 1  # rows it did not run are left out of its table


def test_serving_names_llmc_openvino_against_its_like(tree):
    folder, output, _ = tree
    serving = copy.deepcopy(SERVING)
    serving["systems"] |= {"openvino": {"throughput_tok_s": 1000.0}, "llmc-openvino": {"throughput_tok_s": 1100.0}}
    serving["ratios"] = {"llmc-openvino_vs_openvino": 1.1}
    (folder / "serving.json").write_text(json.dumps(serving))
    assert run(tree) == 0
    section = output.read_text().split("## Serving")[1].split("\n## ")[0]
    assert "| llmc-openvino | 1,100 | - | - | 0.73 |" in section
    assert "with the same compute precision: llmc-openvino ÷ openvino: 1.10." in section
