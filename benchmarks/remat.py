"""Suite ``remat``: a model's own remat under autocast, kept: the bytes saved for the backward
pass and the train step's memory compiled for an H200.

    python -m benchmarks remat [--tiny]                       # the saved bytes (the jaxpr's)
    JAX_PLATFORMS=cpu .venv-gpu/bin/python -m benchmarks remat  # and the H200 compile

The model is a user's scanned transformer written in fp32 with plain jnp: pre-norm blocks (a
hand-written RMS norm, causal attention with a softmax, a GELU MLP), their params stacked and
run by ``lax.scan``, each block under the user's own ``jax.checkpoint`` with three policies:
none (no remat), the default (nothing saved inside a block) and
``dots_with_no_batch_dims_saveable``. For each, fp32 against ``make_train_step(autocast=True)``
under ``mixed_bfloat16``:

- **saved**: the residuals of the loss's gradient (``jaxamp.audit_grad``), what the program asks
  to keep; autocast's on the bf16 working params and batch, as the step runs it.
- **GPU**: the whole step (adamw, the state donated) compiled by XLA:GPU for an H200 on this
  machine, ``memory_analysis()``'s arguments + outputs - aliased + temporaries
  (``jaxamp.memory.gpu_memory``), and its temporaries alone (the activations kept for the backward
  pass, the gradients, XLA's scratch; the state is the arguments). Left empty where jax's
  CUDA plugin is not installed (``make install-gpu-memory`` builds ``.venv-gpu``, which has
  it).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jaxamp
from benchmarks import harness

ROUNDS = 0  # nothing is timed
COST_ONLY = True
POLICIES = {"no remat": None, "checkpoint": "nothing",
            "checkpoint, dots_with_no_batch_dims_saveable": "dots"}


def config(tiny: bool) -> dict:
    if tiny:
        return dict(layers=2, width=32, heads=2, batch=2, length=16, vocab=64)
    return dict(layers=12, width=1024, heads=16, batch=8, length=1024, vocab=8192)


def _rms(h, scale):
    return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale


def _block(p, h, heads):
    b, t, d = h.shape
    x = _rms(h, p["norm1"])
    q, k, v = (jnp.reshape(x @ p[n], (b, t, heads, d // heads)) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    h = h + jnp.reshape(jnp.einsum("bhqk,bkhd->bqhd", probs, v), (b, t, d)) @ p["wo"]
    x = _rms(h, p["norm2"])
    return h + jax.nn.gelu(x @ p["up"]) @ p["down"]


def loss_fn(remat: str | None, heads: int, params, batch):
    """Cross-entropy of the next token, the layers scanned (each under the user's remat)."""
    block = functools.partial(_block, heads=heads)
    if remat is not None:
        policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots"
                  else None)
        block = jax.checkpoint(block, policy=policy)
    h = params["embed"][batch["tokens"]]
    h = lax.scan(lambda h, p: (block(p, h), None), h, params["layers"])[0]
    logits = _rms(h, params["norm"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))


def abstract_params(cfg: dict) -> dict:
    d, n, v = cfg["width"], cfg["layers"], cfg["vocab"]
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    layer = {"norm1": f32((n, d)), "norm2": f32((n, d)), "wq": f32((n, d, d)),
             "wk": f32((n, d, d)), "wv": f32((n, d, d)), "wo": f32((n, d, d)),
             "up": f32((n, d, 4 * d)), "down": f32((n, 4 * d, d))}
    return {"embed": f32((v, d)), "norm": f32((d,)), "layers": layer}


def make_batch(cfg: dict) -> dict:
    """Token ids (concrete: the audit closes over the batch it does not differentiate)."""
    tokens = jnp.arange(cfg["batch"] * cfg["length"], dtype=jnp.int32).reshape(
        cfg["batch"], cfg["length"]) % cfg["vocab"]
    return {"tokens": tokens, "targets": (tokens + 1) % cfg["vocab"]}


def _gpu_available() -> bool:
    try:
        jaxamp.memory.gpu_mesh("h200")
    except Exception:  # noqa: BLE001 - no CUDA plugin: the GPU column stays empty
        return False
    return True


def _step_gpu_bytes(loss, params, batch, policy: str) -> tuple[int, int]:
    """``(total, temporaries)`` of the step compiled for an H200: the temporaries are the
    activations kept for the backward pass, the gradients and XLA's scratch."""
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    step = jaxamp.make_train_step(loss, autocast=policy != "float32", warn_fp32_matmuls=False)
    report = jaxamp.memory.gpu_memory(step, state, batch, donate_argnums=0)
    return report.total_bytes, report.temp_bytes


def rows(tiny: bool) -> list[dict]:
    cfg = config(tiny)
    params, batch = abstract_params(cfg), make_batch(cfg)
    working = jax.eval_shape(jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute, params)
    gpu = _gpu_available()
    out = []
    for label, remat in POLICIES.items():
        loss = functools.partial(loss_fn, remat, cfg["heads"])
        saved32 = jaxamp.audit_grad(loss, params, batch).saved_bytes
        saved16 = jaxamp.audit_grad(jaxamp.autocast(loss), working, batch).saved_bytes
        row = {"model remat": label, "fp32_saved_mb": saved32 / 1e6,
               "autocast_saved_mb": saved16 / 1e6, "saved_vs_fp32": saved16 / saved32,
               "fp32_gpu_gb": None, "autocast_gpu_gb": None, "gpu_vs_fp32": None,
               "fp32_temp_gb": None, "autocast_temp_gb": None, "temp_vs_fp32": None}
        if gpu:
            t0 = time.perf_counter()
            g32, t32 = _step_gpu_bytes(loss, params, batch, "float32")
            g16, t16 = _step_gpu_bytes(loss, params, batch, "mixed_bfloat16")
            row.update(fp32_gpu_gb=g32 / 1e9, autocast_gpu_gb=g16 / 1e9, gpu_vs_fp32=g16 / g32,
                       fp32_temp_gb=t32 / 1e9, autocast_temp_gb=t16 / 1e9,
                       temp_vs_fp32=t16 / t32, compile_s=time.perf_counter() - t0)
        out.append(row)
        print(f"  {label}: saved {row['saved_vs_fp32']:.3f} x fp32"
              + (f", H200 step {row['gpu_vs_fp32']:.3f} x fp32, its temporaries "
                 f"{row['temp_vs_fp32']:.3f} x" if gpu else ""), flush=True)
    return out


def run(args) -> list[dict]:
    cfg = config(args.tiny)
    found = rows(args.tiny)
    header = (f"{harness.machine()}; a scanned pre-norm transformer, "
              f"{cfg['layers']} layers x {cfg['width']}, batch {cfg['batch']} x "
              f"{cfg['length']}, vocabulary {cfg['vocab']}; abstract shapes, nothing runs. "
              "saved: the residuals of the loss's gradient (autocast: on the bf16 working "
              "params); GPU: the adamw step compiled for an H200 (empty without jax's CUDA "
              "plugin).")
    harness.write_outputs("remat", found,
                          ["model remat", "fp32_saved_mb", "autocast_saved_mb", "saved_vs_fp32",
                           "fp32_gpu_gb", "autocast_gpu_gb", "gpu_vs_fp32", "fp32_temp_gb",
                           "autocast_temp_gb", "temp_vs_fp32"], args.out, None, header)
    return found
