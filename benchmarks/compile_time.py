"""Suite ``compile_time``: what autocast costs before the first step, the trace, lowering and
XLA compile of the whole train step with ``autocast=True`` against the same step without it.

    python -m benchmarks compile_time [--rounds 3] [--tiny]              # XLA:CPU
    JAX_PLATFORMS=cpu .venv-gpu/bin/python -m benchmarks compile_time    # and XLA:GPU, an H200

The user's NNX GPT of ``train/models/nnx_gpt.py`` (flax's layers with their defaults, fp32, no
``dtype=``) at 12 layers x 768 and at 24 layers x 512, vocabulary 8192, batch 8 x 128, adam,
``mixed_bfloat16``, three steps of the same model:

- ``plain``: ``make_train_step(loss_fn)``. The model as written computes in fp32 on the bf16
  working params (its norms and causal mask promote the matmuls back), so this step has no
  bf16 op to compile.
- ``bf16 layers``: the same model with ``dtype=jnp.bfloat16`` passed to every layer, the
  hand-written mixed precision that autocast replaces: a bf16 program, as autocast's is.
- ``autocast=True``: the model as written, under autocast.

Each round builds the steps anew and times ``jax.jit(step).trace``, ``.lower()`` and
``.compile()``, the three in a rotating order; the ratios are taken per round and their median
reported, since times on a 2-core machine swing from run to run. The compiler is XLA:CPU, and,
where jax's CUDA plugin is installed (``make install-gpu-memory`` builds ``.venv-gpu``), also
XLA:GPU compiling for an H200 with no GPU (``jaxamp.memory.gpu_mesh``: abstract arguments, nothing
runs, nothing autotuned), ``--gpu-rounds`` rounds of it. XLA:CPU has no bf16 arithmetic: it
widens every bf16 op to fp32 and back, which makes any bf16 program slower to compile than
the fp32 one (the ``bf16 layers`` row shows by how much).
"""

from __future__ import annotations

import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import harness

ROUNDS = 3
GPU_ROUNDS = 2
STEPS = ("plain", "bf16 layers", "autocast=True")
CPU, GPU = "XLA:CPU", "XLA:GPU, H200 (deviceless)"


def add_arguments(ap) -> None:
    ap.add_argument("--gpu-rounds", type=int, default=GPU_ROUNDS,
                    help="rounds of the XLA:GPU compile, where jax's CUDA plugin is installed "
                         f"(default {GPU_ROUNDS}; 0: none)")


def _cases(tiny: bool) -> dict[str, dict]:
    if tiny:
        return {"NNX GPT 2 x 64 (tiny)": dict(depth=2, width=64, heads=2, vocab=64,
                                              batch=(2, 9))}
    return {"NNX GPT 12 x 768": dict(depth=12, width=768, heads=12, vocab=8192, batch=(8, 129)),
            "NNX GPT 24 x 512": dict(depth=24, width=512, heads=8, vocab=8192, batch=(8, 129))}


def _gpu_mesh() -> jax.sharding.Mesh | None:
    try:
        return jaxamp.memory.gpu_mesh("h200")
    except Exception:  # noqa: BLE001 - no CUDA plugin: XLA:CPU alone
        return None


def _seconds(loss_fn, args, autocast: bool) -> tuple[float, float, float]:
    """``(trace, lower, compile)`` seconds of a newly built step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain step's fp32-matmul warning
        step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=autocast))
        t0 = time.perf_counter()
        traced = step.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def _median_ratio(times: dict, step: str, base: str) -> tuple[float, list[float]]:
    ratios = [sum(a) / sum(b) for a, b in zip(times[step], times[base], strict=True)]
    return statistics.median(ratios), [round(x, 3) for x in ratios]


def rows(tiny: bool, rounds: int, gpu_rounds: int) -> list[dict]:
    from train.models import nnx_gpt
    mesh = _gpu_mesh() if gpu_rounds > 0 else None
    compilers = {CPU: rounds, **({GPU: gpu_rounds} if mesh is not None else {})}
    out = []
    for label, case in _cases(tiny).items():
        dims = dict(vocab=case["vocab"], width=case["width"], depth=case["depth"],
                    heads=case["heads"])
        loss_fn, params = nnx_gpt.loss_and_params(**dims)
        bf16_loss_fn, _ = nnx_gpt.loss_and_params(**dims, dtype=jnp.bfloat16)
        steps = {"plain": (loss_fn, False), "bf16 layers": (bf16_loss_fn, False),
                 "autocast=True": (loss_fn, True)}
        tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
        state = jaxamp.TrainState.create(params=params, tx=tx)
        batch = {"tokens": jnp.zeros(case["batch"], jnp.int32)}
        for compiler, n in compilers.items():
            args = (state, batch)
            if compiler == GPU:
                on_gpu = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                args = jax.tree.map(lambda x, s=on_gpu: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=s), args)
            times: dict[str, list[tuple[float, float, float]]] = {s: [] for s in STEPS}
            for r in range(n):
                for step in STEPS[r % len(STEPS):] + STEPS[:r % len(STEPS)]:
                    loss, autocast = steps[step]
                    times[step].append(_seconds(loss, args, autocast))
                    print(f"  {label}, {compiler}, round {r + 1}/{n}, {step}: "
                          f"{sum(times[step][-1]):.1f} s", flush=True)
            for step in STEPS:
                parts = [statistics.median(t[i] for t in times[step]) for i in range(3)]
                vs_plain, ratios = _median_ratio(times, step, "plain")
                vs_bf16, _ = _median_ratio(times, step, "bf16 layers")
                out.append({"model": label, "compiler": compiler, "step": step,
                            "trace_s": parts[0], "lower_s": parts[1], "compile_s": parts[2],
                            "total_s": statistics.median(sum(t) for t in times[step]),
                            "vs_plain": vs_plain, "vs_bf16_layers": vs_bf16,
                            "ratios_vs_plain": ratios, "rounds": n})
    return out


def run(args) -> list[dict]:
    rounds = ROUNDS if args.rounds is None else args.rounds
    found = rows(args.tiny, rounds, args.gpu_rounds)
    header = (f"{harness.machine()}; trace + lower + compile of the whole train step (adam, "
              "mixed_bfloat16), interleaved rounds, medians; `vs_plain`, `vs_bf16_layers`: its "
              "total over that step's, per round, median. XLA:GPU: compiled for an H200 with "
              "no GPU (nothing autotuned).")
    harness.write_outputs("compile_time", found,
                          ["model", "compiler", "step", "trace_s", "lower_s", "compile_s",
                           "total_s", "vs_plain", "vs_bf16_layers"], args.out, None, header)
    return found
