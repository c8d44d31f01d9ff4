"""Export a checkpoint folder with Optimum; run by the Optimum venv's python, not by pytest.

    <optimum-venv>/bin/python tests/optimum_export.py CHECKPOINT OUT_FOLDER [--cli]

Optimum (optimum-onnx 0.1.0) pins transformers < 4.58, so it lives in a venv of its own
(`exporters.optimum_python`), where transformers 4.57 shadows the project's 5.x. The checkpoint
comes from `hf_checkpoints.write_hf_checkpoint` (transformers 5), whose config.json spells rotary
settings as transformers 5 does (`rope_parameters`); this script copies the folder and adds the
4.x spellings (`rope_theta`, `rope_scaling`, `partial_rotary_factor`, GPT-NeoX's `rotary_pct` and
`rotary_emb_base`, Gemma 3's `rope_local_base_freq`) before exporting, so 4.57 builds the same
model. Weight names are the same in both versions for the families tested; the tests compare the
export with transformers 5 anyway.

The export is Optimum's own: `main_export(task="text-generation-with-past")`, the Python form of
`optimum-cli export onnx --task text-generation-with-past`, or with --cli that command itself (the
venv's optimum-cli, as a user runs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def config_for_transformers4(config: dict) -> dict:
    """`config` with the transformers 4.x keys for what transformers 5 keeps in rope_parameters."""
    config = dict(config)
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return config
    if "full_attention" in rope:  # Gemma 3: one entry per layer type
        local = rope.get("sliding_attention", {})
        if "rope_theta" in local:
            config.setdefault("rope_local_base_freq", local["rope_theta"])
        rope = rope["full_attention"]
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
        config.setdefault("rotary_emb_base", rope["rope_theta"])
    if "partial_rotary_factor" in rope:
        config.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        config.setdefault("rotary_pct", rope["partial_rotary_factor"])
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        config.setdefault("rope_scaling", scaling)
    return config


def main(checkpoint: Path, out: Path, cli: bool) -> None:
    source = out.parent / f"{out.name}-checkpoint"
    if source.exists():
        shutil.rmtree(source)
    shutil.copytree(checkpoint, source)
    config_path = source / "config.json"
    config_path.write_text(json.dumps(config_for_transformers4(json.loads(config_path.read_text())), indent=2))

    if cli:
        command = Path(sys.executable).with_name("optimum-cli")
        subprocess.run([str(command), "export", "onnx", "--model", str(source), "--task",
                        "text-generation-with-past", str(out)], check=True)
    else:
        from optimum.exporters.onnx import main_export

        main_export(str(source), output=str(out), task="text-generation-with-past", device="cpu",
                    do_validation=False)
    shutil.rmtree(source)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), cli=sys.argv[3:] == ["--cli"])
