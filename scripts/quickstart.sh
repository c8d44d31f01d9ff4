#!/usr/bin/env bash
# The main job end to end on the built-in tiny-llama: install, export (with the parity check
# against PyTorch), compile, inspect, run. Everything lands in out/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --root-user-action=ignore -e .
mkdir -p out
llmc export tiny-llama -o out/model.onnx
llmc compile out/model.onnx -o out/engine.plan
llmc inspect out/engine.plan
llmc run out/engine.plan --prompt "def fibonacci(" --max-new-tokens 32
