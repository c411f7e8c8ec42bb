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
import os
import sys

import jaxamp
from train import data as data_lib
from train.configs import PRESETS
from train.configs import get_config

PROG = "python -m train"
PRECISIONS = jaxamp.Policy.PRESETS  # the one list of presets
DATA_HELP = (
    "your own data instead of the task's. --task digits: a .npz archive, "
    "np.savez(FILE, image=images, label=labels), with images [N, H, W] or [N, H, W, C] (uint8 "
    "0-255 or float, finite) and integer labels [N] in 0..num_classes-1 (num_classes is inferred "
    "from the labels unless --num-classes is given). --task text or mlm: a UTF-8 text file, "
    "trained on byte by byte. 20%% of the images, or the last 10%% of the text, are held out "
    "for eval.")


MOMENT_FORMATS = ("float32", "bfloat16", "8bit")


def _moments_dtype(text: str) -> str:
    """``--moments-dtype``: one format, or FIELD=FORMAT pairs separated by commas."""
    pairs = [p.partition("=") for p in text.split(",")] if "=" in text else [("", "", text)]
    for field, _, fmt in pairs:
        if fmt not in MOMENT_FORMATS or ("=" in text and not field):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected one of {', '.join(MOMENT_FORMATS)}, or FIELD=FORMAT pairs "
                "separated by commas (mu=bfloat16: adamw's first moment in bf16)")
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(PRESETS),
                    help="the preset (default: default; with --resume, the run's own)")
    ap.add_argument("--task", choices=("digits", "text", "mlm", "synthetic_images",
                                       "synthetic_text"))
    ap.add_argument("--model", help="resnet18, resnet50, resnet18_small, resnet50_small, "
                                    "bert_tiny, bert_base, bert_large, gpt_tiny, gpt_small, "
                                    "nnx_gpt_tiny (a user's NNX GPT, for --autocast)")
    ap.add_argument("--precision", choices=PRECISIONS,
                    help="the jaxamp preset (default: the config's; auto picks one per "
                         "device: mixed_bfloat16 on TPUs and Ampere or newer GPUs, "
                         "mixed_float16 on older GPUs, float32 on CPUs)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--accum-steps", type=int)
    ap.add_argument("--autocast", action="store_true", default=None,
                    help="run the loss under jaxamp.autocast: matmuls in the compute dtype, "
                         "precision-sensitive ops in fp32, whatever dtypes the model uses")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup-steps", type=int, help="linear warmup before the cosine decay")
    ap.add_argument("--grad-clip", type=float, metavar="NORM",
                    help="clip the unscaled fp32 gradients to this global norm (default 0: off)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--parallel", choices=("none", "pmap", "jit"))
    ap.add_argument("--zero", type=int, choices=(0, 1, 3),
                    help="with --parallel jit: 1 shards the fp32 master and the optimizer state "
                         "over the devices (ZeRO-1/2), 3 the working params too (ZeRO-3); "
                         "default 0, replicated")
    ap.add_argument("--master", choices=("float32", "kahan", "stochastic", "none"),
                    help="where each half-precision param's fp32 value lives: an fp32 master "
                         "copy (default), a 16-bit compensation (kahan), nowhere with "
                         "stochastic rounding, or nowhere (none: loses small updates)")
    ap.add_argument("--moments-dtype", type=_moments_dtype, metavar="FORMAT|FIELD=FORMAT,...",
                    help="how adamw's moments are stored between steps, computed in fp32: "
                         "float32, bfloat16 (rounded stochastically) or 8bit (block-wise "
                         "8-bit codes), for both, or per field: mu=bfloat16 stores the first "
                         "moment in bf16 and keeps the second in fp32")
    ap.add_argument("--fp8-recipe", choices=("current", "delayed"),
                    help="with --precision mixed_fp8: current (default) scales each FP8 tensor "
                         "by its own amax, through jaxamp.autocast, for any model; delayed "
                         "keeps amax histories in the model state (bert_* and gpt_* models)")
    ap.add_argument("--fp8-granularity", choices=jaxamp.fp8.CurrentScaling.GRANULARITIES,
                    help="with --fp8-recipe current: one scale per tensor (default), per row "
                         "along the contraction (rowwise), per 1x128 tile and 128x128 weight "
                         "block (blocks), or per 1x32 tile with power-of-two scales (mxfp8)")
    ap.add_argument("--fp8-weight-grad", choices=jaxamp.fp8.CurrentScaling.WEIGHT_GRADS,
                    help="with --fp8-recipe current: the weight-gradient GEMM in FP8 (default) "
                         "or in the compute dtype (high)")
    ap.add_argument("--fp8-every-matmul", dest="fp8_keep_bf16", action="store_false",
                    default=None,
                    help="with --fp8-recipe current: quantize the embeddings' and the head's "
                         "matmuls and the attention's batched ones too (default: bf16)")
    ap.add_argument("--fp8-history", type=int, metavar="N",
                    help="with --fp8-recipe delayed: the amax history length (default 16)")
    ap.add_argument("--fp8-margin", type=int, metavar="M",
                    help="with --fp8-recipe delayed: divide each scale by 2**M (default 0)")
    ap.add_argument("--fp8-algo", choices=jaxamp.fp8.DelayedScaling.AMAX_ALGOS,
                    help="with --fp8-recipe delayed: the scale follows the history's max "
                         "(default) or its most recent amax")
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
    ap.add_argument("--data", metavar="FILE", help=DATA_HELP)
    ap.add_argument("--num-classes", type=int, metavar="K",
                    help="the classes of --data images: labels must lie in [0, K) "
                         "(default: the largest label + 1)")
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
    if args.num_classes is not None and args.num_classes < 1:
        _fail(f"--num-classes {args.num_classes}; expected a positive number of classes")
    if args.grad_clip is not None and not args.grad_clip >= 0:
        _fail(f"--grad-clip {args.grad_clip}; expected a norm >= 0 (0: no clipping)")
    preset = args.config or "default"
    workdir = args.workdir or f"runs/{preset}"
    config = get_config(preset, **overrides)
    if args.resume:  # the run's own config, with what may change on a resume
        config = _resumed_config(train_lib, workdir, config, overrides, args.config)
    if args.fp8_recipe is not None and not jaxamp.get_policy(config.precision).fp8:
        _fail(f"--fp8-recipe {args.fp8_recipe} is for --precision mixed_fp8, got --precision "
              f"{config.precision}")
    try:
        train_lib.check_fp8(config)
    except ValueError as e:
        _fail(str(e))
    if config.data:
        # Before anything is written: a bad file leaves no workdir behind.
        config = check_data(config, args.num_classes)
    try:
        if args.compare:
            train_lib.compare(config, args.compare.split(","), workdir)
            return
        summary = train_lib.train_and_evaluate(config, workdir, resume=args.resume)
    except train_lib.WorkdirHeld as e:
        _fail(str(e))
    except (train_lib.TrainingStalled, train_lib.CheckpointMismatch) as e:
        raise SystemExit(f"{PROG}: error: {e}") from e
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


def _resumed_config(train_lib, workdir, config, overrides, preset):
    """``--resume``: the config the run in ``workdir`` stored, with the flags given that a
    resume may change (``train.RESUMABLE``: --steps, ...); another flag, or a --config, that
    contradicts it is an error naming both values. A run that stored none (an older
    version's): the preset and flags given."""
    if not os.path.isdir(workdir):
        _fail(f"--resume: {workdir} holds no run; pass the --workdir of the run to continue")
    stored = train_lib.stored_config(workdir)
    if stored is None:
        return config
    asked = json.loads(json.dumps(dataclasses.asdict(config)))
    if preset is not None:
        for key in ("task", "model"):
            if stored.get(key) != asked[key]:
                _fail(f"--resume: the run in {workdir} has {key} {stored.get(key)!r}, and "
                      f"--config {preset} gives {asked[key]!r}; leave --config out to "
                      "continue it, or train into another --workdir")
    for key in overrides:
        if key not in train_lib.RESUMABLE and stored.get(key) != asked[key]:
            _fail(f"--resume: the run in {workdir} has {key} {stored.get(key)!r}, and "
                  f"--{key.replace('_', '-')} {asked[key]!r} was given; leave the flag out to "
                  "continue it, or train into another --workdir")
    kept = {k: getattr(config, k) for k in overrides if k in train_lib.RESUMABLE}
    fields = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{**{k: v for k, v in stored.items() if k in fields},
                                          **kept})


IMAGE_TASKS, TEXT_TASKS = ("digits",), ("text", "mlm")


def check_data(config, num_classes: int | None = None):
    """Loads and checks ``config.data`` for ``config.task``, prints what it holds, and returns
    the config with ``num_classes`` set for an image file (``num_classes``, or else inferred from
    the labels). A bad file exits with status 2 and one line, ``python -m train: error:
    <file>: <what is wrong>; <what is expected>``."""
    path, task = config.data, config.task
    if task not in IMAGE_TASKS + TEXT_TASKS:
        _fail(f"--data {path} with --task {task}, which makes its own data; expected --task "
              f"{' or '.join(IMAGE_TASKS)} for .npz images, or {' or '.join(TEXT_TASKS)} for a "
              "text file")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if task in IMAGE_TASKS:
            if os.path.isfile(path) and suffix != ".npz":
                raise data_lib.DataError(
                    f"{path}: has the extension {suffix or '(none)'}; expected a .npz archive "
                    f"for --task {task} (a text file trains with --task text or mlm)")
            arrays = data_lib.load_npz_images(path, num_classes=num_classes)
            num_examples = len(arrays["label"])
            height, width, channels = arrays["image"].shape[1:]
            inferred = num_classes is None
            if inferred:
                num_classes = int(arrays["label"].max()) + 1
            _check_enough(path, num_examples, "examples", _image_split, config.batch_size, 1,
                          f"a batch of --batch-size {config.batch_size} for training and one "
                          "example for eval", "a smaller --batch-size")
            summary = (f"{num_examples} examples, image shape {height}x{width}x{channels}, "
                       f"num_classes={num_classes} "
                       f"({'inferred from labels' if inferred else 'from --num-classes'})")
            config = dataclasses.replace(config, num_classes=num_classes)
        else:
            if os.path.isfile(path) and suffix in (".npz", ".npy"):
                raise data_lib.DataError(
                    f"{path}: is a numpy {suffix} file; expected a UTF-8 text file for --task "
                    f"{task} (.npz images train with --task digits)")
            num_bytes = len(data_lib.load_text_file(path))
            window = config.seq_len + 1
            _check_enough(path, num_bytes, "bytes", _text_split, window, window,
                          f"a window of --seq-len {config.seq_len} + 1 bytes in each part",
                          "a smaller --seq-len")
            summary = f"{num_bytes} bytes of UTF-8 text, vocab={data_lib.BYTE_VOCAB} (bytes)"
    except data_lib.DataError as e:
        _fail(str(e))
    if _is_chief():
        print(f"data: {path}: {summary}", flush=True)
    return config


def _image_split(n: int) -> tuple[int, int]:
    """(train, eval) examples, as ``train.build_data`` splits images: 20% held out."""
    n_eval = round(0.2 * n)
    return n - n_eval, n_eval


def _text_split(n: int) -> tuple[int, int]:
    """(train, eval) bytes, as ``train.build_data`` splits text: the last 10% held out."""
    return n - n // 10, n // 10


def _check_enough(path, n, unit, split, train_need, eval_need, what, fix):
    """Raises a DataError unless ``split(n)`` leaves ``train_need`` items for training and
    ``eval_need`` for eval."""
    train_part, eval_part = split(n)
    if train_part >= train_need and eval_part >= eval_need:
        return
    least = n
    while split(least)[0] < train_need or split(least)[1] < eval_need:
        least += 1
    raise data_lib.DataError(
        f"{path}: holds {n} {unit}, {train_part} for training and {eval_part} held out for eval; "
        f"expected at least {least} {unit}, enough for {what}, or {fix}")


def _is_chief() -> bool:
    import jax
    return jax.process_index() == 0


def _fail(message: str):
    """Exits with status 2, as argparse does, after one line on stderr."""
    one_line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"{PROG}: error: {one_line}", file=sys.stderr, flush=True)
    raise SystemExit(2)
