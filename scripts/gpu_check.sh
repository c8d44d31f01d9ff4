#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, torch and triton: check the Triton paged-attention kernel against
# the NumPy reference and time decode (scripts/gpu_check.py), then the TensorRT path end to end
# (scripts/gpu_check_tensorrt.py: build engines for tiny-llama and the trained model, greedy tokens
# against the onnxruntime engine, the accuracy gate on fp16 and int8 engines, llmc bench). One line
# per check and a summary; exits non-zero on any failure; under 10 minutes once TensorRT is
# installed. Arguments go to scripts/gpu_check.py (--quick, --no-timing; --cpu-interpret runs a
# tiny grid on CPU with Triton's interpreter); --no-tensorrt skips the TensorRT part (a machine
# without TensorRT: it then says so and exits non-zero unless asked to skip).
set -euo pipefail
cd "$(dirname "$0")/.."

# The GPU machine brings its own CUDA torch, which the project's pinned CPU torch must not
# replace: install llmc itself without dependencies, and without network if need be.
is_this_checkout='import llmc, os, sys; sys.exit(not os.path.samefile(os.path.dirname(llmc.__file__), "."))'
if ! python -c "$is_this_checkout" 2>/dev/null; then
    python -m pip install -q --root-user-action=ignore --no-deps --no-build-isolation -e . \
        >/dev/null 2>&1 || true
fi
if ! python -c "$is_this_checkout" 2>/dev/null; then
    # No pip or setuptools here: import the checkout as `llmc` through a symlink.
    shim="$(mktemp -d)"
    ln -s "$PWD" "$shim/llmc"
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
python -c "import triton" 2>/dev/null \
    || python -m pip install -q --root-user-action=ignore "triton>=3" \
    || echo "gpu_check.sh: triton is missing and could not be installed" >&2

tensorrt=1
args=()
for arg in "$@"; do
    if [ "$arg" = "--no-tensorrt" ]; then tensorrt=0; else args+=("$arg"); fi
done
status=0
timeout 240 python scripts/gpu_check.py "${args[@]}" || status=1
if [ "$tensorrt" = 1 ]; then
    python -c "import tensorrt, polygraphy" 2>/dev/null \
        || python -m pip install -q --root-user-action=ignore "tensorrt>=11" "polygraphy>=0.49" \
        || echo "gpu_check.sh: TensorRT could not be installed (pip install 'tensorrt>=11')" >&2
    timeout 330 python scripts/gpu_check_tensorrt.py || status=1
else
    echo "SKIP tensorrt: --no-tensorrt"
fi
exit $status
