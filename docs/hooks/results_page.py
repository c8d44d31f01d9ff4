"""mkdocs hook: bench/RESULTS.md published as the site's results.md.

mkdocs reads pages from docs/ only, and a link out of it fails the strict build. The results
file lives in bench/ beside the script that generates it (bench/results.py), so it is added to
the site here, read from its one place rather than copied into docs/ where it could go stale.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"
PAGE = "results.md"


def on_files(files, config):
    if not RESULTS.is_file():
        raise PluginError(f"{RESULTS}: missing; the benchmarks page links to it")
    files.append(File.generated(config, PAGE, abs_src_path=str(RESULTS)))
    return files
