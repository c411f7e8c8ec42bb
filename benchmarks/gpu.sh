#!/usr/bin/env bash
# The GPU suite (python -m benchmarks gpu) on a GPU machine, one set of rows per command, each
# command within 9 minutes (a GPU is lent for 15 minutes in all, 10 per command):
#
#   bash benchmarks/gpu.sh                     # the core set: the rows that decide the GPU goals
#   SET=extended bash benchmarks/gpu.sh        # the rest, appended to the same OUT
#   BUDGET=300 bash benchmarks/gpu.sh          # stop before 300 s (default 510)
#   OUT=/tmp/gpu bash benchmarks/gpu.sh --steps 10   # extra arguments go to the suite
#   JAX_PLATFORMS=cpu bash benchmarks/gpu.sh --tiny  # what the tests run
#
# The core set (benchmarks/gpu.py, CORE), in the order it runs: ResNet-50 mixed_bfloat16,
# bare_bf16, mixed_bfloat16_select, torch_amp_bf16, fp32_default, fp32_highest,
# torch_compile_bf16; BERT-Large mixed_bfloat16, bare_bf16, mixed_bfloat16_select, fp32_default,
# fp32_highest, mixed_fp8_current, mixed_bfloat16_kahan; the user's GPT autocast_bf16,
# fp32_default. A model's JAX rows compile concurrently (--compile-workers, 4 on a GPU) before
# they are timed one by one; the arithmetic that makes the set fit is in BENCHMARKS.md (GPU).
#
# --budget BUDGET stops the suite before BUDGET seconds: a row whose estimate no longer fits is
# written as "not run", and an alarm at BUDGET ends a row that overruns; every finished row is
# on disk (each is appended as soon as it is done). `timeout` 30 s later is the backstop.
#
# Writes under $OUT (default runs/gpu): gpu.jsonl (one row per configuration), gpu_runs.jsonl
# (versions, devices, measured matmul peaks of each command), gpu.md (the table), gpu.png, and
# the command's log gpu_<SET>.log. SET=core starts OUT afresh, other sets append to it.
#
# It builds no environment and installs nothing: $PYTHON (default python) must already have
# jax with CUDA, flax, optax, matplotlib and, for the torch rows, torch and torchvision (jmp and
# equinox are not needed).
set -u -o pipefail

PYTHON=${PYTHON:-python}
SET=${SET:-core}
BUDGET=${BUDGET:-510}
OUT=${OUT:-runs/gpu}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
cd "$(dirname "$0")/.." || exit 1

export PYTHONPATH=.
# cuda runs the rows; cpu initialises the models' params (XLA:CPU compiles an init in seconds,
# XLA:GPU in tens of seconds: benchmarks/gpu.py, _init).
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
export MPLBACKEND=Agg
# XLA:GPU's autotuner keeps what it measured for each fusion under OUT/autotune: a model's rows
# share most of their matmuls (mixed_bfloat16, _select, _kahan and bare_bf16 differ around
# them), and a fusion tuned once is read back instead of timed again, in this command and the
# next. Every kernel is still the autotuner's choice; only repeated tuning is saved (the
# arithmetic in BENCHMARKS.md does not count on it). Harmless on a CPU.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$OUT/autotune"
# JAX preallocates this fraction of the GPU's memory (139 GiB on the H200) for its pool, and
# torch, in the same process, gets only what is left. The largest JAX row is BERT-Large at
# 64 x 512 in fp32: 96.75 GB compiled on the H200 (90 GiB). 0.78 gives JAX 108 GiB and leaves
# 31 GiB for torchvision's ResNet-50 at batch 256 under AMP (11.9 GB measured) and the two CUDA
# contexts.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.78}

case $SET in
    core) rm -f "$OUT/gpu.jsonl" "$OUT/gpu_runs.jsonl" ;;
    extended | all) ;;
    *)
        echo "gpu.sh: SET=$SET: expected core, extended or all" >&2
        exit 2 ;;
esac
mkdir -p "$OUT/autotune"

echo "== gpu.sh: $PYTHON -m benchmarks gpu --set $SET --budget $BUDGET --append --out $OUT $*"
timeout $((${BUDGET%.*} + 30)) "$PYTHON" -m benchmarks gpu --set "$SET" --budget "$BUDGET" \
    --append --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_$SET.log"
status=$?
[ "$status" -ne 0 ] && echo "== gpu.sh: the suite exited with $status (124: timed out)" >&2
"$PYTHON" -m benchmarks gpu --render-only --out "$OUT" > /dev/null || status=$?
echo "== gpu.sh: wrote $OUT/gpu.jsonl, gpu_runs.jsonl, gpu.md, gpu.png (exit status $status)"
exit "$status"
