"""Suite ``torch``: PyTorch autocast against jaxamp on the CPU, alternated in one process.

    python -m benchmarks torch [--rounds 20]   # needs torch (pip install torch==2.13.0)

The encoder of the overhead suite in PyTorch (fp32, and ``autocast(bfloat16)`` plus
``GradScaler``), timed in rotating rounds with the jax fp32 step and jaxamp's
``mixed_bfloat16`` step; ratios are the median of the per-round ratios.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import jaxamp
from benchmarks import harness
from benchmarks import overhead
from benchmarks.peers import pytorch_recipe

ROUNDS = 30
JAX_SYSTEMS = ("jax fp32", "jaxamp mixed_bfloat16")
TORCH_SYSTEMS = {"PyTorch fp32": False, "PyTorch autocast-bf16": True}  # label: amp


def _jax_runners(cfg, batch_size):
    """``(runners, first-step losses, batch)`` of the jax fp32 and jaxamp bf16 steps."""
    task = overhead.encoder_task(cfg, batch_size)
    steps = dict(zip(JAX_SYSTEMS, (overhead.plain_variant(task, cast=False),
                                   overhead.jaxamp_variant(task, "mixed_bfloat16")), strict=True))
    compiled, states = harness.compile_variants(steps, task.batch)
    runners: dict[str, Callable[[], object]] = {}
    first_loss: dict[str, float] = {}
    for label, v in steps.items():
        first_loss[label] = float(compiled[label](v.fresh(), task.batch)[1])
        runners[label] = harness.stepper(compiled, states, label, task.batch)
    return runners, first_loss, task.batch


def run(args) -> list[dict]:
    if harness.skip_without_torch("torch", args.out):
        return []
    import torch
    cfg, batch_size = overhead.encoder_config(args.tiny)
    runners, first_loss, batch = _jax_runners(cfg, batch_size)
    for label, amp in TORCH_SYSTEMS.items():
        runners[label] = pytorch_recipe.encoder_step(cfg, batch, amp)
    times = harness.time_rounds(runners, args.rounds)
    secs = {k: statistics.median(t) for k, t in times.items()}
    rows = [{"system": k, "median_ms": 1e3 * s,
             "vs_torch_autocast": harness.paired_ratio(times, k, "PyTorch autocast-bf16")[0],
             "vs_torch_fp32": harness.paired_ratio(times, k, "PyTorch fp32")[0],
             "first_loss": first_loss.get(k),
             "xla_flags": os.environ.get("XLA_FLAGS", "")} for k, s in secs.items()]
    best = min(JAX_SYSTEMS, key=secs.__getitem__)
    auto = jaxamp.get_policy("auto")
    header = (f"{harness.machine()}, torch {torch.__version__} ({torch.get_num_threads()} "
              f"threads); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; encoder {cfg}, batch "
              f"{batch_size}, adamw; {args.rounds} alternated rounds. `auto` resolves to "
              f"{auto.compute_dtype.name} here; the fastest jax row is `{best}`.")
    harness.write_outputs("torch", rows, ["system", "median_ms", "vs_torch_autocast",
                                          "vs_torch_fp32"],
                          args.out, ("system", "vs_torch_autocast"), header)
    return rows
