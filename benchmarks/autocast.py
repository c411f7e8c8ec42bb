"""Suite ``autocast``: users' models, unmodified, under ``jaxamp.autocast`` (abstract traces).

    python -m benchmarks autocast

Four models written as users write them, with fp32 layers and no ``dtype=``: (a) an NNX GPT
(``train/models/nnx_gpt.py``), (b) a Linen ResNet-50 with ``nn.BatchNorm``
(``train/models/linen_resnet.py``), (c) the promotion-trap Linen encoder at BERT-Large size
(``train/models/linen_encoder.py``, ``LayerNorm(dtype=float32)``) and (d) an Equinox MLP. Each
runs three ways: fp32; its params cast to bf16 (jmp's recipe, the promotion trap); and
``jaxamp.autocast`` on the bf16 working params (what ``make_train_step(autocast=True)`` sees).
``jaxamp.audit_grad`` gives the matmul FLOPs by dtype (forward and backward), the
precision-sensitive ops left in half precision, and the activation bytes saved for backward. The
trace + compile time of a whole train step with and without autocast is timed on (a).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from benchmarks import harness
from benchmarks import memory

ROUNDS = 3  # trace + compile repetitions


def _gpt(tiny: bool):
    from train.models import nnx_gpt
    dims = (dict(vocab=64, width=32, depth=1, heads=2), (2, 9)) if tiny else \
        (dict(vocab=8192, width=768, depth=12, heads=12), (8, 129))
    loss_fn, params = nnx_gpt.loss_and_params(**dims[0])
    tokens = jnp.zeros(dims[1], jnp.int32)
    return loss_fn, params, {"tokens": tokens}


def _linen(kind: str, tiny: bool):
    case = next(c for c in memory._cases(tiny).values() if c["kind"] == kind)
    model = case["linen"](norm_dtype=jnp.float32) if kind == "text" else case["linen"]()
    loss, params, x = memory._linen_loss(model, case)
    return loss, params, x


def _equinox(tiny: bool):
    import equinox as eqx
    width, depth, batch = (32, 2, 8) if tiny else (1024, 4, 256)
    model = eqx.nn.MLP(in_size=64, out_size=10, width_size=width, depth=depth,
                       key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jnp.zeros((batch, 64), jnp.float32)

    def loss(p, x):
        logits = jax.vmap(eqx.combine(p, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.zeros(x.shape[:1], jnp.int32)).mean()
    return loss, params, x


def _models(tiny: bool) -> dict:
    suffix = " (tiny)" if tiny else ""
    return {f"(a) NNX GPT{suffix}": lambda: _gpt(tiny),
            f"(b) Linen ResNet-50, BatchNorm{suffix}": lambda: _linen("image", tiny),
            f"(c) Linen encoder, LayerNorm(fp32){suffix}": lambda: _linen("text", tiny),
            f"(d) Equinox MLP{suffix}": lambda: _equinox(tiny)}


def _row(model: str, variant: str, report: jaxamp.AuditReport, fp32_saved: int) -> dict:
    return {"model": model, "variant": variant, "bf16_share": report.share("bfloat16"),
            "fp32_share": report.fp32_matmul_share,
            "half_sensitive_ops": len(report.half_sensitive_ops),
            "saved_mb": report.saved_bytes / 1e6, "saved_vs_fp32": report.saved_bytes / fp32_saved,
            "label": f"{model.split(')')[0]}) {variant}"}


def _compile_seconds(loss_fn, params, batch, autocast: bool, rounds: int) -> float:
    tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    times = []
    for _ in range(rounds):
        step = jaxamp.make_train_step(loss_fn, autocast=autocast, warn_fp32_matmuls=False)
        start = time.perf_counter()
        jax.jit(step).lower(state, batch).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> list[dict]:
    policy = jaxamp.get_policy("mixed_bfloat16")
    rows = []
    for model, build in _models(args.tiny).items():
        loss, params, batch = build()
        working = policy.cast_params_to_compute(params)
        fp32 = jaxamp.audit_grad(loss, params, batch)
        for variant, fn, p in (("fp32", loss, params), ("cast params (jmp recipe)", loss, working),
                               ("jaxamp.autocast", jaxamp.autocast(loss, policy), working)):
            report = fp32 if variant == "fp32" else jaxamp.audit_grad(fn, p, batch)
            rows.append(_row(model, variant, report, fp32.saved_bytes))
    loss, params, batch = _gpt(tiny=True)
    timed: dict[bool, list[float]] = {}
    order = (False, True) if args.tiny else (False, True, False, True)  # interleaved
    for autocast in order:
        timed.setdefault(autocast, []).append(
            _compile_seconds(loss, params, batch, autocast, 1 if args.tiny else args.rounds))
    plain, cast = (float(np.median(timed[k])) for k in (False, True))
    header = (f"{harness.machine()}; abstract traces, nothing runs. `bf16_share`: matmul/conv "
              "FLOPs of the forward and backward pass with bf16 operands; `half_sensitive_ops`: "
              "exp, log, sums and the like left in half precision; `saved_vs_fp32`: activation "
              "bytes saved for backward against the fp32 model. Trace + compile of the whole "
              f"train step of (a) at the tiny size: {plain:.2f} s without autocast, {cast:.2f} s "
              f"with it, {cast / plain:.2f}x (median of {len(timed[True])} interleaved "
              "compiles each).")
    harness.write_outputs("autocast", rows, ["model", "variant", "bf16_share", "fp32_share",
                                             "half_sensitive_ops", "saved_mb", "saved_vs_fp32"],
                          args.out, ("label", "saved_vs_fp32"), header)
    rows.append({"model": "(a) tiny", "variant": "trace+compile", "plain_s": plain,
                 "autocast_s": cast, "ratio": cast / plain})
    return rows
