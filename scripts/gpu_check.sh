#!/usr/bin/env bash
# Check the Triton paged-attention kernel against the NumPy reference and time decode, on a
# machine with an NVIDIA GPU, torch and triton (no TensorRT). Under 5 minutes; exits non-zero on
# any mismatch. Arguments go to scripts/gpu_check.py (--quick, --no-timing; --cpu-interpret
# runs a tiny grid on CPU with Triton's interpreter).
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

exec timeout 290 python scripts/gpu_check.py "$@"
