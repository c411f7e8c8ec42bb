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

Model (c) also runs in PyTorch, as its twin of ``benchmarks/peers/pytorch_saved.py`` (the same
layers and parameters), once in fp32 and once under ``torch.autocast("cpu", bfloat16)``: one
forward and loss, whose saved tensors ``saved_tensors_hooks`` counts (needs torch; the rows say
they were skipped without it). Both sides count activations only: jaxamp's audit leaves out the
arguments (the bf16 working params) and the tokens, the torch rows leave out the params,
autocast's bf16 copies of them and the tokens.
"""

from __future__ import annotations

import importlib.util
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


def _linen_model(kind: str, tiny: bool):
    """``(the Linen model, its case of benchmarks.memory)``."""
    case = next(c for c in memory._cases(tiny).values() if c["kind"] == kind)
    return (case["linen"](norm_dtype=jnp.float32) if kind == "text" else case["linen"]()), case


def _linen(kind: str, tiny: bool):
    model, case = _linen_model(kind, tiny)
    loss, params, x = memory._linen_loss(model, case)
    return loss, params, x


TORCH_VARIANTS = {"PyTorch fp32": False, "PyTorch autocast": True}  # variant: autocast on


def _torch_saved(tiny: bool) -> dict[str, dict]:
    """What the PyTorch twin of (c) saves for backward, by variant: ``{"activations",
    "params", "inputs"}`` bytes by dtype, and ``"param_count"``."""
    import torch

    from benchmarks.peers import pytorch_saved
    model, case = _linen_model("text", tiny)
    twin = pytorch_saved.linen_encoder_twin(
        **{k: getattr(model, k) for k in ("vocab", "width", "depth", "heads", "mlp")})
    tokens = torch.zeros(case["shape"], dtype=torch.int64)  # the jax batch: zeros
    return {variant: {**pytorch_saved.saved_bytes(twin, tokens, amp),
                      "param_count": pytorch_saved.param_count(twin)}
            for variant, amp in TORCH_VARIANTS.items()}


def _mb(by_dtype: dict[str, int]) -> dict[str, float]:
    return {k: v / 1e6 for k, v in sorted(by_dtype.items())}


def _torch_rows(model: str, tiny: bool, jax_rows: list[dict], params) -> list[dict]:
    """The PyTorch rows of (c); adds ``vs_torch_autocast`` to ``jax_rows`` (those of (c))."""
    if importlib.util.find_spec("torch") is None:
        return [{"model": model, "variant": variant, "skipped": "torch is not installed"}
                for variant in TORCH_VARIANTS]
    saved = _torch_saved(tiny)
    total = {k: sum(v["activations"].values()) for k, v in saved.items()}
    ref = total["PyTorch autocast"]
    for r in jax_rows:
        r["vs_torch_autocast"] = r["saved_mb"] * 1e6 / ref
    flax_count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return [{"model": model, "variant": variant, "saved_mb": total[variant] / 1e6,
             "saved_vs_fp32": total[variant] / total["PyTorch fp32"],
             "vs_torch_autocast": total[variant] / ref,
             "saved_mb_by_dtype": _mb(s["activations"]),
             "param_saved_mb": sum(s["params"].values()) / 1e6,
             "param_saved_mb_by_dtype": _mb(s["params"]),
             "input_saved_mb": sum(s["inputs"].values()) / 1e6,
             "param_count": s["param_count"], "flax_param_count": flax_count,
             "label": f"{model.split(')')[0]}) {variant}"} for variant, s in saved.items()]


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


def _row(model: str, variant: str, report: jaxamp.reports.AuditReport, fp32_saved: int) -> dict:
    return {"model": model, "variant": variant, "bf16_share": report.share("bfloat16"),
            "fp32_share": report.fp32_matmul_share,
            "half_sensitive_ops": len(report.half_sensitive_ops),
            "saved_mb": report.saved_bytes / 1e6, "saved_vs_fp32": report.saved_bytes / fp32_saved,
            "saved_mb_by_dtype": _mb(report.saved_bytes_by_dtype),
            "label": f"{model.split(')')[0]}) {variant}"}


def _param_note(rows: list[dict]) -> str:
    """`` (N MB under autocast)``: the param bytes the torch rows leave out, when they ran."""
    torch_ac = [r for r in rows if r["variant"] == "PyTorch autocast" and "saved_mb" in r]
    return f" ({torch_ac[0]['param_saved_mb']:.4g} MB under autocast)" if torch_ac else ""


def _compile_seconds(loss_fn, params, batch, autocast: bool, rounds: int,
                     options: dict | None = None) -> float:
    tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    times = []
    for _ in range(rounds):
        step = jaxamp.make_train_step(loss_fn, autocast=autocast, warn_fp32_matmuls=False)
        start = time.perf_counter()
        jax.jit(step).lower(state, batch).compile(options)
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
        if model.startswith("(c)"):
            rows += _torch_rows(model, args.tiny, rows[-3:], params)
    loss, params, batch = _gpt(tiny=True)
    timed: dict[bool, list[float]] = {}
    order = (False, True) if args.tiny else (False, True, False, True)  # interleaved
    for autocast in order:
        timed.setdefault(autocast, []).append(
            _compile_seconds(loss, params, batch, autocast, 1 if args.tiny else args.rounds,
                             harness.tiny_compiler_options(args.tiny)))
    plain, cast = (float(np.median(timed[k])) for k in (False, True))
    header = (f"{harness.machine()}; abstract traces, nothing runs. `bf16_share`: matmul/conv "
              "FLOPs of the forward and backward pass with bf16 operands; `half_sensitive_ops`: "
              "exp, log, sums and the like left in half precision; `saved_vs_fp32`: activation "
              "bytes saved for backward against the fp32 model of the same code. The PyTorch "
              "rows run the twin of (c) (benchmarks/peers/pytorch_saved.py) on the CPU, fp32 "
              "and under torch.autocast(bfloat16), one forward and loss counted by "
              "saved_tensors_hooks, one count per storage. `saved_mb` is activations only on "
              "both sides: jaxamp's audit leaves out the arguments (the bf16 working params) "
              "and the tokens; the torch rows leave out the params, autocast's bf16 copies of "
              f"them{_param_note(rows)} and the tokens. `vs_torch_autocast`: saved_mb against "
              "PyTorch autocast's. Trace + compile of the whole "
              f"train step of (a) at the tiny size: {plain:.2f} s without autocast, {cast:.2f} s "
              f"with it, {cast / plain:.2f}x (median of {len(timed[True])} interleaved "
              "compiles each).")
    harness.write_outputs("autocast", rows, ["model", "variant", "bf16_share", "fp32_share",
                                             "half_sensitive_ops", "saved_mb", "saved_vs_fp32",
                                             "vs_torch_autocast"],
                          args.out, ("label", "saved_vs_fp32"), header)
    rows.append({"model": "(a) tiny", "variant": "trace+compile", "plain_s": plain,
                 "autocast_s": cast, "ratio": cast / plain})
    return rows
