#!/usr/bin/env bash
# The main job end to end: install; export the built-in tiny-llama (with the parity check against
# PyTorch), compile and inspect it; then the same for the model trained on Python's standard
# library (data/pystdlib-llama), which generates. Everything lands in out/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --root-user-action=ignore -e ".[export]"
mkdir -p out
llmc export tiny-llama -o out/model.onnx
llmc compile out/model.onnx -o out/engine.plan
llmc inspect out/engine.plan
# tiny-llama's weights are random: generating from it shows nothing. The trained model has learned Python.
llmc export data/pystdlib-llama -o out/pystdlib.onnx
llmc compile out/pystdlib.onnx --fp16 --int8-calib data/pystdlib-text/calib -o out/pystdlib.plan
llmc run out/pystdlib.plan --prompt "def fibonacci(" --max-new-tokens 48
