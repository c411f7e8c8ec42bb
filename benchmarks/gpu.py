"""Suite ``gpu``: throughput, MFU and peak memory of ResNet-50 and BERT-Large on a GPU.

    python -m benchmarks gpu [--steps 20]   # --tiny runs it on any device at a tiny size

Each model under fp32 with TF32 off, fp32 with XLA's default precision (TF32), ``mixed_bfloat16``
and ``mixed_float16``; then torchvision's ResNet-50 under PyTorch AMP when torch has CUDA.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import harness
from benchmarks.peers import pytorch_recipe

ROUNDS = None  # timed in consecutive steps: --steps
# Dense bf16/fp16 peak of an H100/H200 SXM, the denominator of MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}
GPU_PRECISIONS = {  # label: (policy, default matmul precision)
    "fp32 strict (TF32 off)": ("float32", "highest"),
    "fp32 default (TF32)": ("float32", "default"),
    "mixed_bfloat16": ("mixed_bfloat16", "default"),
    "mixed_float16": ("mixed_float16", "default"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="timed steps per gpu variant")


def _cases(tiny: bool):
    if tiny:
        return {"resnet50": dict(model="resnet50_small", kind="image", batch=4, shape=(8, 8, 3),
                                 kw=dict(stage_sizes=(1, 1), width=8)),
                "bert_large": dict(model="bert_tiny", kind="text", batch=4, seq=16,
                                   kw=dict(depth=1, width=32))}
    return {"resnet50": dict(model="resnet50", kind="image", batch=256, shape=(224, 224, 3),
                             kw={}),
            "bert_large": dict(model="bert_large", kind="text", batch=64, seq=512, kw={})}


def _step(case: dict, policy: str):
    from train import models
    model = models.build(case["model"], policy, **case["kw"])
    graphdef, params, model_state = models.split(model)
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
    b = case["batch"]
    if case["kind"] == "image":
        batch = {"image": jax.random.normal(jax.random.key(1), (b, *case["shape"])),
                 "label": jnp.zeros((b,), jnp.int32)}
        step = jaxamp.make_train_step(models.classification_loss(graphdef), has_aux=True,
                                      has_model_state=True)
    else:
        vocab = models.config_of(case["model"]).vocab
        tokens = jax.random.randint(jax.random.key(1), (b, case["seq"]), 0, vocab)
        batch = {"tokens": tokens, "targets": tokens}
        step = jaxamp.make_train_step(models.mlm_loss(graphdef), has_aux=True)
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=model_state)
    return step, state, batch


def _measure(case: dict, policy: str, precision: str, steps: int) -> tuple[float, float, float]:
    """``(seconds per step, flops per step, final loss)`` after two warm-up steps."""
    with jax.default_matmul_precision(precision):
        step, state, batch = _step(case, policy)
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        flops = harness.cost(compiled)["flops"]
        for _ in range(2):  # warm up
            state, m = compiled(state, batch)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = compiled(state, batch)
        jax.block_until_ready((state, m))
        dt = (time.perf_counter() - t0) / steps
    return dt, flops, float(m["loss"])


def _add_ratios(rows: list[dict]) -> None:
    for r in rows:
        strict = next(x for x in rows if x["model"] == r["model"] and "strict" in x["precision"])
        tf32 = next(x for x in rows if x["model"] == r["model"] and "TF32)" in x["precision"])
        r["vs_fp32_strict"] = r["per_s"] / strict["per_s"]
        r["vs_tf32"] = r["per_s"] / tf32["per_s"]
        r["label"] = f"{r['model']} {r['precision'].split(' (')[0]}"


def _torch_rows(rows: list[dict], steps: int) -> list[dict]:
    """torchvision's ResNet-50 under PyTorch AMP, against jaxamp's row of the same dtype."""
    out = []
    for dt_name in ("bfloat16", "float16"):
        ips = pytorch_recipe.resnet50_images_per_second(256, steps, dt_name)
        if ips is not None:
            ours = next(r for r in rows if r["model"] == "resnet50"
                        and r["precision"] == f"mixed_{dt_name}")
            out.append({"model": "resnet50", "built_as": "torchvision",
                        "precision": f"PyTorch AMP {dt_name}", "batch": 256,
                        "per_s": ips, "unit": "img/s",
                        "jaxamp_vs_torch": ours["per_s"] / ips,
                        "label": f"torch AMP {dt_name}"})
    return out


def run(args) -> list[dict]:
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.tiny:
        print(f"## gpu\n\nno GPU here ({dev.platform}): suite skipped. `--tiny` runs it on this "
              "device at a tiny size.\n", flush=True)
        return []
    peak = next((v for k, v in PEAK_FLOPS.items() if k in dev.device_kind), None)
    steps = 3 if args.tiny else args.steps
    rows = []
    for case_name, case in _cases(args.tiny).items():
        for label, (policy, precision) in GPU_PRECISIONS.items():
            dt, flops, loss = _measure(case, policy, precision, steps)
            stats = dev.memory_stats() or {}
            rows.append({"model": case_name, "built_as": case["model"], "precision": label,
                         "batch": case["batch"], "step_ms": 1e3 * dt,
                         "per_s": case["batch"] / dt,
                         "unit": "img/s" if case["kind"] == "image" else "seq/s",
                         "tflops": flops / dt / 1e12,
                         "mfu": None if peak is None else flops / dt / peak,
                         "peak_mem_gb": stats.get("peak_bytes_in_use", 0) / 1e9 or None,
                         "loss": loss})
    _add_ratios(rows)
    if not args.tiny:
        rows += _torch_rows(rows, args.steps)
    header = (f"{harness.machine()}; {steps} timed steps after 2 warm-up steps; adamw; "
              f"MFU against {peak and f'{peak / 1e12:.0f} TFLOP/s'}")
    harness.write_outputs("gpu", rows, ["model", "precision", "batch", "step_ms", "per_s",
                                        "unit", "vs_fp32_strict", "vs_tf32", "tflops", "mfu",
                                        "peak_mem_gb", "jaxamp_vs_torch"],
                          args.out, ("label", "per_s"), header)
    return rows
