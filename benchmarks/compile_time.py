"""Suite ``compile_time``: what autocast costs before the first step, the trace, lowering and
XLA compile of the whole train step with ``autocast=True`` against the same step without it.

    python -m benchmarks compile_time [--rounds 3] [--tiny]

The user's NNX GPT of ``train/models/nnx_gpt.py`` (flax's layers with their defaults, fp32, no
``dtype=``) at 12 layers x 768 and at 24 layers x 512, vocabulary 8192, batch 8 x 128, adam,
``mixed_bfloat16``. Each round builds both steps anew and times ``jax.jit(step).trace``,
``.lower()`` and ``.compile()`` (XLA:CPU), in alternating order; the ratio is taken per round
and the median reported, since times on a 2-core machine swing from run to run.
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


def _cases(tiny: bool) -> dict[str, dict]:
    if tiny:
        return {"NNX GPT 2 x 64 (tiny)": dict(depth=2, width=64, heads=2, vocab=64,
                                              batch=(2, 9))}
    return {"NNX GPT 12 x 768": dict(depth=12, width=768, heads=12, vocab=8192, batch=(8, 129)),
            "NNX GPT 24 x 512": dict(depth=24, width=512, heads=8, vocab=8192, batch=(8, 129))}


def _seconds(loss_fn, state, batch, autocast: bool) -> tuple[float, float, float]:
    """``(trace, lower, compile)`` seconds of a newly built step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain step's fp32-matmul warning
        step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=autocast))
        t0 = time.perf_counter()
        traced = step.trace(state, batch)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def rows(tiny: bool, rounds: int) -> list[dict]:
    from train.models import nnx_gpt
    out = []
    for label, case in _cases(tiny).items():
        loss_fn, params = nnx_gpt.loss_and_params(vocab=case["vocab"], width=case["width"],
                                                  depth=case["depth"], heads=case["heads"])
        batch = {"tokens": jnp.zeros(case["batch"], jnp.int32)}
        tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
        state = jaxamp.TrainState.create(params=params, tx=tx)
        times: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for r in range(rounds):
            for autocast in ((False, True) if r % 2 == 0 else (True, False)):
                times[autocast].append(_seconds(loss_fn, state, batch, autocast))
        ratios = [sum(a) / sum(p) for a, p in zip(times[True], times[False], strict=True)]
        for autocast in (False, True):
            parts = [statistics.median(t[i] for t in times[autocast]) for i in range(3)]
            out.append({"model": label, "step": "autocast=True" if autocast else "plain",
                        "trace_s": parts[0], "lower_s": parts[1], "compile_s": parts[2],
                        "total_s": statistics.median(sum(t) for t in times[autocast]),
                        "ratio": statistics.median(ratios) if autocast else 1.0,
                        "ratios": [round(x, 3) for x in ratios] if autocast else None})
    return out


def run(args) -> list[dict]:
    rounds = ROUNDS if args.rounds is None else args.rounds
    found = rows(args.tiny, rounds)
    header = (f"{harness.machine()}; trace + lower + compile (XLA:CPU) of the whole train step, "
              f"{rounds} interleaved rounds, medians; `ratio`: autocast's total over the plain "
              "step's, per round, median.")
    harness.write_outputs("compile_time", found,
                          ["model", "step", "trace_s", "lower_s", "compile_s", "total_s",
                           "ratio"], args.out, None, header)
    return found
