#!/usr/bin/env bash
# The GPU suite (python -m benchmarks gpu) on a GPU machine, in two halves, each under
# `timeout 590` so that it fits a 10-minute limit per command:
#
#   bash benchmarks/gpu.sh                    # both halves, then the report; from the repo root
#   HALF=first bash benchmarks/gpu.sh         # ResNet-50 and torchvision's (about 4 minutes)
#   HALF=second bash benchmarks/gpu.sh        # BERT-Large and the user's GPT (about 5 minutes)
#   OUT=/tmp/gpu bash benchmarks/gpu.sh --steps 10   # extra arguments go to both halves
#   JAX_PLATFORMS=cpu bash benchmarks/gpu.sh --tiny  # what the tests run
#
# The minutes are estimates: the suite has not run on a GPU yet. Where one command may take at
# most 10 minutes, run HALF=first and HALF=second as two commands with the same OUT. A half that
# fails or times out keeps the rows it measured (each is appended as soon as it is done) and the
# next half runs anyway; the exit status is the first non-zero one.
#
# Writes under $OUT (default runs/gpu): gpu.jsonl (one row per configuration), gpu_runs.jsonl
# (versions, devices, measured matmul peaks of each half), gpu.md (the table), gpu.png, and the
# two halves' logs gpu_first.log and gpu_second.log.
#
# It builds no environment and installs nothing: $PYTHON (default python) must already have
# jax with CUDA, flax, optax, matplotlib and, for the torch rows, torch and torchvision.
set -u -o pipefail

PYTHON=${PYTHON:-python}
HALF=${HALF:-both}
OUT=${OUT:-runs/gpu}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
cd "$(dirname "$0")/.." || exit 1

export PYTHONPATH=.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export MPLBACKEND=Agg
# JAX preallocates this fraction of the GPU's memory (139 GiB on the H200) for its pool, and
# torch, in the same process in the first half, gets only what is left. The largest JAX row is
# BERT-Large at 64 x 512 in fp32: 82.1 GB of activations saved for the backward pass (counted
# with jaxamp.audit_grad), 5.4 GB of state (params, fp32 master, adamw's moments), 1.3 GB of
# gradients and the backward pass's temporaries (the 4 GB gradient of the MLM logits, about
# twice): about 100 GB, 93 GiB. 0.78 gives JAX 108 GiB (16% above that) and leaves 31 GiB for
# torchvision's ResNet-50 at batch 256 under AMP (about 11 GB of bf16 activations in the JAX
# model, perhaps twice that in torch's, 0.4 GB of state, cuDNN's workspaces) and the two CUDA
# contexts. JAX's own ResNet-50 rows need about 30 GB at fp32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.78}

mkdir -p "$OUT"
status=0

half() {  # half NAME ARGS...: one half under a timeout, its output kept in OUT/gpu_NAME.log
    local name=$1
    shift
    echo "== gpu.sh: $name half: $PYTHON -m benchmarks gpu --append --out $OUT $*"
    timeout 590 "$PYTHON" -m benchmarks gpu --append --out "$OUT" "$@" 2>&1 \
        | tee "$OUT/gpu_$name.log"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "== gpu.sh: the $name half exited with $rc (124: timed out); going on" >&2
        [ "$status" -eq 0 ] && status=$rc
    fi
}

case $HALF in
    both | first)
        rm -f "$OUT/gpu.jsonl" "$OUT/gpu_runs.jsonl" ;;
    second) ;;
    *)
        echo "gpu.sh: HALF=$HALF: expected both, first or second" >&2
        exit 2 ;;
esac
if [ "$HALF" != second ]; then
    half first ${GPU_FIRST:---models resnet50} "$@"
fi
if [ "$HALF" != first ]; then
    half second ${GPU_SECOND:---models bert_large,nnx_gpt} "$@"
fi
"$PYTHON" -m benchmarks gpu --render-only --out "$OUT" || status=$?
echo "== gpu.sh: wrote $OUT/gpu.jsonl, gpu_runs.jsonl, gpu.md, gpu.png (exit status $status)"
exit "$status"
