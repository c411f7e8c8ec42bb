"""Suite ``overhead``: the AMP machinery's cost per step, the same encoder step built nine ways.

    python -m benchmarks overhead [--rounds 30]   # --rounds 0: cost analysis only, nothing timed

The variants: ``fp32``; ``bare_bf16`` (fp32 params cast to bf16 in the loss, no scaling, no
skip); the peers' recipes (jmp, flax ``DynamicScale``, optax ``apply_if_finite``); jaxamp's
``mixed_bfloat16`` and ``mixed_float16`` steps, ``mixed_bfloat16`` with ``accum_steps=4``, and
``mixed_float16`` with ``retry_on_overflow=True`` (on these steps, which do not overflow, its
time and bytes against the same step without: ``time_vs_no_retry``, ``bytes_vs_no_retry``).
Each is jitted with its state donated and timed interleaved; flops, bytes and entry instructions
come from the compiled step, saved activations from ``jaxamp.audit_grad``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import harness
from benchmarks.harness import Variant
from train.models import encoder

ROUNDS = 30
COST_ONLY = True  # --rounds 0 reports the cost analysis alone
BF16 = jnp.bfloat16


def encoder_config(tiny: bool) -> tuple[encoder.EncoderConfig, int]:
    """The encoder and batch size of the suite (4 x 256, batch 16 x 128; tiny for the tests)."""
    if tiny:
        return encoder.EncoderConfig(vocab=64, width=32, depth=1, heads=2, mlp=64, seq_len=16), 8
    return encoder.EncoderConfig(), 16


@dataclasses.dataclass(frozen=True)
class EncoderTask:
    """What every variant shares: the encoder's fp32 params, one batch, the fp32 loss, adamw."""

    params: dict
    batch: dict
    loss: Callable[[Any, Any], jax.Array]
    tx: optax.GradientTransformation

    def cast_loss(self, p, batch):
        """The loss with the fp32 params cast to bf16 in the forward pass."""
        return self.loss(jax.tree.map(lambda x: x.astype(BF16), p), batch)

    def fresh_params(self):
        return jax.tree.map(jnp.copy, self.params)

    def saved(self, loss, params=None, batch=None) -> Callable[[], int]:
        """Saved-activation bytes of ``loss``'s gradient (computed when the table asks)."""
        params = self.params if params is None else params
        batch = self.batch if batch is None else batch
        return lambda: jaxamp.audit_grad(loss, params, batch).saved_bytes


def encoder_task(cfg: encoder.EncoderConfig, batch_size: int, lr: float = 1e-3) -> EncoderTask:
    params = encoder.init_params(jax.random.key(0), cfg)
    batch = encoder.synthetic_batch(jax.random.key(1), batch_size, cfg)
    return EncoderTask(params, batch, functools.partial(encoder.loss_fn, cfg=cfg),
                       optax.adamw(lr))


def plain_variant(task: EncoderTask, *, cast: bool) -> Variant:
    """adamw on the fp32 loss, or (``cast``) on the loss with bf16 params: no scaling, no skip."""
    loss = task.cast_loss if cast else task.loss

    def step(state, batch):
        p, opt_state = state
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = task.tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    def fresh():
        p = task.fresh_params()
        return p, task.tx.init(p)

    return Variant(step, fresh, task.saved(loss))


def peer_variant(task: EncoderTask, recipe, *, casts_params: bool) -> Variant:
    """A peer's ``train_step(loss, tx)``: given the fp32 loss when the recipe casts the params
    itself (jmp), else the loss that computes in bf16 (flax, optax)."""
    init, step = recipe.train_step(task.loss if casts_params else task.cast_loss, task.tx)
    return Variant(step, lambda: init(task.fresh_params()), task.saved(task.cast_loss))


def jaxamp_variant(task: EncoderTask, policy: str, *, accum_steps: int = 1,
                   pin_grad_layout: bool | None = None, retry_on_overflow: bool = False,
                   **tx_options) -> Variant:
    """``make_train_step`` on ``mixed_precision(adamw, policy)`` with a ``DynamicLossScale``
    (and ``tx_options``: ``master=``, ``moments_dtype=``)."""
    amp_tx = jaxamp.mixed_precision(task.tx, policy, loss_scale=jaxamp.DynamicLossScale(),
                                    **tx_options)
    amp_step = jaxamp.make_train_step(task.loss, accum_steps=accum_steps,
                                      pin_grad_layout=pin_grad_layout,
                                      retry_on_overflow=retry_on_overflow)

    def step(state, batch):
        state, metrics = amp_step(state, batch)
        return state, metrics["loss"]

    def fresh():
        return jaxamp.TrainState.create(params=task.fresh_params(), tx=amp_tx)

    micro = jax.tree.map(lambda x: x[: x.shape[0] // accum_steps], task.batch)
    working = jaxamp.get_policy(policy).cast_params_to_compute(task.params)
    return Variant(step, fresh, task.saved(task.loss, working, micro))


def variants(cfg: encoder.EncoderConfig, batch_size: int, lr: float = 1e-3, *,
             pin_grad_layout: bool | None = None) -> tuple[dict[str, Variant], dict]:
    """Every way of building the same encoder step; each returns ``(state, fp32 loss)``."""
    from benchmarks.peers import flax_recipe  # the peers load when the suite runs
    from benchmarks.peers import jmp_recipe
    from benchmarks.peers import optax_recipe
    task = encoder_task(cfg, batch_size, lr)
    jaxamp_step = functools.partial(jaxamp_variant, task, pin_grad_layout=pin_grad_layout)
    return {
        "fp32": plain_variant(task, cast=False),
        "bare_bf16": plain_variant(task, cast=True),
        "jmp": peer_variant(task, jmp_recipe, casts_params=True),
        "flax_DynamicScale": peer_variant(task, flax_recipe, casts_params=False),
        "optax_apply_if_finite": peer_variant(task, optax_recipe, casts_params=False),
        "jaxamp_mixed_bf16": jaxamp_step("mixed_bfloat16"),
        "jaxamp_mixed_fp16": jaxamp_step("mixed_float16"),
        "jaxamp_bf16_accum4": jaxamp_step("mixed_bfloat16", accum_steps=4),
        # A step that does not overflow: the retry loop's body never runs.
        "jaxamp_mixed_fp16_retry": jaxamp_step("mixed_float16", retry_on_overflow=True),
    }, task.batch


def _time(compiled, states, variants, batch, rounds: int, keep_last_loss: bool):
    """Per-round seconds of each variant, and (``keep_last_loss``) the loss each would report
    after its timed steps, from a copy of its state."""
    last: dict[str, float] = {}

    def runner(name):
        run = harness.stepper(compiled, states, name, batch)

        def run_and_keep_loss():
            run()
            last[name] = float(compiled[name](jax.tree.map(jnp.copy, states[name]), batch)[1])
        return run_and_keep_loss if keep_last_loss else run

    times = harness.time_rounds({k: runner(k) for k in variants}, rounds) if rounds else {}
    return times, last


def _time_columns(times, name) -> dict:
    if not times:
        return {"median_ms": None, "time_vs_bare_bf16": None, "time_vs_bare_bf16_iqr": None,
                "time_vs_fp32": None}
    vs_bare, q25, q75 = harness.paired_ratio(times, name, "bare_bf16")
    return {"median_ms": 1e3 * statistics.median(times[name]), "time_vs_bare_bf16": vs_bare,
            "time_vs_bare_bf16_iqr": f"{q25:.3f}–{q75:.3f}",
            "time_vs_fp32": harness.paired_ratio(times, name, "fp32")[0]}


def run(args) -> list[dict]:
    cfg, batch_size = encoder_config(args.tiny)
    steps, batch = variants(cfg, batch_size, lr=1e-2 if args.tiny else 1e-3)
    compiled, states = harness.compile_variants(steps, batch,
                                                harness.tiny_compiler_options(args.tiny))
    costs = {k: harness.cost(c) for k, c in compiled.items()}
    # The first step's loss from a fresh state: every variant must train the same model.
    first = {k: float(compiled[k](v.fresh(), batch)[1]) for k, v in steps.items()}
    times, last = _time(compiled, states, steps, batch, args.rounds, keep_last_loss=args.tiny)
    rows = []
    for name, v in steps.items():
        saved = v.saved() if v.saved else None
        rows.append({
            "variant": name, **_time_columns(times, name),
            "gflops": costs[name]["flops"] / 1e9,
            "gbytes_accessed": costs[name]["bytes"] / 1e9,
            "bytes_vs_bare_bf16": costs[name]["bytes"] / costs["bare_bf16"]["bytes"],
            "bytes_vs_fp32": costs[name]["bytes"] / costs["fp32"]["bytes"],
            "entry_ops": harness.entry_op_count(compiled[name]),
            "saved_mb": None if saved is None else saved / 1e6,
            "first_loss": first[name], "last_loss": last.get(name),
        })
    fp32_saved = rows[0]["saved_mb"]
    for r in rows:
        r["saved_vs_fp32"] = r["saved_mb"] / fp32_saved
    # retry_on_overflow's cost on a step that does not overflow, against the same step without.
    retry = next(r for r in rows if r["variant"] == "jaxamp_mixed_fp16_retry")
    retry["bytes_vs_no_retry"] = costs["jaxamp_mixed_fp16_retry"]["bytes"] / \
        costs["jaxamp_mixed_fp16"]["bytes"]
    if times:
        ratio, q25, q75 = harness.paired_ratio(times, "jaxamp_mixed_fp16_retry",
                                               "jaxamp_mixed_fp16")
        retry["time_vs_no_retry"], retry["time_vs_no_retry_iqr"] = ratio, f"{q25:.3f}–{q75:.3f}"
    timing = (f"{args.rounds} interleaved rounds; ratios are the median and quartiles of the "
              "per-round ratios" if args.rounds else "cost analysis only, nothing timed")
    header = (f"{harness.machine()}; encoder {cfg}, batch {batch_size}, adamw, donated state, "
              f"{timing}")
    chart = "time_vs_bare_bf16" if args.rounds else "bytes_vs_bare_bf16"
    harness.write_outputs("overhead", rows, ["variant", "median_ms", "time_vs_bare_bf16",
                                             "time_vs_bare_bf16_iqr", "time_vs_fp32",
                                             "gflops", "gbytes_accessed", "bytes_vs_bare_bf16",
                                             "entry_ops", "saved_mb", "saved_vs_fp32"],
                          args.out, ("variant", chart), header)
    return rows
