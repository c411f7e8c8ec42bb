"""What a run writes and shows: the CSV and TensorBoard log of every metric, the progress bar,
and the plots of one run and of a ``--compare``.

Only process 0 writes; the others get a disabled logger and no bar.
"""

from __future__ import annotations

import csv
import math
import os
import time
from typing import Any

import jax
import numpy as np

import jaxamp
from train.configs.default import Config


def scalar(x) -> float:
    """The first element of ``x`` (a metric, replicated under ``pmap``), as a Python float."""
    x = np.asarray(jax.device_get(x))
    return float(x.reshape(-1)[0])


def row(metrics: dict) -> dict[str, float]:
    """One log row: every metric of a step as a float, its ``aux`` outputs as ``aux_<name>``,
    averaged over the devices and micro-batches they come per (under ``pmap``, a data-parallel
    ``jit`` and ``accum_steps``)."""
    out = {k: scalar(v) for k, v in metrics.items() if k != "aux"}
    out.update({f"aux_{k}": float(np.mean(np.asarray(jax.device_get(v), np.float64)))
                for k, v in metrics.get("aux", {}).items()})
    return out


class Throughput:
    """Items per second between two log rows. :meth:`restart_clock` after a checkpoint leaves
    the time it took out of the next figure."""

    def __init__(self, items_per_step: int, step: int):
        self.items_per_step = items_per_step
        self._time, self._step = time.perf_counter(), step

    def rate(self, step: int) -> float:
        now = time.perf_counter()
        out = self.items_per_step * (step - self._step) / max(now - self._time, 1e-9)
        self._time, self._step = now, step
        return out

    def restart_clock(self) -> None:
        self._time = time.perf_counter()


class MetricsLogger:
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
            # A skipped step's inf or nan loss stays in the CSV; TensorBoard gets the finite
            # values only (tensorboardX warns on every non-finite scalar).
            for k, v in row.items():
                if math.isfinite(float(v)):
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


def progress(config: Config, start: int, enabled: bool):
    """A tqdm bar over the config's steps, or ``None`` when disabled or ``config.progress`` is
    off."""
    if not (enabled and config.progress):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=config.steps, initial=start, desc=f"{config.model} {config.precision}",
                dynamic_ncols=True)


def show(bar, row: dict, unit: str) -> None:
    """Puts a log row's loss, loss scale, skipped steps and throughput on the bar."""
    if bar is not None:
        bar.set_postfix(loss=f"{row['loss']:.4f}", scale=f"{row['loss_scale']:g}",
                        skipped=int(row["skipped_steps"]), **{unit: f"{row['throughput']:.0f}"})


def read_metrics(workdir: str) -> dict[str, np.ndarray]:
    """The metrics log of ``workdir`` as ``{column: float array}`` (``{}`` when empty)."""
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]} if rows else {}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(workdir: str) -> str:
    """Loss and loss scale against step, as ``workdir/curves.png``."""
    plt = _pyplot()
    m = read_metrics(workdir)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(m["step"], m["loss"])
    ax1.set(xlabel="step", ylabel="loss", title="training loss")
    # The scale holds between the logged rows, which hold every change and skip.
    ax2.plot(m["step"], m["loss_scale"], drawstyle="steps-post")
    skipped = m["grads_finite"] == 0
    if skipped.any():
        ax2.plot(m["step"][skipped], m["loss_scale"][skipped], "rx", label="skipped step")
        ax2.legend()
    ax2.set(xlabel="step", ylabel="loss scale", title="loss scale", yscale="log")
    fig.tight_layout()
    path = os.path.join(workdir, "curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_compare(workdir: str, precisions: list[str], title: str) -> str:
    """The training loss of each ``workdir/<precision>`` run on one plot, ``compare.png``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for precision in precisions:
        m = read_metrics(os.path.join(workdir, precision))
        ax.plot(m["step"], m["loss"], label=precision_label(precision))
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(workdir, "compare.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def precision_label(precision: str) -> str:
    """``precision`` as a user reads it: ``auto`` with what it resolved to on this machine
    (``"auto → float32 on cpu"``)."""
    if precision != "auto":
        return precision
    return f"auto → {jaxamp.Policy.resolve_auto()} on {jax.local_devices()[0].platform}"


def compare_table(results: list[dict]) -> str:
    """A markdown table of the runs' eval loss and accuracy, skipped steps and loss scale."""
    keys = ["precision", "eval_loss", "eval_accuracy", "skipped_steps", "loss_scale"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in results:
        lines.append("| " + " | ".join(
            f"{r[k]:.4f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
            for k in keys) + " |")
    return "\n".join(lines)
