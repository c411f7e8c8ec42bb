"""``train_and_evaluate(config, workdir)``: one training run, end to end.

Builds the data pipeline and the model, trains with ``jaxamp.make_train_step`` under the chosen
precision and parallelism, logs every metric (CSV, TensorBoard), checkpoints with orbax's
``CheckpointManager`` (and on SIGTERM/SIGINT), resumes bit for bit, evaluates, and plots.
Only process 0 writes logs and plots; every process takes part in checkpoints.

Crash safety: orbax writes each checkpoint into a temporary directory and renames it when it is
complete, so a run killed at any point (even with SIGKILL, mid-write) resumes from the latest
complete checkpoint; the metrics log drops the rows written after it. A run whose gradients stay
non-finite at the minimum loss scale (``stall_after`` steps in a row) stops with
:class:`TrainingStalled` instead of skipping forever.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxamp
from train import data as data_lib
from train import models


@dataclasses.dataclass
class Config:
    """A training run. The presets live in ``train.configs``."""

    task: str = "digits"  # digits | text | mlm | synthetic_images | synthetic_text
    model: str = "resnet18_small"
    precision: str = "auto"
    batch_size: int = 64
    accum_steps: int = 1
    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 20
    seed: int = 0
    parallel: str = "none"  # none | pmap | jit
    loss_scale: str = "auto"  # auto | dynamic | static | none
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    # Stop after this many consecutive non-finite steps at the minimum loss scale (0: never).
    stall_after: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_batches: int = 8
    seq_len: int = 64
    image_size: int = 32  # synthetic images
    num_classes: int = 10
    data: str | None = None
    progress: bool = True
    # Config fields per model family ("resnet", "bert", "gpt"), e.g. {"resnet": {"width": 8}}.
    model_overrides: dict = dataclasses.field(default_factory=dict)


def _loss_scale(config: Config, policy: jaxamp.Policy):
    kind = config.loss_scale
    if kind == "auto":
        kind = "dynamic" if policy.compute_dtype == jnp.float16 else "none"
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


class TrainingStalled(FloatingPointError):
    """The gradients stayed non-finite at the minimum loss scale for ``stall_after`` steps."""


class CheckpointMismatch(ValueError):
    """``--resume`` found a checkpoint written for another model or state layout."""


def _leaf_specs(tree: Any) -> dict[str, str]:
    """``{'params/head/kernel': 'float16[16, 10]', ...}`` for the array leaves of ``tree``."""
    return {jaxamp.tree_path_str(path): f"{np.dtype(x.dtype).name}{list(x.shape)}"
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}


def check_checkpoint_matches(path: str, state: Any) -> None:
    """Raises :class:`CheckpointMismatch` unless the saved state at ``path`` has the leaves,
    shapes and dtypes of ``state``. Reads only the checkpoint's metadata."""
    with ocp.StandardCheckpointer() as checkpointer:
        meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    saved, wanted = _leaf_specs(getattr(meta, "tree", meta)), _leaf_specs(state)
    diffs = [f"{k!r} is {saved[k]} in the checkpoint but {wanted[k]} in this run"
             for k in wanted if k in saved and saved[k] != wanted[k]]
    diffs += [f"{k!r} is missing from the checkpoint" for k in wanted if k not in saved]
    diffs += [f"{k!r} is in the checkpoint but not in this run" for k in saved if k not in wanted]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise CheckpointMismatch(
            f"--resume: the checkpoint {path} was written by another model or state layout: "
            f"{'; '.join(diffs[:3])}{more}. Resume with the --config, --model and --precision "
            "it was written with, or train afresh in another --workdir.")


def _stall_message(done: int, metrics: dict, params: Any, stall_after: int) -> str:
    count = int(_scalar(metrics["skips_at_min_scale"]))
    first = done - count + 1
    leaf = jaxamp.nonfinite_leaf_path(params, np.asarray(metrics["first_nonfinite_leaf"]))
    return (f"training stalled at step {done - (count - stall_after)}: {stall_after} consecutive "
            f"steps (from step {first}) had non-finite gradients at the minimum loss scale "
            f"{_scalar(metrics['loss_scale']):g}, which loss scaling cannot fix. The first "
            f"non-finite gradient leaf is {leaf!r} and the loss is {_scalar(metrics['loss'])}. "
            "None of these steps applied an update, and the checkpoints are intact. Look for "
            "inf or nan in the data, lower --lr, or run this layer in float32; "
            "--stall-after 0 keeps skipping instead.")


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
        evals = data_lib.TextBatches(tokens[-n_eval:], config.batch_size, config.seq_len,
                                     config.seed + 1, mlm=mlm, process_index=0, process_count=1)
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
                             drop_remainder=False, process_index=0, process_count=1)
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
    model = models.build(config.model, policy, seed=config.seed, **kwargs)
    graphdef, params, model_state = models.split(model)
    if config.task == "mlm":
        loss_fn = eval_fn = models.mlm_loss(graphdef)
        flags = dict(has_aux=True)
    elif _is_text(config.task):
        loss_fn = eval_fn = models.lm_loss(graphdef)
        flags = dict(has_aux=True)
    else:
        loss_fn = models.classification_loss(graphdef)
        eval_fn = models.classification_loss(graphdef, train=False)
        flags = dict(has_aux=True, has_model_state=True)
    return params, model_state, loss_fn, eval_fn, flags


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


def _layout(config: Config, step_fn: Callable, state: jaxamp.TrainState):
    """Jits (or pmaps) the step and returns ``(step, state, put_batch, unput_state)``."""
    if config.parallel == "none":
        step = jax.jit(step_fn, donate_argnums=0)
        return step, state, (lambda b: b), (lambda s: s)
    if config.parallel == "jit":
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        sharding = jaxamp.batch_sharding(mesh)
        state = jax.device_put(state, replicated)

        def put(batch):
            return jax.make_array_from_process_local_data(sharding, batch) \
                if jax.process_count() > 1 else jaxamp.put_sharded(batch, sharding)
        step = jax.jit(step_fn, donate_argnums=0, out_shardings=(replicated, replicated))
        return step, state, put, (lambda s: s)
    if config.parallel == "pmap":
        if jax.process_count() > 1:
            raise ValueError("parallel='pmap' runs on one host; use parallel='jit' with "
                             "jax.distributed for several processes")
        step = jax.pmap(step_fn, axis_name="batch", donate_argnums=0)
        return step, jaxamp.replicate(state), jaxamp.shard_batch, jaxamp.unreplicate
    raise ValueError(f"unknown parallel {config.parallel!r}; expected none, pmap or jit")


def _scalar(x) -> float:
    x = np.asarray(jax.device_get(x))
    return float(x.reshape(-1)[0])


def train_and_evaluate(config: Config, workdir: str, *, resume: bool = False) -> dict:
    """Trains and evaluates one config; returns the summary (also written to workdir)."""
    os.makedirs(workdir, exist_ok=True)
    policy = jaxamp.get_policy(config.precision)
    is_chief = jax.process_index() == 0
    batches, evals, meta = build_data(config)
    params, model_state, loss_fn, eval_fn, flags = build_model(config, policy, meta)

    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, config.warmup_steps,
                                                  max(config.steps, config.warmup_steps + 1))
    tx = jaxamp.mixed_precision(optax.adamw(schedule, weight_decay=config.weight_decay),
                                policy, loss_scale=_loss_scale(config, policy),
                                stall_after=config.stall_after or None)
    state = jaxamp.TrainState.create(params=params, tx=tx, policy=policy,
                                     model_state=model_state, rng=jax.random.PRNGKey(config.seed))
    axis = "batch" if config.parallel == "pmap" else None
    step_fn = jaxamp.make_train_step(loss_fn, accum_steps=config.accum_steps, axis_name=axis,
                                     **flags)

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    checkpoints = os.path.abspath(os.path.join(workdir, "checkpoints"))
    manager = ocp.CheckpointManager(checkpoints, options=options, item_names=("state", "data"))
    start = 0
    # latest_step() only sees committed checkpoints: a write cut short (a kill, a crash) leaves
    # a "<step>.orbax-checkpoint-tmp" directory that is never loaded and is replaced on save.
    if resume and manager.latest_step() is not None:
        start = int(manager.latest_step())
        try:
            check_checkpoint_matches(os.path.join(checkpoints, str(start), "state"), state)
        except CheckpointMismatch:
            manager.close()
            raise
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state), data=ocp.args.JsonRestore()))
        state = restored.state
        batches.restore(tuple(restored.data))
        if is_chief:
            print(f"resuming from the checkpoint of step {start} in {checkpoints}", flush=True)

    step, state, put, unput = _layout(config, step_fn, state)
    # A host thread keeps the next batches ready; its state() is the position of the batches
    # actually consumed, which is what a checkpoint must hold.
    feed = data_lib.prefetch(batches, size=2)

    def save(at: int):
        host_state = unput(state)
        manager.save(at, args=ocp.args.Composite(
            state=ocp.args.StandardSave(host_state),
            data=ocp.args.JsonSave(list(feed.state()))),
            force=True)
        manager.wait_until_finished()

    logger = _Logger(workdir, enabled=is_chief, resume_from=start if resume else 0)
    items = (config.batch_size * config.seq_len) if _is_text(config.task) else config.batch_size
    unit = "tokens/s" if _is_text(config.task) else "img/s"
    bar = _progress(config, start, is_chief)
    stopped = None
    try:
        with _Stop() as stop:
            t_last, n_last = time.perf_counter(), start
            previous = None
            for i in range(start, config.steps):
                state, metrics = step(state, put(next(feed)))
                done = i + 1
                # The previous step's stall flag, read while this step runs: every step is
                # checked without a host sync between steps.
                if previous is not None and _scalar(previous[1]["stalled"]):
                    raise TrainingStalled(_stall_message(*previous, params, config.stall_after))
                previous = (done, metrics)
                if done % config.log_every == 0 or done == config.steps:
                    row = {k: _scalar(v) for k, v in metrics.items() if k != "aux"}
                    row.update({f"aux_{k}": _scalar(v)
                                for k, v in metrics.get("aux", {}).items()})
                    now = time.perf_counter()
                    row["throughput"] = items * (done - n_last) / max(now - t_last, 1e-9)
                    t_last, n_last = now, done
                    logger.write(done, row)
                    if bar is not None:
                        bar.set_postfix(loss=f"{row['loss']:.4f}",
                                        scale=f"{row['loss_scale']:g}",
                                        skipped=int(row["skipped_steps"]),
                                        **{unit: f"{row['throughput']:.0f}"})
                if bar is not None:
                    bar.update(1)
                saving = done % config.checkpoint_every == 0 or done == config.steps
                if (saving or stop.signal is not None) and _scalar(metrics["stalled"]):
                    raise TrainingStalled(_stall_message(done, metrics, params,
                                                         config.stall_after))
                if saving:
                    save(done)
                    t_last = time.perf_counter()  # throughput leaves checkpoint time out
                if stop.signal is not None:
                    save(done)
                    stopped = done
                    break
    finally:
        feed.close()
        if bar is not None:
            bar.close()
        logger.close()
        manager.close()

    final = unput(state)
    summary = {"config": dataclasses.asdict(config), "steps": stopped or config.steps,
               "stopped_by_signal": stopped is not None, "resumed_from": start if resume else None,
               "skipped_steps": int(jaxamp.find_state(final.opt_state).skipped_steps),
               "loss_scale": _scalar(final.loss_scale)}
    if stopped is None:
        summary.update(evaluate(config, final, eval_fn, flags, evals))
        if is_chief:
            plot_run(workdir)
    if is_chief:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def evaluate(config: Config, state: jaxamp.TrainState, loss_fn: Callable, flags: dict,
             evals) -> dict:
    """Mean loss (and accuracy for classification) over up to ``config.eval_batches`` batches."""
    policy = state.policy
    kwargs = {"model_state": state.model_state} if flags.get("has_model_state") else {}

    @jax.jit
    def eval_step(params, batch):
        out = loss_fn(params, policy.cast_to_compute(batch), **kwargs)
        return out[0], out[-1]

    losses, accs = [], []
    for _, batch in zip(range(config.eval_batches), evals, strict=False):
        loss, aux = eval_step(state.params, batch)
        losses.append(float(loss))
        if isinstance(aux, dict) and "accuracy" in aux:
            accs.append(float(aux["accuracy"]))
    out = {"eval_loss": float(np.mean(losses))}
    if accs:
        out["eval_accuracy"] = float(np.mean(accs))
    return out


def _progress(config: Config, start: int, enabled: bool):
    if not (enabled and config.progress):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=config.steps, initial=start, desc=f"{config.model} {config.precision}",
                dynamic_ncols=True)


class _Logger:
    """CSV and TensorBoard logs of every metric (process 0 only)."""

    def __init__(self, workdir: str, *, enabled: bool, resume_from: int = 0):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.csv")
        self._file = None
        self._writer: Any = None
        self._tb: Any = None
        if not enabled:
            return
        # A resumed run continues the log of the checkpoint it restored: rows written after
        # that checkpoint (by a run that was killed) are dropped, and so is a torn last line.
        self._resume = resume_from > 0 and _truncate_log(self.path, resume_from)
        try:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:  # the [train] extra is not installed: CSV only
            self._tb = None

    def write(self, step: int, row: dict):
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a" if self._resume else "w", newline="")  # noqa: SIM115
            self._writer = csv.DictWriter(self._file, fieldnames=["step", *row])
            if not self._resume:
                self._writer.writeheader()
        self._writer.writerow({"step": step, **row})
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                self._tb.add_scalar(k, v, step)

    def close(self):
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _truncate_log(path: str, last_step: int) -> bool:
    """Keeps the complete rows of ``path`` up to ``last_step``; False when there is no log."""
    if not os.path.exists(path):
        return False
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return False
    header, body = rows[0], rows[1:]
    keep = [r for r in body
            if len(r) == len(header) and r[0].isdigit() and int(r[0]) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        csv.writer(f).writerows([header, *keep])
    os.replace(tmp, path)
    return True


def read_metrics(workdir: str) -> dict[str, np.ndarray]:
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]} if rows else {}


def plot_run(workdir: str) -> str:
    """Loss and loss scale against step, as ``workdir/curves.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = read_metrics(workdir)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(m["step"], m["loss"])
    ax1.set(xlabel="step", ylabel="loss", title="training loss")
    ax2.plot(m["step"], m["loss_scale"])
    ax2.set(xlabel="step", ylabel="loss scale", title="loss scale", yscale="log")
    fig.tight_layout()
    path = os.path.join(workdir, "curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def compare(config: Config, precisions: list[str], workdir: str) -> list[dict]:
    """Trains the same config under several precisions; writes a table and one plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for precision in precisions:
        run_dir = os.path.join(workdir, precision)
        summary = train_and_evaluate(dataclasses.replace(config, precision=precision), run_dir)
        results.append({"precision": precision, **{k: v for k, v in summary.items()
                                                   if k != "config"}})
        if jax.process_index() == 0:
            m = read_metrics(run_dir)
            ax.plot(m["step"], m["loss"], label=precision)
    if jax.process_index() == 0:
        ax.set(xlabel="step", ylabel="training loss", title=f"{config.model} on {config.task}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, "compare.png"), dpi=100)
        keys = ["precision", "eval_loss", "eval_accuracy", "skipped_steps", "loss_scale"]
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in results:
            lines.append("| " + " | ".join(
                f"{r[k]:.4f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                for k in keys) + " |")
        with open(os.path.join(workdir, "compare.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    plt.close(fig)
    return results
