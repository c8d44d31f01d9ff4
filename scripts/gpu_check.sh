#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, torch with CUDA and triton (no TensorRT, no network needed):
# 1. scripts/gpu_check.py: the Triton paged-attention kernel against the NumPy reference (JIT),
#    the plugin's AOT PTX loaded through the CUDA driver and launched as TensorRT launches it,
#    made-up metadata in subprocesses, decode timing; prints the PTX and driver CUDA versions;
# 2. scripts/gpu_check_tensorrt.py, where TensorRT is installed: engines for tiny-llama and the
#    trained model, greedy tokens against the onnxruntime engine, the accuracy gate, llmc bench.
#    Without TensorRT it says SKIP, which is not a failure (--require-tensorrt makes it one).
# One line per check and a summary; exits non-zero on any failure. Under 5 minutes without
# TensorRT (its builds add a few more). gpu_check.py runs its quick grid unless --full is given;
# other arguments go to it (--no-timing; --cpu-interpret runs a tiny grid on CPU with Triton's
# interpreter); --no-tensorrt skips the TensorRT part.
set -euo pipefail
cd "$(dirname "$0")/.."

# The GPU machine brings its own CUDA torch, which the project's pinned CPU torch must not
# replace: install llmc itself without dependencies, and without network if need be.
is_this_checkout='import llmc, os, sys; sys.exit(not os.path.samefile(os.path.dirname(llmc.__file__), "."))'
if ! python -c "$is_this_checkout" 2>/dev/null; then
    python -m pip install -q --root-user-action=ignore --no-deps --no-build-isolation --no-index -e . \
        >/dev/null 2>&1 || true
fi
if ! python -c "$is_this_checkout" 2>/dev/null; then
    # No pip or setuptools here: import the checkout as `llmc` through a symlink.
    shim="$(mktemp -d)"
    ln -s "$PWD" "$shim/llmc"
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi

quick=--quick
kernel_args=()
tensorrt_args=()
for arg in "$@"; do
    case "$arg" in
        --full) quick= ;;
        --no-tensorrt) tensorrt_args+=(--skip) ;;
        --require-tensorrt) tensorrt_args+=(--require-tensorrt) ;;
        *) kernel_args+=("$arg") ;;
    esac
done
status=0
# shellcheck disable=SC2086  # $quick: one word or none
timeout 240 python scripts/gpu_check.py $quick ${kernel_args[@]+"${kernel_args[@]}"} || status=1
timeout 330 python scripts/gpu_check_tensorrt.py ${tensorrt_args[@]+"${tensorrt_args[@]}"} || status=1
exit $status
