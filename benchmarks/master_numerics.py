"""Suite ``master_numerics``: training without an fp32 master, on real data, against the master.

    python -m benchmarks master_numerics [--seeds 3] [--tiny]

The CLI's two real-data tasks under ``mixed_bfloat16``, one run per seed and option of
``jaxamp.mixed_precision`` (``master=``, ``moments_dtype=``), every other setting equal:

- ``digits``: ResNet-18 (small-image stem, width 16) on scikit-learn's digits, 300 steps of 64;
- ``text``: the 2 x 64 character GPT on Python's ``pydoc_data`` text, 1500 steps of 32 x 64 bytes.

Each row is a run's eval loss and its change against ``master="float32"`` with the same seed
(the same init and batches); the ``mean`` rows average the seeds.
"""

from __future__ import annotations

import os
import statistics
import tempfile

from benchmarks import harness

ROUNDS = None  # nothing is timed
OPTIONS = (("float32", "float32"), ("kahan", "float32"), ("kahan", "bfloat16"),
           ("stochastic", "float32"), ("none", "float32"))
TINY_OPTIONS = (("float32", "float32"), ("kahan", "float32"), ("stochastic", "bfloat16"))
TASKS = {"digits": ("default", 300), "text": ("text", 1500)}


def add_arguments(parser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="seeds per task (default 3)")
    parser.add_argument("--tasks", default="digits,text", help="comma-separated: digits,text")


def _name(master: str, moments_dtype: str) -> str:
    return master + ("+bf16_moments" if moments_dtype == "bfloat16" else "")


def _run(preset: str, steps: int, seed: int, master: str, moments_dtype: str) -> dict:
    from train import train as train_lib
    from train.configs import get_config
    config = get_config(preset, steps=steps, seed=seed, precision="mixed_bfloat16",
                        master=master, moments_dtype=moments_dtype, progress=False,
                        checkpoint_every=10**9)
    with tempfile.TemporaryDirectory() as workdir:
        summary = train_lib.train_and_evaluate(config, os.path.join(workdir, "run"))
    return summary


def run(args) -> list[dict]:
    seeds = 1 if args.tiny else getattr(args, "seeds", 3)
    tasks = ["digits"] if args.tiny else getattr(args, "tasks", "digits,text").split(",")
    options = TINY_OPTIONS if args.tiny else OPTIONS
    rows = []
    for task in tasks:
        preset, steps = ("tiny", 4) if args.tiny else TASKS[task]
        by_option: dict[str, list[float]] = {}
        for seed in range(seeds):
            base = None
            for master, moments in options:
                summary = _run(preset, steps, seed, master, moments)
                loss = summary["eval_loss"]
                base = loss if base is None else base
                name = _name(master, moments)
                by_option.setdefault(name, []).append(loss)
                rows.append({"task": task, "seed": seed, "option": name, "eval_loss": loss,
                             "eval_accuracy": summary.get("eval_accuracy"),
                             "vs_float32": loss / base - 1,
                             "skipped_steps": summary["skipped_steps"]})
                print(rows[-1], flush=True)
        base_mean = statistics.mean(by_option["float32"])
        for name, losses in by_option.items():
            rows.append({"task": task, "seed": "mean", "option": name,
                         "eval_loss": statistics.mean(losses), "eval_accuracy": None,
                         "vs_float32": statistics.mean(losses) / base_mean - 1,
                         "skipped_steps": None})
    harness.write_outputs(
        "master_numerics", rows,
        ["task", "seed", "option", "eval_loss", "eval_accuracy", "vs_float32"], args.out, None,
        f"{harness.machine()}; mixed_bfloat16, adamw with warmup and cosine decay; vs_float32 "
        "is the relative change of the eval loss against master='float32', same seed.")
    return rows


