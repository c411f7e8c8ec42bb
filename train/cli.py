"""``python -m train``: train a reference model under a jaxamp precision.

Examples::

    python -m train                                  # ResNet on digits, precision auto
    python -m train --config text --precision mixed_float16
    python -m train --compare float32,mixed_bfloat16,mixed_float16 --workdir runs/compare
    python -m train --resume --workdir runs/default  # continue from the latest checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from train.configs import PRESETS
from train.configs import get_config

PRECISIONS = ("auto", "float32", "bfloat16", "mixed_bfloat16", "mixed_float16")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default", choices=sorted(PRESETS))
    ap.add_argument("--task", choices=("digits", "text", "mlm", "synthetic_images",
                                       "synthetic_text"))
    ap.add_argument("--model", help="resnet18, resnet50, resnet18_small, resnet50_small, "
                                    "bert_tiny, bert_base, bert_large, gpt_tiny, gpt_small")
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--accum-steps", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--parallel", choices=("none", "pmap", "jit"))
    ap.add_argument("--loss-scale", choices=("auto", "dynamic", "static", "none"))
    ap.add_argument("--init-scale", type=float)
    ap.add_argument("--growth-interval", type=int)
    ap.add_argument("--hysteresis", type=int)
    ap.add_argument("--min-scale", type=float, help="the dynamic loss scale's lower bound")
    ap.add_argument("--stall-after", type=int,
                    help="stop with an error after this many consecutive non-finite steps at "
                         "the minimum loss scale (default 10; 0: keep skipping)")
    ap.add_argument("--checkpoint-every", type=int)
    ap.add_argument("--keep-checkpoints", type=int)
    ap.add_argument("--data", help="your own .npz images (image/label) or a text file")
    ap.add_argument("--workdir", default=None, help="default: runs/<config>")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--compare", help="comma-separated precisions to train side by side")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--coordinator", help="jax.distributed coordinator address host:port")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.coordinator:
        import jax
        # CPU devices of different processes exchange collectives through gloo (the setting
        # does not affect GPU or TPU backends).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    from train import train as train_lib
    fields = {f.name for f in dataclasses.fields(train_lib.Config)}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.no_progress:
        overrides["progress"] = False
    config = get_config(args.config, **overrides)
    workdir = args.workdir or f"runs/{args.config}"
    if args.compare:
        train_lib.compare(config, args.compare.split(","), workdir)
        return
    try:
        summary = train_lib.train_and_evaluate(config, workdir, resume=args.resume)
    except (train_lib.TrainingStalled, train_lib.CheckpointMismatch) as e:
        raise SystemExit(f"python -m train: error: {e}") from e
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
