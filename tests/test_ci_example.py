"""examples/ci/: the GitHub Actions workflow lints clean, and its script builds, caches, gates and
publishes engines of the trained model on CPU (the TensorRT job needs a GPU runner)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "examples" / "ci"
SCRIPT = CI / "build_engine.py"
TEXT = REPO / "data" / "pystdlib-text"


def _actionlint(workflow: Path) -> subprocess.CompletedProcess:
    assert shutil.which("actionlint") and shutil.which("shellcheck"), "the test extras install both"
    return subprocess.run(["actionlint", "-no-color", "-config-file", str(CI / "actionlint.yaml"), str(workflow)],
                          capture_output=True, text=True)


def test_the_workflow_passes_actionlint_with_shellcheck_on_its_run_steps():
    done = _actionlint(CI / "llmc-engines.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = (CI / "llmc-engines.yml").read_text().replace("steps.build.outputs.artifact-path",
                                                           "steps.missing.outputs.artifact-path")
    (tmp_path / "broken.yml").write_text(broken.replace("runs-on: ubuntu-latest", "runs-on: ubuntu-lastest"))
    done = _actionlint(tmp_path / "broken.yml")
    assert done.returncode == 1
    assert "missing" in done.stdout and "ubuntu-lastest" in done.stdout, done.stdout


def test_the_workflow_passes_only_options_and_precisions_the_script_has():
    import yaml

    workflow = yaml.safe_load((CI / "llmc-engines.yml").read_text())
    usage = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for job in workflow["jobs"].values():
        [build] = [step for step in job["steps"] if step.get("id") == "build"]
        for option in re.findall(r"(--[a-z-]+)", build["run"]):
            assert option in usage, option
        for precision in job["strategy"]["matrix"]["precision"]:
            assert precision in usage, precision


def _build(model, out: Path, *options: str, env_output: Path | None = None) -> tuple[int, dict, str]:
    env = {"GITHUB_OUTPUT": str(env_output)} if env_output else {}
    done = subprocess.run([sys.executable, str(SCRIPT), str(model), "--heldout", str(TEXT / "heldout"),
                           "--cache", str(out / "cache"), "--out", str(out / "dist"), *options],
                          capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k != "GITHUB_OUTPUT"}, **env})
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_an_engine_is_published_then_taken_from_the_cache_and_a_corrupted_entry_is_rebuilt(trained_onnx, tmp_path):
    status, first, log = _build(trained_onnx, tmp_path, env_output=tmp_path / "outputs")
    assert status == 0, log
    published = Path(first["published"])
    assert published.name == f"model-onnxruntime-fp32-{first['sha256'][:12]}" == first["artifact"]
    assert sorted(p.name for p in published.iterdir()) == [
        "accuracy.json", "bench.json", "compile.json", "engine.plan", "run.json"]
    assert hashlib.sha256((published / "engine.plan").read_bytes()).hexdigest() == first["sha256"]
    assert json.loads((published / "compile.json").read_text())["sha256"] == first["sha256"]
    accuracy = json.loads((published / "accuracy.json").read_text())
    assert accuracy["passed"] and abs(accuracy["ppl_increase_pct"]) < 1e-3  # fp32: the graph's own numbers
    assert json.loads((published / "run.json").read_text())["token_ids"]
    assert json.loads((published / "bench.json").read_text())["requests"] == 8
    assert not first["cached"] and "cache miss" in log
    assert f"artifact={first['artifact']}\nartifact-path={published}\n" == (tmp_path / "outputs").read_text()

    status, second, log = _build(trained_onnx, tmp_path)
    assert status == 0 and second["cached"] and "cache hit" in log, log
    assert second["artifact"] == first["artifact"]

    [entry] = (tmp_path / "cache").iterdir()
    engine = bytearray((entry / "engine.plan").read_bytes())
    engine[len(engine) // 2] ^= 0xFF
    (entry / "engine.plan").write_bytes(engine)
    status, third, log = _build(trained_onnx, tmp_path)
    assert status == 0 and not third["cached"] and "corrupted" in log, log
    assert hashlib.sha256((Path(third["published"]) / "engine.plan").read_bytes()).hexdigest() == third["sha256"]


def test_an_engine_the_gate_refuses_fails_the_job_with_its_report_and_is_not_published(trained_onnx, tmp_path):
    status, result, log = _build(trained_onnx, tmp_path, "--precision", "int4", "--calib", str(TEXT / "calib"),
                                 "--max-ppl-increase", "0.001", env_output=tmp_path / "outputs")
    assert status == 1, log
    assert result["published"] is None and "gate refused" in result["error"]
    rejected = Path(result["rejected"])
    assert sorted(p.name for p in rejected.iterdir()) == ["accuracy.json", "compile.json"]
    report = json.loads((rejected / "accuracy.json").read_text())
    assert not report["passed"] and report["ppl_increase_pct"] > 0.001
    assert [p.name for p in (tmp_path / "dist").iterdir()] == ["rejected"]
    assert (tmp_path / "outputs").read_text() == f"report-path={rejected}\n"


@pytest.mark.parametrize("model, options, message", [
    ("missing.onnx", [], "missing.onnx: no such file"),
    ("{onnx}", ["--precision", "int4"], "--precision int4 needs --calib"),
    ("{onnx}", ["--calib", "nowhere/"], "--calib: nowhere/ is not a folder"),
])
def test_bad_input_exits_2_naming_it_and_publishes_nothing(trained_onnx, tmp_path, model, options, message):
    done = subprocess.run([sys.executable, str(SCRIPT), model.format(onnx=trained_onnx), *options, "--heldout",
                           str(TEXT / "heldout"), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "dist")],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())
