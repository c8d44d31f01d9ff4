"""The documentation: the README is a short front door, and docs/ builds as a site in strict mode
(a broken link, an unknown anchor or a page left out of the nav fails), with a CLI reference
rendered from click's own help."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 150
# The two set-up commands: .ci/run and the quickstart rely on these exact lines staying first.
SETUP_COMMANDS = (
    "bash scripts/quickstart.sh ",
    'python -m pip install --root-user-action=ignore -e ".[test]" && python -m pytest -n 2 ',
)


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, cwd=config.parent)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(REPO / "mkdocs.yml", out)
    assert result.returncode == 0, result.stderr
    return out


def test_the_site_builds_in_strict_mode_with_every_page(site):
    for page in ("index", "exporting", "compiling", "precision", "engine-file", "running", "serving", "tensorrt",
                 "ci", "benchmarks", "results", "design-notes", "ARCHITECTURE", "cli"):
        path = site / (page + ".html" if page == "index" else f"{page}/index.html")
        assert path.is_file(), f"{page} missing from the built site"
    assert not (site / "hooks").exists(), "the build hooks were published as pages"


def test_the_results_page_is_bench_results_md(site):
    html = (site / "results" / "index.html").read_text()
    first_heading = next(line for line in (REPO / "bench" / "RESULTS.md").read_text().splitlines()
                         if line.startswith("# "))
    assert first_heading[2:].strip() in html


def test_the_cli_reference_holds_every_commands_help(site):
    from llmc.cli import main

    html = (site / "cli" / "index.html").read_text()
    assert "&lt;!-- cli-reference --&gt;" not in html and "<!-- cli-reference -->" not in html
    headings = re.findall(r"<h2 id=\"[^\"]*\">(.*?)</h2>", html)
    assert set(headings) == {"llmc"} | {f"llmc {name}" for name in main.commands}
    for name, command in main.commands.items():
        assert f"Usage: llmc {name} [OPTIONS]" in html
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in html, f"llmc {name}: {opt} missing from the CLI reference"


def copy_docs(tmp_path: Path) -> Path:
    """The docs and mkdocs.yml in a scratch tree that still finds bench/RESULTS.md."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "RESULTS.md", tmp_path / "bench" / "RESULTS.md")
    return tmp_path / "mkdocs.yml"


def test_a_broken_link_fails_the_build(tmp_path):
    config = copy_docs(tmp_path)
    page = tmp_path / "docs" / "running.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr


def test_a_cli_page_without_its_marker_fails_the_build(tmp_path):
    config = copy_docs(tmp_path)
    (tmp_path / "docs" / "cli.md").write_text("# CLI reference\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "cli-reference" in result.stderr


def test_the_readme_is_short_and_starts_with_the_two_set_up_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    body = [line for line in lines if line.strip()]
    assert body[0].startswith("# "), "README.md must open with its title"
    assert body[1] == "```bash"
    for line, command in zip(body[2:4], SETUP_COMMANDS):
        assert line.startswith(command), f"README.md's set-up command changed: {line!r}"
    assert body[4] == "```"


def test_the_readme_holds_the_results_markers_and_links_that_resolve():
    text = README.read_text()
    assert "<!-- results:begin -->" in text and "<!-- results:end -->" in text
    assert text.index("<!-- results:begin -->") < text.index("<!-- results:end -->")
    assert "(bench/RESULTS.md)" in text[text.index("<!-- results:end -->"):]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_ci_runs_the_readmes_test_command():
    test_command = SETUP_COMMANDS[1].split("&&")[1].strip()
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()
