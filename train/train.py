"""``train_and_evaluate(config, workdir)``: one training run, end to end.

Builds the data pipeline and the model, trains with ``jaxamp.make_train_step`` under the chosen
precision and parallelism, logs every metric (CSV, TensorBoard), checkpoints with orbax's
``CheckpointManager`` (and on SIGTERM/SIGINT), resumes bit for bit, evaluates, and plots.
Only process 0 writes logs and plots; every process takes part in checkpoints.
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
                                       hysteresis=config.hysteresis)
    if kind == "static":
        return jaxamp.StaticLossScale(config.init_scale)
    if kind == "none":
        return jaxamp.NoOpLossScale()
    raise ValueError(f"unknown loss_scale {kind!r}; expected auto, dynamic, static or none")


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
                                policy, loss_scale=_loss_scale(config, policy))
    state = jaxamp.TrainState.create(params=params, tx=tx, policy=policy,
                                     model_state=model_state, rng=jax.random.PRNGKey(config.seed))
    axis = "batch" if config.parallel == "pmap" else None
    step_fn = jaxamp.make_train_step(loss_fn, accum_steps=config.accum_steps, axis_name=axis,
                                     **flags)

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                                    options=options, item_names=("state", "data"))
    start = 0
    if resume and manager.latest_step() is not None:
        start = int(manager.latest_step())
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state), data=ocp.args.JsonRestore()))
        state = restored.state
        batches.restore(tuple(restored.data))

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

    logger = _Logger(workdir, enabled=is_chief, resume=resume and start > 0)
    items = (config.batch_size * config.seq_len) if _is_text(config.task) else config.batch_size
    unit = "tokens/s" if _is_text(config.task) else "img/s"
    bar = _progress(config, start, is_chief)
    stopped = None
    with _Stop() as stop:
        t_last, n_last = time.perf_counter(), start
        for i in range(start, config.steps):
            state, metrics = step(state, put(next(feed)))
            done = i + 1
            if done % config.log_every == 0 or done == config.steps:
                row = {k: _scalar(v) for k, v in metrics.items() if k != "aux"}
                row.update({f"aux_{k}": _scalar(v) for k, v in metrics.get("aux", {}).items()})
                now = time.perf_counter()
                row["throughput"] = items * (done - n_last) / max(now - t_last, 1e-9)
                t_last, n_last = now, done
                logger.write(done, row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.4f}", scale=f"{row['loss_scale']:g}",
                                    skipped=int(row["skipped_steps"]),
                                    **{unit: f"{row['throughput']:.0f}"})
            if bar is not None:
                bar.update(1)
            if done % config.checkpoint_every == 0 or done == config.steps:
                save(done)
                t_last = time.perf_counter()  # throughput leaves checkpoint time out
            if stop.signal is not None:
                save(done)
                stopped = done
                break
    feed.close()
    if bar is not None:
        bar.close()
    logger.close()

    final = unput(state)
    summary = {"config": dataclasses.asdict(config), "steps": stopped or config.steps,
               "stopped_by_signal": stopped is not None,
               "skipped_steps": int(jaxamp.find_state(final.opt_state).skipped_steps),
               "loss_scale": _scalar(final.loss_scale)}
    if stopped is None:
        summary.update(evaluate(config, final, eval_fn, flags, evals))
        if is_chief:
            plot_run(workdir)
    if is_chief:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    manager.close()
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

    def __init__(self, workdir: str, *, enabled: bool, resume: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.csv")
        self._file = None
        self._writer: Any = None
        self._tb: Any = None
        if not enabled:
            return
        self._resume = resume and os.path.exists(self.path)
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
