"""``train_and_evaluate(config, workdir)``: one training run, end to end.

Builds the data pipeline and the model, trains with ``jaxamp.make_train_step`` under the chosen
precision and parallelism, logs every metric (CSV, TensorBoard; ``train.metrics_log``),
checkpoints with orbax (and on SIGTERM/SIGINT; ``train.checkpointing``), resumes bit for bit,
evaluates, and plots. Only process 0 writes logs and plots; every process takes part in
checkpoints.

Crash safety: a run killed at any point (even with SIGKILL, mid-write) resumes from the latest
complete checkpoint; the metrics log drops the rows written after it. A run whose gradients stay
non-finite at the minimum loss scale (``stall_after`` steps in a row) stops with
:class:`TrainingStalled` instead of skipping forever.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import jaxamp
from train import checkpointing
from train import data as data_lib
from train import metrics_log
from train import models
from train.checkpointing import CheckpointMismatch
from train.checkpointing import check_checkpoint_matches
from train.configs.default import Config
from train.configs.default import moments_dtype
from train.metrics_log import plot_run
from train.metrics_log import precision_label
from train.metrics_log import read_metrics
from train.metrics_log import scalar as _scalar

__all__ = ["CheckpointMismatch", "Config", "TrainingStalled", "WorkdirHeld", "build_data",
           "build_model", "check_checkpoint_matches", "compare", "evaluate", "plot_run",
           "read_metrics", "resumes", "stored_config", "train_and_evaluate"]


class TrainingStalled(FloatingPointError):
    """The gradients stayed non-finite at the minimum loss scale for ``stall_after`` steps."""


class WorkdirHeld(ValueError):
    """The workdir holds a run of another config, and ``--resume`` was not asked."""


# Fields a resumed run may change: how long it trains, and how it reports and checkpoints.
RESUMABLE = ("steps", "progress", "checkpoint_every", "keep_checkpoints", "stall_after",
             "log_every")


def stored_config(workdir: str) -> dict | None:
    """The config of the run ``workdir`` holds (written when it started; a run of an older
    version: its summary's), or ``None``."""
    for name, key in (("config.json", None), ("summary.json", "config")):
        path = os.path.join(workdir, name)
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f)
            return found if key is None else found.get(key)
    return None


def holds_a_run(workdir: str) -> bool:
    """Whether ``workdir`` holds a run: its config, or a checkpoint."""
    checkpoints = checkpointing.directory(workdir)
    return stored_config(workdir) is not None or (
        os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)))


def resumes(config: Config, workdir: str, resume: bool) -> bool:
    """Whether a run of ``config`` into ``workdir`` resumes the run there: asked (``resume``),
    or the same config (a finished run reports again; an interrupted one goes on). Raises
    :class:`WorkdirHeld` at once, before any training, for a run of another config."""
    if resume or not holds_a_run(workdir):
        return resume
    stored = stored_config(workdir)
    asked = json.loads(json.dumps(dataclasses.asdict(config)))
    if stored == asked:
        return True
    differ = ("" if stored is None else ": " + ", ".join(
        f"{k} {stored.get(k)!r} there, {asked[k]!r} asked" for k in asked
        if stored.get(k) != asked[k]))
    raise WorkdirHeld(f"{workdir} holds a run of another config{differ}; pass --resume to "
                      "continue it, or another --workdir")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def train_and_evaluate(config: Config, workdir: str, *, resume: bool = False) -> dict:
    """Trains and evaluates one config; returns the summary (also written to workdir). A
    workdir that holds a run of the same config resumes it; of another, raises
    :class:`WorkdirHeld` unless ``resume``."""
    resume = resumes(config, workdir, resume)
    os.makedirs(workdir, exist_ok=True)
    is_chief = jax.process_index() == 0
    check_fp8(config)
    policy = policy_of(config)
    if is_chief and config.precision == "auto":
        print(f"precision: {precision_label(config.precision)}", flush=True)
    batches, evals, meta = build_data(config)
    params, model_state, loss_fn, eval_fn, flags = build_model(config, policy, meta)
    state = create_train_state(config, policy, params, model_state)
    axis = "batch" if config.parallel == "pmap" else None
    autocast = uses_autocast(config, policy)
    step_fn = jaxamp.make_train_step(loss_fn, accum_steps=config.accum_steps, axis_name=axis,
                                     autocast=autocast, **flags)
    manager = checkpointing.manager(workdir, keep=config.keep_checkpoints)
    start = 0
    if resume:
        state, start = checkpointing.restore_latest(manager, state, batches)
        if start and is_chief:
            print(f"resuming from the checkpoint of step {start} in "
                  f"{checkpointing.directory(workdir)}", flush=True)
    if is_chief and not os.path.isfile(os.path.join(workdir, "config.json")):
        with open(os.path.join(workdir, "config.json"), "w") as f:  # what --resume restores
            json.dump(dataclasses.asdict(config), f, indent=2)
    step, state, put, unput = _layout(config, step_fn, state)
    # A host thread keeps the next batches ready; its state() is the position of the batches
    # actually consumed, which is what a checkpoint must hold.
    loop = _Loop(config, step, put, unput, data_lib.prefetch(batches, size=2), manager,
                 metrics_log.MetricsLogger(workdir, enabled=is_chief, resume_from=start),
                 metrics_log.progress(config, start, is_chief), params)
    try:
        state, stopped = _run_steps(loop, state, start)
    finally:
        loop.close()
    final = unput(state)
    summary = _summary(config, final, stopped, start if resume else None)
    if stopped is None:
        summary.update(evaluate(config, _gathered(final), eval_fn, flags, evals,
                                autocast=autocast))
        if is_chief:
            plot_run(workdir)
    if is_chief:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


FP8_RECIPES = ("current", "delayed")


def check_fp8(config: Config) -> None:
    """A ``ValueError`` for an FP8 setting that cannot run (before anything is built)."""
    if config.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"unknown fp8_recipe {config.fp8_recipe!r}; expected one of "
                         f"{', '.join(FP8_RECIPES)}")
    if not jaxamp.get_policy(config.precision).fp8:
        return
    family = models.MODELS.get(config.model, ("?",))[0]
    if family == "resnet":
        raise ValueError(f"precision {config.precision!r} runs matmuls in FP8, and "
                         f"{config.model!r} is convolutions: FP8 convolutions are not "
                         "supported. Use mixed_bfloat16 for a ResNet")
    policy_of(config)  # checks the current recipe's granularity
    fine = (config.fp8_granularity, config.fp8_weight_grad, config.fp8_keep_bf16) != (
        "tensor", "fp8", True)
    if config.fp8_recipe == "delayed":
        fp8_recipe_of(config, jaxamp.get_policy(config.precision))  # checks the recipe
        if fine:
            raise ValueError("fp8_granularity, fp8_weight_grad and fp8_keep_bf16 are the "
                             "current recipe's; delayed scaling keeps one scale per tensor "
                             "in the layers the model builds")
        if family not in ("bert", "gpt"):
            raise ValueError(f"fp8_recipe 'delayed' needs jaxamp.fp8's layers, which the "
                             f"bert_* and gpt_* models have and {config.model!r} does not; "
                             "use fp8_recipe 'current' (jaxamp.autocast, any model)")


def policy_of(config: Config) -> jaxamp.Policy:
    """``config.precision``'s policy; under FP8 with the current recipe, with the
    ``fp8_granularity`` and ``fp8_weight_grad`` of its :class:`jaxamp.fp8.CurrentScaling`."""
    policy = jaxamp.get_policy(config.precision)
    if not (policy.fp8 and config.fp8_recipe == "current"):
        return policy
    every_matmul = {} if config.fp8_keep_bf16 else {"keep": "", "batched": True}
    recipe = jaxamp.fp8.CurrentScaling(granularity=config.fp8_granularity,
                                       weight_grad=config.fp8_weight_grad, **every_matmul)
    return policy if recipe == jaxamp.fp8.CurrentScaling() else dataclasses.replace(
        policy, fp8=recipe)


def uses_autocast(config: Config, policy: jaxamp.Policy) -> bool:
    """``--autocast``, or FP8 with the current recipe (which is autocast's FP8 rule)."""
    return bool(config.autocast) or (policy.fp8 and config.fp8_recipe == "current")


def fp8_recipe_of(config: Config, policy: jaxamp.Policy) -> jaxamp.fp8.DelayedScaling | None:
    """The delayed-scaling recipe the model's layers are built with, or ``None``."""
    if policy.fp8 and config.fp8_recipe == "delayed":
        return jaxamp.fp8.DelayedScaling(history_length=config.fp8_history,
                                         margin=config.fp8_margin, amax_algo=config.fp8_algo)
    return None


STOCHASTIC_NOISE_WARNING = 0.3
"""``--master stochastic`` warns when ``jaxamp.rounding.rounding_noise`` predicts more noise
than this fraction of the run's movement: beyond the largest prediction measured to train as
the fp32 master does (0.28, the text preset at lr 3e-6; BENCHMARKS.md)."""


def warn_of_stochastic_noise(config: Config, policy: jaxamp.Policy, params: Any,
                             schedule: Callable[[int], Any]) -> float | None:
    """Under ``--master stochastic``: the predicted rounding noise of the run (its learning
    rates against the params' magnitudes), with a warning above
    :data:`STOCHASTIC_NOISE_WARNING`; else ``None``."""
    if config.master != "stochastic" or np.dtype(policy.compute_dtype).itemsize != 2:
        return None
    lrs = np.asarray(jax.vmap(schedule)(np.arange(config.steps)), np.float64)
    noise = jaxamp.rounding.rounding_noise(policy.cast_to_param(params), lrs,
                                           policy.compute_dtype)
    if noise > STOCHASTIC_NOISE_WARNING:
        warnings.warn(
            f"--master stochastic: at --lr {config.lr:g} over {config.steps} steps, stochastic "
            f"rounding is predicted to add noise of {noise:.0%} of how far the params move "
            f"(jaxamp.rounding.rounding_noise; measured to train as the fp32 master up to "
            f"{STOCHASTIC_NOISE_WARNING:.0%}). Use --master kahan (2 bytes more a param, exact) "
            "or --master float32", UserWarning, stacklevel=2)
    return noise


def create_train_state(config: Config, policy: jaxamp.Policy, params: Any,
                       model_state: Any) -> jaxamp.TrainState:
    """AdamW with warmup and cosine decay (after clipping the gradients' global norm to
    ``config.grad_clip``, when it is set), wrapped by ``jaxamp.mixed_precision``; under
    ``--master stochastic``, a warning where its rounding noise is predicted to matter."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, config.warmup_steps,
                                                  max(config.steps, config.warmup_steps + 1))
    warn_of_stochastic_noise(config, policy, params, schedule)
    inner = optax.adamw(schedule, weight_decay=config.weight_decay)
    if config.grad_clip:
        inner = optax.chain(optax.clip_by_global_norm(config.grad_clip), inner)
    tx = jaxamp.mixed_precision(inner,
                                policy, loss_scale=_loss_scale(config, policy),
                                stall_after=config.stall_after or None, master=config.master,
                                moments_dtype=moments_dtype(config.moments_dtype),
                                seed=config.seed)
    return jaxamp.TrainState.create(params=params, tx=tx, policy=policy, model_state=model_state,
                                    rng=jax.random.PRNGKey(config.seed))


def _summary(config: Config, final: jaxamp.TrainState, stopped: int | None,
             resumed_from: int | None) -> dict:
    return {"config": dataclasses.asdict(config),
            "precision": precision_label(config.precision), "steps": stopped or config.steps,
            "stopped_by_signal": stopped is not None, "resumed_from": resumed_from,
            "skipped_steps": int(jaxamp.state.find_state(final.opt_state).health.skipped_steps),
            "loss_scale": _scalar(final.loss_scale)}


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Loop:
    """What the loop drives: the compiled step, the batches, and what it writes."""

    config: Config
    step: Callable
    put: Callable  # places a host batch for the step
    unput: Callable  # a state the step returned, as a host-side TrainState
    feed: data_lib.Prefetcher
    checkpoints: Any  # orbax.checkpoint.CheckpointManager
    logger: metrics_log.MetricsLogger
    bar: Any  # a tqdm bar or None
    params: Any  # the params' tree, which names a non-finite leaf

    def save(self, step: int, state: jaxamp.TrainState) -> None:
        checkpointing.save(self.checkpoints, step, self.unput(state), self.feed.state())

    def close(self) -> None:
        self.feed.close()
        if self.bar is not None:
            self.bar.close()
        self.logger.close()
        self.checkpoints.close()


def _run_steps(loop: _Loop, state: jaxamp.TrainState,
               start: int) -> tuple[jaxamp.TrainState, int | None]:
    """Steps from ``start`` to ``config.steps``; returns the state and the step a signal
    stopped it at (``None``: it ran to the end)."""
    config = loop.config
    with _Stop() as stop:
        throughput = metrics_log.Throughput(_items_per_step(config), start)
        previous, scale = None, None
        for i in range(start, config.steps):
            state, metrics = loop.step(state, loop.put(next(loop.feed)))
            done = i + 1
            # The previous step's stall flag and loss scale, read while this step runs: every
            # step is checked without a host sync between steps.
            if previous is not None:
                _raise_if_stalled(*previous, loop)
                scale = _log_if_the_scale_moved(loop, *previous, scale, throughput)
            previous = (done, metrics)
            if _logged(config, done):
                _log(loop, done, metrics, throughput)
            if loop.bar is not None:
                loop.bar.update(1)
            if done % config.checkpoint_every == 0 or done == config.steps \
                    or stop.signal is not None:
                _raise_if_stalled(done, metrics, loop)
                loop.save(done, state)
                throughput.restart_clock()  # throughput leaves checkpoint time out
            if stop.signal is not None:
                return state, done
    return state, None


def _logged(config: Config, step: int) -> bool:
    """Whether ``step`` gets its log row in any case: every ``log_every`` steps and the last."""
    return step % config.log_every == 0 or step == config.steps


def _log_if_the_scale_moved(loop: _Loop, step: int, metrics: dict, scale: float | None,
                            throughput: metrics_log.Throughput) -> float:
    """Logs ``step`` beside the every-``log_every`` rows where it is the run's first, a
    skipped step or a change of the loss scale, so that the log (and the loss-scale plot)
    holds every step's scale; returns its scale."""
    now = _scalar(metrics["loss_scale"])
    moved = scale is None or now != scale or not _scalar(metrics["grads_finite"])
    if moved and not _logged(loop.config, step):
        _log(loop, step, metrics, throughput)
    return now


def _log(loop: _Loop, step: int, metrics: dict, throughput: metrics_log.Throughput) -> None:
    row = metrics_log.row(metrics)
    row["throughput"] = throughput.rate(step)
    loop.logger.write(step, row)
    metrics_log.show(loop.bar, row, "tokens/s" if _is_text(loop.config.task) else "img/s")


def _items_per_step(config: Config) -> int:
    return config.batch_size * config.seq_len if _is_text(config.task) else config.batch_size


def _raise_if_stalled(done: int, metrics: dict, loop: _Loop) -> None:
    if _scalar(metrics["stalled"]):
        raise TrainingStalled(_stall_message(done, metrics, loop.params,
                                             loop.config.stall_after))


def _stall_message(done: int, metrics: dict, params: Any, stall_after: int) -> str:
    count = int(_scalar(metrics["skips_at_min_scale"]))
    first = done - count + 1
    leaf = jaxamp.gradients.nonfinite_leaf_path(params, np.asarray(metrics["first_nonfinite_leaf"]))
    return (f"training stalled at step {done - (count - stall_after)}: {stall_after} consecutive "
            f"steps (from step {first}) had non-finite gradients at the minimum loss scale "
            f"{_scalar(metrics['loss_scale']):g}, which loss scaling cannot fix. The first "
            f"non-finite gradient leaf is {leaf!r} and the loss is {_scalar(metrics['loss'])}. "
            "None of these steps applied an update, and the checkpoints are intact. Look for "
            "inf or nan in the data, lower --lr, or run this layer in float32; "
            "--stall-after 0 keeps skipping instead.")


# --------------------------------------------------------------------------------------------
# Data, model, optimizer and layout
# --------------------------------------------------------------------------------------------

def _is_text(task: str) -> bool:
    return task in ("text", "mlm", "synthetic_text")


def build_data(config: Config):
    """Returns ``(train_batches, eval_batches, meta)`` for the config's task.

    Each process draws the same global batch and keeps its own slice of it.
    """
    pidx, pcount = jax.process_index(), jax.process_count()
    if _is_text(config.task):
        if config.task == "synthetic_text":
            tokens = data_lib.synthetic_tokens(1, 200_000, 256, config.seed).reshape(-1)
        elif config.data:
            tokens = data_lib.load_text_file(config.data)
        else:
            tokens = data_lib.load_text()
        n_eval = len(tokens) // 10  # the last 10% of the text, unseen in training
        mlm = config.task == "mlm"
        batches = data_lib.TextBatches(tokens[:-n_eval], config.batch_size, config.seq_len,
                                       config.seed, mlm=mlm, process_index=pidx,
                                       process_count=pcount)
        if config.eval_batches == 0:  # the whole split, each target once
            if mlm:
                raise ValueError("eval_batches=0 (the whole held-out split) evaluates next-token "
                                 "tasks and classification; the mlm task's masks are drawn: "
                                 "give eval_batches > 0")
            evals = data_lib.text_windows(tokens[-n_eval:], config.batch_size, config.seq_len)
        else:
            evals = data_lib.TextBatches(tokens[-n_eval:], config.batch_size, config.seq_len,
                                         config.seed + 1, mlm=mlm, process_index=0,
                                         process_count=1)
        return batches, evals, {"vocab": data_lib.BYTE_VOCAB}
    if config.task == "synthetic_images":
        arrays = data_lib.synthetic_images(4096, (config.image_size, config.image_size, 3),
                                           config.num_classes, config.seed)
    elif config.data:
        arrays = data_lib.load_npz_images(config.data)
    else:
        arrays = data_lib.load_digits()
    train_arrays, eval_arrays = data_lib.split(arrays, 0.2, config.seed)
    batches = data_lib.Batches(train_arrays, config.batch_size, config.seed,
                               process_index=pidx, process_count=pcount)
    evals = data_lib.Batches(eval_arrays, config.batch_size, config.seed + 1, shuffle=False,
                             drop_remainder=False, process_index=0, process_count=1,
                             num_epochs=1 if config.eval_batches == 0 else None)
    num_classes = int(max(int(arrays["label"].max()) + 1, config.num_classes))
    return batches, evals, {"num_classes": num_classes,
                            "in_channels": int(arrays["image"].shape[-1])}


def build_model(config: Config, policy: jaxamp.Policy, meta: dict):
    """Returns ``(params, model_state, loss_fn, eval_loss_fn, flags)``."""
    kwargs = dict(config.model_overrides.get(models.MODELS[config.model][0], {})) \
        if config.model in models.MODELS else {}
    if "vocab" in meta:
        kwargs.setdefault("vocab", meta["vocab"])
    else:
        kwargs.setdefault("num_classes", meta["num_classes"])
        kwargs.setdefault("in_channels", meta["in_channels"])
    model = models.build(config.model, policy, seed=config.seed,
                         fp8=fp8_recipe_of(config, policy), **kwargs)
    graphdef, params, model_state = models.split(model)
    if config.task == "mlm":
        loss_fn = eval_fn = models.mlm_loss(graphdef, has_model_state=model_state is not None)
        flags = dict(has_aux=True, has_model_state=model_state is not None)
    elif _is_text(config.task):
        loss_fn = eval_fn = models.lm_loss(graphdef, has_model_state=model_state is not None)
        flags = dict(has_aux=True, has_model_state=model_state is not None)
    else:
        loss_fn = models.classification_loss(graphdef)
        eval_fn = models.classification_loss(graphdef, train=False)
        flags = dict(has_aux=True, has_model_state=True)
    return params, model_state, loss_fn, eval_fn, flags


def _loss_scale(config: Config, policy: jaxamp.Policy):
    kind = config.loss_scale
    if kind == "auto":
        kind = "dynamic" if policy.needs_loss_scaling else "none"
    if kind == "dynamic":
        return jaxamp.DynamicLossScale(loss_scale=config.init_scale,
                                       growth_interval=config.growth_interval,
                                       hysteresis=config.hysteresis,
                                       min_scale=config.min_scale)
    if kind == "static":
        return jaxamp.StaticLossScale(config.init_scale)
    if kind == "none":
        return jaxamp.NoOpLossScale()
    raise ValueError(f"unknown loss_scale {kind!r}; expected auto, dynamic, static or none")


def _layout(config: Config, step_fn: Callable, state: jaxamp.TrainState):
    """Jits (or pmaps) the step and returns ``(step, state, put_batch, unput_state)``."""
    if config.parallel == "none":
        step = jax.jit(step_fn, donate_argnums=0)
        return step, state, (lambda b: b), (lambda s: s)
    if config.zero not in (0, 1, 3):
        raise ValueError(f"unknown zero {config.zero!r}; expected 0 (replicated state), 1 "
                         "(ZeRO-1/2: master and optimizer state sharded) or 3 (ZeRO-3)")
    if config.zero and config.parallel != "jit":
        raise ValueError(f"zero={config.zero} shards the state over a mesh under "
                         f"parallel='jit', not parallel={config.parallel!r}; use --parallel jit")
    if config.parallel == "jit":
        # Explicit mesh axes (jax.make_mesh's default): the step reads the state's sharding
        # from its type and reduce-scatters the fp32 gradients onto the master's shards.
        mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        if config.zero:
            shardings = jaxamp.parallel.state_sharding(
                state, mesh, params="sharded" if config.zero == 3 else "replicated")
        else:
            shardings = jax.tree.map(lambda _: replicated, state)
        sharding = jaxamp.parallel.batch_sharding(mesh)
        state = jax.device_put(state, shardings)

        def put(batch):
            return jax.make_array_from_process_local_data(sharding, batch) \
                if jax.process_count() > 1 else jaxamp.parallel.put_sharded(batch, sharding)
        step = jax.jit(step_fn, donate_argnums=0, in_shardings=(shardings, sharding),
                       out_shardings=(shardings, replicated))
        return step, state, put, (lambda s: s)
    if config.parallel == "pmap":
        if jax.process_count() > 1:
            raise ValueError("parallel='pmap' runs on one host; use parallel='jit' with "
                             "jax.distributed for several processes")
        step = jax.pmap(step_fn, axis_name="batch", donate_argnums=0)
        return (step, jaxamp.parallel.replicate(state), jaxamp.parallel.shard_batch,
                jaxamp.parallel.unreplicate)
    raise ValueError(f"unknown parallel {config.parallel!r}; expected none, pmap or jit")


def _gathered(state: jaxamp.TrainState) -> jaxamp.TrainState:
    """``state`` with its working params whole on every device of their mesh (ZeRO-3 keeps
    them sharded between steps), for an eval that is a plain jit of the model."""
    def whole(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated:
            return jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh,
                                                                jax.sharding.PartitionSpec()))
        return x
    return dataclasses.replace(state, params=jax.tree.map(whole, state.params))


class _Stop:
    """Turns SIGTERM/SIGINT into a flag the loop checks, so it can save before exiting."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


# --------------------------------------------------------------------------------------------
# Eval and compare
# --------------------------------------------------------------------------------------------

def evaluate(config: Config, state: jaxamp.TrainState, loss_fn: Callable, flags: dict,
             evals, *, autocast: bool = False) -> dict:
    """Mean loss (and accuracy for classification) over up to ``config.eval_batches`` batches,
    or with ``eval_batches=0`` over the whole held-out split, each example (each next-token
    target) weighted alike; computed as the step computes it (under ``jaxamp.autocast`` when the
    step is)."""
    policy = state.policy
    kwargs = {"model_state": state.model_state} if flags.get("has_model_state") else {}
    if autocast:
        loss_fn = jaxamp.autocast(loss_fn, policy)

    @jax.jit
    def eval_step(params, batch):
        out = loss_fn(params, policy.cast_to_compute(batch), **kwargs)
        return out[0], out[-1]

    losses, accs, sizes = [], [], []
    batches = evals if config.eval_batches == 0 else itertools.islice(evals, config.eval_batches)
    for batch in batches:
        loss, aux = eval_step(state.params, batch)
        losses.append(float(loss))
        sizes.append(len(next(iter(batch.values()))))
        if isinstance(aux, dict) and "accuracy" in aux:
            accs.append(float(aux["accuracy"]))
    # Batches of one size (eval_batches > 0) average as they always have; the whole split's
    # last, smaller batch weighs its examples alike.
    weights = sizes if len(set(sizes)) > 1 else None
    out = {"eval_loss": float(np.average(losses, weights=weights))}
    if accs:
        out["eval_accuracy"] = float(np.average(accs, weights=weights))
    return out


def compare(config: Config, precisions: list[str], workdir: str) -> list[dict]:
    """Trains the same config under several precisions; writes a table and one plot. Each
    precision's workdir is checked before any of them trains (:func:`resumes`)."""
    for precision in precisions:
        resumes(dataclasses.replace(config, precision=precision),
                os.path.join(workdir, precision), False)
    results = []
    for precision in precisions:
        summary = train_and_evaluate(dataclasses.replace(config, precision=precision),
                                     os.path.join(workdir, precision))
        results.append({**{k: v for k, v in summary.items() if k != "config"},
                        "precision": precision_label(precision)})
    if jax.process_index() == 0:
        metrics_log.plot_compare(workdir, precisions, title=f"{config.model} on {config.task}")
        table = metrics_log.compare_table(results)
        with open(os.path.join(workdir, "compare.md"), "w") as f:
            f.write(table + "\n")
        print(table)
    return results
