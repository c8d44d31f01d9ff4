"""Packaging: everything installs under the llmc namespace, and start-up stays light."""

import json
import shutil
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# The package's own folders (the repository root is the llmc package); everything else in the
# checkout (tests, benchmarks, scripts, docs, examples, the trained model) stays out of the wheel.
NOT_PACKAGED = {"tests", "bench", "scripts", "docs", "data", "examples", "build", "out", ".ci"}
MAX_WHEEL_BYTES = 1 << 20  # 0.29 MB today: the code and precision/text only


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel and the sdist, built with `python -m build` from a copy of the checkout."""
    out = tmp_path_factory.mktemp("dist")
    # Build from a copy: setuptools leaves a build/ folder in the source tree.
    source = shutil.copytree(REPO, out / "src", ignore=shutil.ignore_patterns(
        ".git", "build", "out", "*.egg-info", "__pycache__", ".pytest_cache", ".work", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                   check=True, capture_output=True)
    (wheel,), (sdist,) = out.glob("llmc-*.whl"), out.glob("llmc-*.tar.gz")
    return wheel, sdist


def test_wheel_and_sdist_build_and_the_wheel_holds_the_package_only(distributions):
    wheel, sdist = distributions
    assert wheel.stat().st_size < MAX_WHEEL_BYTES, wheel.stat().st_size
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"llmc", "llmc-0.1.0.dist-info"}
    modules = {f"llmc/{p.relative_to(REPO)}" for p in REPO.rglob("*.py")
               if p.relative_to(REPO).parts[0] not in NOT_PACKAGED and not p.relative_to(REPO).parts[0].startswith(".")}
    assert modules - set(names) == set(), "modules missing from the wheel (pyproject's packages list)"
    assert not [n for n in names if n.split("/")[1] in NOT_PACKAGED]
    with tarfile.open(sdist) as archive:
        assert "llmc-0.1.0/pyproject.toml" in archive.getnames()
    for module in ("llmc/cli/__init__.py", "llmc/cli/compile.py", "llmc/compiler/export.py", "llmc/runtime/sampler.py",
                   "llmc/models/decoder.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read("llmc-0.1.0.dist-info/entry_points.txt").decode()
    assert "llmc = llmc.cli:entry" in entry_points


@pytest.fixture(scope="module")
def slim_install(distributions, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel without extras (pip fetches its dependencies)."""
    venv = tmp_path_factory.mktemp("slim") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(distributions[0])], check=True, capture_output=True)
    return venv / "bin"


def test_the_wheel_without_extras_runs_an_engine_made_elsewhere(slim_install, trained_onnx, tmp_path):
    from llmc.compiler.build import compile_model

    engine = tmp_path / "pystdlib.plan"
    compile_model(trained_onnx, engine)
    absent = subprocess.run([str(slim_install / "python"), "-c", "import importlib.util as u; print("
                             "[m for m in ('torch', 'onnx', 'onnxscript', 'starlette') if u.find_spec(m)])"],
                            capture_output=True, text=True, check=True)
    assert absent.stdout.strip() == "[]"
    command = ["run", str(engine), "--prompt", "def fibonacci(", "--max-new-tokens", "16", "--json"]
    slim = subprocess.run([str(slim_install / "llmc"), *command], capture_output=True, text=True)
    assert slim.returncode == 0, slim.stderr
    here = subprocess.run([sys.executable, "-m", "llmc.cli", *command], capture_output=True, text=True, check=True)
    assert json.loads(slim.stdout)["token_ids"] == json.loads(here.stdout)["token_ids"]
    assert json.loads(slim.stdout)["token_ids"], "no tokens generated"


@pytest.mark.parametrize("command, extra", [
    (["export", "tiny-llama", "-o", "{out}/model.onnx"], "export"),
    (["compile", "{onnx}", "-o", "{out}/engine.plan"], "compile"),
    (["serve", "{engine}"], "serve"),
])
def test_a_command_whose_extra_is_missing_names_it(slim_install, tiny_llama_onnx, tiny_llama_engine, tmp_path,
                                                  command, extra):
    arguments = [a.format(out=tmp_path, onnx=tiny_llama_onnx, engine=tiny_llama_engine) for a in command]
    done = subprocess.run([str(slim_install / "llmc"), *arguments], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"pip install 'llmc[{extra}]'" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_extras_that_errors_name_exist_and_the_base_install_is_the_runtime():
    import re
    import tomllib

    from llmc.errors import EXTRA_MODULES

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(EXTRA_MODULES) <= set(project["optional-dependencies"])
    base = {re.match(r"[\w.-]+", requirement).group().lower() for requirement in project["dependencies"]}
    assert base == {"numpy", "onnxruntime", "tokenizers", "click", "numba", "llvmlite"}


def test_cli_start_up_imports_neither_torch_nor_tensorrt():
    code = ("import sys, llmc.cli, llmc.llm, llmc.compiler.build; "
            "print(sorted(m for m in ('torch', 'tensorrt', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# Who imports whom: docs/ARCHITECTURE.md's import table, which must be the code's (both ways) and
# point down the stack (no cycle among the units).
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


def documented_imports() -> dict[str, set[str]]:
    table = {}
    for line in ARCHITECTURE.read_text().splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| (.+) \|", line.strip())
        if match:
            names = match.group(2).strip()
            table[match.group(1)] = set() if names == "—" else {n.strip() for n in names.split(",")}
    return table


def _llmc_imports(path: Path) -> set[str]:
    """The llmc packages or top-level modules a file imports, at any depth (lazy imports too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llmc":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("llmc.")}
    return found


def test_the_documented_import_table_is_the_codes():
    table = documented_imports()
    units = {p.stem for p in REPO.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file() and p.name not in ("tests", "bench")}
    assert set(table) == units, "docs/ARCHITECTURE.md's import table lists other units than the tree has"
    actual = {}
    for unit in units:
        files = [REPO / f"{unit}.py"] if (REPO / f"{unit}.py").is_file() else sorted((REPO / unit).rglob("*.py"))
        actual[unit] = set().union(*(_llmc_imports(f) for f in files)) - {unit}
    assert actual == table


def test_imports_point_down_the_stack():
    table, placed = documented_imports(), []
    while len(placed) < len(table):  # peel off the units whose imports are all placed: no cycle
        ready = sorted(u for u, needs in table.items() if u not in placed and needs <= set(placed))
        assert ready, f"an import cycle among {sorted(set(table) - set(placed))}"
        placed += ready


def test_every_path_the_architecture_names_exists():
    named = set(re.findall(r"\b[\w/]+\.py\b", ARCHITECTURE.read_text()))
    missing = sorted(path for path in named if not (REPO / path).is_file())
    assert named and missing == []


def test_serving_an_engine_loads_no_compiler():
    code = ("import sys, llmc.llm, llmc.runtime.engine, llmc.runtime.async_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['llmc', 'compiler'], ['llmc', 'passes'], "
            "['llmc', 'precision'], ['llmc', 'models'])))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_importing_the_runtime_leaves_numba_to_the_kernel_loading_thread():
    # `import numba` costs 0.23 s: CpuPagedAttention imports the kernels in its loading thread.
    code = "import sys, llmc.llm, llmc.runtime.engine; print('numba' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


SERVE_ONE_REQUEST = """
import sys
from llmc import LLM, SamplingParams
llm = LLM(sys.argv[1], threads=1)
[completion] = llm.generate(["def f(x):" * 4], SamplingParams(max_new_tokens=2, ignore_eos=True))
assert len(completion.token_ids) == 2
print(sorted({m.split(".")[0] for m in sys.modules} & {"onnx", "torch", "onnxscript", "ml_dtypes"}))
"""


def test_serving_an_engine_imports_no_onnx(tiny_llama_engine):
    # `import onnx` alone cost 0.7 s of start-up: the engine stores what serving would build
    # with it (the dense attention's model); a prompt chunk and a decode exercise both paths.
    done = subprocess.run([sys.executable, "-c", SERVE_ONE_REQUEST, str(tiny_llama_engine)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
