"""Suite ``autocast_step``: the user's model under autocast against the hand-built reference.

    python -m benchmarks autocast_step [--rounds N]

Two GPTs of the same shape (vocab 256, width 256, 4 layers, 4 heads, MLP 1024, batch 16 x 128):
the reference model ``train/models/transformer.py``, hand-written for mixed precision (fp32
LayerNorm, softmax, GELU and cross-entropy through ``jaxamp.ops``), trained with
``make_train_step`` under ``mixed_bfloat16``; and the user's model ``train/models/nnx_gpt.py``
(flax NNX layers with their defaults, no ``dtype=``) with ``make_train_step(..., autocast=True)``.
The reference under autocast isolates what autocast itself costs on one architecture; the user's
model without autocast (the promotion trap) and in fp32 are timed beside them for scale. Every
step is jitted with its state donated and timed interleaved; the ratios are paired round by
round against the reference. XLA's flops and bytes accessed, the matmul FLOPs
and the saved activation bytes (``jaxamp.audit_grad``) are deterministic.

The two models differ where users' GPTs differ from the reference: separate q/k/v projections
instead of a fused one, learned positions of their own and an untied output head: more params,
the same matmul FLOPs (the table shows both).
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from benchmarks import harness

ROUNDS = 30


def shape(tiny: bool) -> tuple[dict, int, int]:
    """``(model overrides, batch, sequence length)``."""
    if tiny:
        return dict(width=32, depth=1, heads=2, mlp=128, max_len=16), 2, 16
    return dict(width=256, depth=4, heads=4, mlp=1024, max_len=128), 16, 128


def _variant(model: str, policy: str, overrides: dict, batch: dict, *, autocast: bool):
    from train import models
    graphdef, params, _ = models.split(models.build(model, policy, **overrides))
    loss_fn = models.lm_loss(graphdef)
    tx = jaxamp.mixed_precision(optax.adam(1e-3), policy)
    amp_step = jaxamp.make_train_step(loss_fn, has_aux=True, autocast=autocast,
                                      warn_fp32_matmuls=False)

    def step(state, batch):
        state, metrics = amp_step(state, batch)
        return state, metrics["loss"]

    def fresh():
        return jaxamp.TrainState.create(params=jax.tree.map(jnp.copy, params), tx=tx)

    working = jaxamp.get_policy(policy).cast_params_to_compute(params)

    def loss(p, b):
        return loss_fn(p, b)[0]
    audited = jaxamp.autocast(loss, policy) if autocast else loss
    report = functools.partial(jaxamp.audit_grad, audited, working, batch)
    return harness.Variant(step, fresh), report, models.param_count(params)


def variants(tiny: bool):
    overrides, b, seq = shape(tiny)
    tokens = np.random.default_rng(0).integers(0, 256, (b, seq + 1))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    specs = {"reference, mixed_bfloat16": ("gpt_tiny", "mixed_bfloat16", False),
             "user's model + autocast": ("nnx_gpt_tiny", "mixed_bfloat16", True),
             "reference + autocast": ("gpt_tiny", "mixed_bfloat16", True),
             "user's model, mixed_bfloat16 (trap)": ("nnx_gpt_tiny", "mixed_bfloat16", False),
             "user's model, fp32": ("nnx_gpt_tiny", "float32", False)}
    built = {k: _variant(m, p, overrides, batch, autocast=a) for k, (m, p, a) in specs.items()}
    return built, batch, overrides


def run(args) -> list[dict]:
    built, batch, overrides = variants(args.tiny)
    steps = {k: v[0] for k, v in built.items()}
    compiled, states = harness.compile_variants(steps, batch,
                                                harness.tiny_compiler_options(args.tiny))
    times = harness.time_rounds({k: harness.stepper(compiled, states, k, batch) for k in steps},
                                args.rounds)
    ref = "reference, mixed_bfloat16"
    reports = {k: v[1]() for k, v in built.items()}
    costs = {k: harness.cost(c) for k, c in compiled.items()}
    rows = []
    for name in steps:
        ratio, q25, q75 = harness.paired_ratio(times, name, ref)
        report = reports[name]
        rows.append({
            "variant": name, "params_m": built[name][2] / 1e6,
            "median_ms": 1e3 * statistics.median(times[name]),
            "time_vs_reference": ratio, "time_vs_reference_iqr": f"{q25:.3f}–{q75:.3f}",
            "matmul_gflops": report.total_matmul_flops / 1e9,
            "bf16_share": report.share("bfloat16"),
            "xla_gflops": costs[name]["flops"] / 1e9,
            "gbytes_accessed": costs[name]["bytes"] / 1e9,
            "bytes_vs_reference": costs[name]["bytes"] / costs[ref]["bytes"],
            "saved_mb": report.saved_bytes / 1e6,
        })
    _, b, seq = shape(args.tiny)
    header = (f"{harness.machine()}; GPT {overrides}, vocab 256, batch {b} x {seq}, adam, "
              f"donated state; {args.rounds} interleaved rounds, ratios paired round by round "
              "against the hand-built reference (median and quartiles).")
    harness.write_outputs("autocast_step", rows,
                          ["variant", "params_m", "median_ms", "time_vs_reference",
                           "time_vs_reference_iqr", "matmul_gflops", "bf16_share", "xla_gflops",
                           "gbytes_accessed", "bytes_vs_reference", "saved_mb"],
                          args.out, ("variant", "time_vs_reference"), header)
    return rows
