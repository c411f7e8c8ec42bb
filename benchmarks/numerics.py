"""Suite ``numerics``: the numerics protocol, each precision recipe's eval loss against its twin
with a 95% confidence interval over paired seeds.

    python -m benchmarks numerics [--arms bf16,fp32,...] [--models char,wide] [--seeds 10]
                                  [--wide-seeds 3] [--steps 1500] [--lr 3e-3]
                                  [--warmup-steps 100] [--grad-clip 1] [--out runs/bench]

The protocol, for any recipe (a precision, an FP8 recipe, a master or moments option):

- **Paired seeds.** Seed ``s`` gives every arm the same init and the same batches (the CLI's
  ``seed``); an arm's gap on seed ``s`` is its eval loss over its twin's on seed ``s``, minus 1.
  The twin is ``bf16`` (``mixed_bfloat16`` with the fp32 master and fp32 moments), or the arm a
  goal names.
- **The whole held-out split.** The eval predicts every byte of the held-out text once (the
  last 10% of Python's ``pydoc_data`` text, 46,610 targets; ``eval_batches=0``), the same
  windows for every seed and arm.
- **The interval.** Per arm, the mean gap over the seeds and its 95% interval, Student's t with
  n - 1 degrees of freedom on the paired gaps. A goal holds only when the interval's upper
  bound is at or under it. The null, ``fp32`` against ``bf16``, is measured the same way: its
  interval's half-width is what the protocol can resolve.
- **The setting.** ``--lr``, ``--warmup-steps`` and ``--grad-clip`` (the global norm of the
  unscaled fp32 gradients, 0: none) set every run's training: by default the text preset's
  peak learning rate, 100 warmup steps and a norm of 1, under which the null's interval is
  +-0.3% at 10 seeds (+-1.5% without the clipping and with 20 warmup steps, the first runs'
  setting). A row records its setting; runs of another setting are other runs.
- **Two models.** ``char``: the CLI's ``text`` preset, the 2 x 64 character GPT (``gpt_tiny``),
  1500 adamw steps of 32 x 64 bytes with warmup and cosine decay, ``--seeds`` seeds (default
  10). ``wide``: the same at width 256 (4 heads, MLP 1024), ``--wide-seeds`` seeds (default 3),
  so that a recipe is not tuned to width 64.

Outputs in ``--out``: ``numerics_runs.jsonl``, one row per run with its loss curve, appended as
each run ends. A run already there (same model, arm, seed and steps) is not run again, so an
interrupted protocol resumes where it stopped, more seeds or arms add to it, and two processes
(one per core, e.g. one per group of arms) can share the file.
``numerics.jsonl`` and the printed table: per model and arm, the mean gap, its interval and the
goal. ``numerics.png``: the training loss of each arm (seed mean, band min to max) and each
arm's paired gap to the twin along training (mean and 95% band). Progress goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time

from benchmarks import harness

ROUNDS = None  # nothing is timed

# arm -> the Config fields it sets (every other field is the preset's).
ARMS = {
    "bf16": {"precision": "mixed_bfloat16"},
    "fp32": {"precision": "float32"},
    "fp8_tensor_all": {"precision": "mixed_fp8", "fp8_keep_bf16": False},
    "fp8_rowwise_all": {"precision": "mixed_fp8", "fp8_granularity": "rowwise",
                        "fp8_keep_bf16": False},
    "fp8_current": {"precision": "mixed_fp8", "fp8_recipe": "current"},
    "fp8_delayed": {"precision": "mixed_fp8", "fp8_recipe": "delayed"},
    "fp8_current_hp_wgrad": {"precision": "mixed_fp8", "fp8_weight_grad": "high"},
    "fp8_rowwise": {"precision": "mixed_fp8", "fp8_granularity": "rowwise"},
    "fp8_rowwise_hp_wgrad": {"precision": "mixed_fp8", "fp8_granularity": "rowwise",
                             "fp8_weight_grad": "high"},
    "fp8_blocks": {"precision": "mixed_fp8", "fp8_granularity": "blocks"},
    "fp8_mxfp8": {"precision": "mixed_fp8", "fp8_granularity": "mxfp8"},
    "kahan": {"precision": "mixed_bfloat16", "master": "kahan"},
    "kahan_bf16_mu": {"precision": "mixed_bfloat16", "master": "kahan",
                      "moments_dtype": "mu=bfloat16"},
    "kahan_bf16_moments": {"precision": "mixed_bfloat16", "master": "kahan",
                           "moments_dtype": "bfloat16"},
    "kahan_8bit": {"precision": "mixed_bfloat16", "master": "kahan", "moments_dtype": "8bit"},
    "stochastic": {"precision": "mixed_bfloat16", "master": "stochastic"},
    "none": {"precision": "mixed_bfloat16", "master": "none"},
}
TWIN = "bf16"
# arm -> (the arm it is compared with, the goal on the upper bound of the interval of its gap).
GOALS = {
    "fp8_tensor_all": ("bf16", 0.015),
    "fp8_rowwise_all": ("bf16", 0.01),
    "fp8_current": ("bf16", 0.01),
    "fp8_delayed": ("fp8_tensor_all", 0.0025),
    "fp8_current_hp_wgrad": ("bf16", 0.003),
    "fp8_rowwise": ("bf16", 0.01),
    "fp8_rowwise_hp_wgrad": ("bf16", 0.003),
    "fp8_blocks": ("bf16", 0.01),
    "fp8_mxfp8": ("bf16", 0.01),
    "kahan": ("bf16", 0.001),
    "kahan_bf16_mu": ("bf16", 0.003),
    "kahan_bf16_moments": ("bf16", 0.005),
    "kahan_8bit": ("bf16", 0.005),
    "stochastic": ("bf16", 0.005),
}
MODELS = {"char": {}, "wide": {"gpt": {"width": 256, "heads": 4, "mlp": 1024}}}
# The CLI's presets as they ship, each its own setting: its model, steps, learning rate, warmup
# and clipping (``text``: the char GPT, 500 steps, lr 3e-3, 20 warmup steps, no clipping;
# ``mlm``: the tiny BERT on the same text, 500 steps, lr 1e-3, 20 warmup steps, no clipping).
# The mlm task's masks are drawn, so its eval is not the split's windows once each but as many
# batches as the split holds (23 of 32 x 64), drawn with the seed: the same for every arm.
PRESET_MODELS = ("text", "mlm")
MLM_EVAL_BATCHES = 23
STEPS, SEEDS, WIDE_SEEDS = 1500, 10, 3
# The training setting of every run: the text preset's peak learning rate, 100 warmup steps and
# the gradients clipped to a global norm of 1 (GPT training's usual guards). Without them
# (FIRST_SETTING: 20 warmup steps, no clipping), paired runs part in the loss plateaus and the
# null's 95% interval is +-1.5% at 10 seeds; with them, +-0.3%. A row records its setting, and
# rows of another setting are other runs; rows without one (the first runs) are FIRST_SETTING's.
FIRST_SETTING = {"lr": 3e-3, "warmup_steps": 20, "grad_clip": 0.0}
SETTING = {"lr": 3e-3, "warmup_steps": 100, "grad_clip": 1.0}
# --tiny: the char model at width 32, 4 steps of 16 x 16 bytes (the held-out split in 183
# batches), one seed of bf16 and fp32 (the tests check the interval and the pairing on their
# own); the wide model is the char model with other overrides.
TINY = dict(batch_size=16, seq_len=16, log_every=1)
TINY_MODELS = {"char": {"gpt": {"depth": 1, "width": 32, "mlp": 64}},
               "wide": {"gpt": {"depth": 1, "width": 64, "heads": 2, "mlp": 64}},
               "text": {"gpt": {"depth": 1, "width": 32, "mlp": 64}},
               "mlm": {"bert": {"depth": 1, "width": 32, "heads": 2, "mlp": 64}}}
TINY_ARMS, TINY_SEEDS = ("bf16", "fp32"), {"char": 1, "wide": 0}


def add_arguments(parser) -> None:
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms (default: all of {', '.join(ARMS)}); the "
                             f"twin {TWIN} and the arms the goals compare with always run")
    parser.add_argument("--models", default="char,wide",
                        help="comma-separated: char,wide (the protocol's setting), text,mlm "
                             "(the CLI's presets, each in its own setting)")
    parser.add_argument("--seeds", type=int, default=SEEDS,
                        help=f"seeds 0 .. n-1 of the char model and the presets "
                             f"(default {SEEDS})")
    parser.add_argument("--wide-seeds", type=int, default=WIDE_SEEDS,
                        help=f"seeds of the wide model (default {WIDE_SEEDS})")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"training steps per run (default {STEPS})")
    parser.add_argument("--lr", type=float, default=SETTING["lr"],
                        help=f"peak learning rate (default {SETTING['lr']:g})")
    parser.add_argument("--warmup-steps", type=int, default=SETTING["warmup_steps"],
                        help=f"warmup steps (default {SETTING['warmup_steps']})")
    parser.add_argument("--grad-clip", type=float, default=SETTING["grad_clip"],
                        help=f"gradient clipping norm (default {SETTING['grad_clip']:g}: none)")


def arms_to_run(names: list[str]) -> list[str]:
    """``names``, the twin first, with every arm a goal of theirs compares with, in ARMS order."""
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(ARMS)}")
    wanted = {TWIN, *names}
    while True:
        more = {GOALS[a][0] for a in wanted if a in GOALS} - wanted
        if not more:
            return [a for a in ARMS if a in wanted]
        wanted |= more


def interval(gaps: list[float]) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)``: the mean of paired gaps and its two-sided 95% Student-t interval
    (``None`` bounds with fewer than two gaps)."""
    mean = statistics.fmean(gaps)
    if len(gaps) < 2:
        return mean, None, None
    from scipy import stats
    half = float(stats.t.ppf(0.975, len(gaps) - 1)) * statistics.stdev(gaps) / math.sqrt(len(gaps))
    return mean, mean - half, mean + half


def preset_setting(model: str) -> tuple[int, dict]:
    """``(steps, setting)`` of a preset model: the CLI's preset as it ships."""
    from train.configs import get_config
    preset = get_config(model)
    return preset.steps, {k: getattr(preset, k) for k in SETTING}


def _config(model: str, arm: str, seed: int, steps: int, tiny: bool,
            setting: dict | None = None):
    from train.configs import get_config
    models = TINY_MODELS if tiny else {**MODELS, **dict.fromkeys(PRESET_MODELS, {})}
    preset = model if model in PRESET_MODELS else "text"
    eval_batches = MLM_EVAL_BATCHES if model == "mlm" else 0
    return get_config(preset, **ARMS[arm], **(setting or SETTING), seed=seed, steps=steps,
                      eval_batches=eval_batches,
                      progress=False, checkpoint_every=10**9, model_overrides=models[model],
                      **(TINY if tiny else {}))


def _train(model: str, arm: str, seed: int, steps: int, tiny: bool, setting: dict) -> dict:
    from train import train as train_lib
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        run_dir = os.path.join(workdir, "run")
        summary = train_lib.train_and_evaluate(
            _config(model, arm, seed, steps, tiny, setting), run_dir)
        if summary["stopped_by_signal"]:
            # A run a signal stopped is not recorded; the protocol resumes with it.
            raise SystemExit(f"[numerics] {model} {arm} seed {seed} stopped by a signal at step "
                             f"{summary['steps']}; it is not recorded, and the next run of "
                             "the protocol runs it again")
        curve = train_lib.read_metrics(run_dir)
    return {"model": model, "arm": arm, "seed": seed, "steps": steps, "tiny": tiny,
            "setting": setting, "eval_loss": summary["eval_loss"],
            "skipped_steps": summary["skipped_steps"],
            "seconds": round(time.perf_counter() - t0, 1),
            "curve_step": [int(s) for s in curve["step"]],
            "curve_loss": [float(x) for x in curve["loss"]]}


def _key(model: str, arm: str, seed: int, steps: int, tiny: bool, setting: dict) -> tuple:
    return (model, arm, seed, steps, tiny, *(setting[k] for k in SETTING))


def _row_key(row: dict) -> tuple:
    return _key(row["model"], row["arm"], row["seed"], row["steps"], row.get("tiny", False),
                row.get("setting") or FIRST_SETTING)


def read_runs(path: str) -> list[dict]:
    """The runs recorded in ``path`` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _progress(message: str) -> None:
    print(f"[numerics] {message}", file=sys.stderr, flush=True)


def run_protocol(plan: list[tuple[str, str, int]], steps: int, tiny: bool, path: str,
                 setting: dict | None = None) -> list[dict]:
    """Runs each ``(model, arm, seed)`` of ``plan`` that ``path`` does not hold yet (with these
    ``steps`` and ``setting``, by default :data:`SETTING`), appending its row as it ends;
    returns the rows of the plan."""
    setting = {**SETTING, **(setting or {})}

    def key(p):
        return _key(*p, steps, tiny, setting)

    done = {_row_key(r): r for r in read_runs(path)}
    todo = [p for p in plan if key(p) not in done]
    _progress(f"{len(plan) - len(todo)} of {len(plan)} runs already in {path}; "
              f"{len(todo)} to run")
    spent = []
    for i, (model, arm, seed) in enumerate(todo):
        # Another process may share the file (one per core): what it has done is not redone.
        done.update((_row_key(r), r) for r in read_runs(path))
        if key((model, arm, seed)) in done:
            continue
        row = _train(model, arm, seed, steps, tiny, setting)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[_row_key(row)] = row
        spent.append(row["seconds"])
        left = statistics.fmean(spent) * (len(todo) - i - 1)
        _progress(f"{model} {arm} seed {seed}: eval loss {row['eval_loss']:.4f} "
                  f"({row['seconds']:.0f} s; {i + 1}/{len(todo)} done, about "
                  f"{left / 60:.0f} min left)")
    return [done[key(p)] for p in plan]


def summarize(rows: list[dict]) -> list[dict]:
    """Per model and arm: the mean eval loss and the paired gap to the twin (and to the arm its
    goal names), with the 95% interval and whether the goal holds."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        loss = {(r["arm"], r["seed"]): r["eval_loss"] for r in rows if r["model"] == model}
        for arm in dict.fromkeys(a for a, _ in loss):
            seeds = sorted(s for a, s in loss if a == arm)
            comparisons = [TWIN] + ([GOALS[arm][0]] if arm in GOALS else [])
            for vs in dict.fromkeys(comparisons):
                if vs == arm:
                    continue
                paired = [s for s in seeds if (vs, s) in loss]
                gaps = [loss[arm, s] / loss[vs, s] - 1 for s in paired]
                mean, low, high = interval(gaps) if gaps else (None, None, None)
                goal = GOALS[arm][1] if arm in GOALS and GOALS[arm][0] == vs else None
                out.append({"model": model, "arm": arm, "vs": vs, "seeds": len(gaps),
                            "eval_loss": statistics.fmean(loss[arm, s] for s in seeds),
                            "gap": mean, "ci_low": low, "ci_high": high, "goal": goal,
                            "holds": None if goal is None or high is None else high <= goal})
            if arm == TWIN:
                out.append({"model": model, "arm": arm, "vs": None, "seeds": len(seeds),
                            "eval_loss": statistics.fmean(loss[arm, s] for s in seeds),
                            "gap": None, "ci_low": None, "ci_high": None, "goal": None,
                            "holds": None})
    return out


def _smooth(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def plot(rows: list[dict], path: str) -> None:
    """Per model, the training loss of each arm (seed mean, band min to max) and each arm's
    paired training-loss gap to the twin (mean, 95% band), smoothed over 10 logged steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for (ax_loss, ax_gap), model in zip(axes, models, strict=True):
        runs = {(r["arm"], r["seed"]): r for r in rows if r["model"] == model}
        for arm in dict.fromkeys(a for a, _ in runs):
            seeds = sorted(s for a, s in runs if a == arm)
            steps = runs[arm, seeds[0]]["curve_step"]
            curves = [_smooth(runs[arm, s]["curve_loss"], 10) for s in seeds]
            by_step = list(zip(*curves, strict=True))
            line, = ax_loss.plot(steps, [statistics.fmean(v) for v in by_step], lw=1.2,
                                 label=f"{arm} ({len(seeds)} seeds)")
            ax_loss.fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step],
                                 color=line.get_color(), alpha=0.2)
            paired = [s for s in seeds if (TWIN, s) in runs]
            if arm == TWIN or not paired:
                continue
            twin = [_smooth(runs[TWIN, s]["curve_loss"], 10) for s in paired]
            gaps = [[a / b - 1 for a, b in zip(curves[seeds.index(s)], t, strict=True)]
                    for s, t in zip(paired, twin, strict=True)]
            bands = [interval(list(v)) for v in zip(*gaps, strict=True)]
            ax_gap.plot(steps, [100 * b[0] for b in bands], lw=1.2, color=line.get_color(),
                        label=arm)
            if len(paired) > 1:
                ax_gap.fill_between(steps, [100 * b[1] for b in bands],
                                    [100 * b[2] for b in bands], color=line.get_color(),
                                    alpha=0.2)
        ax_loss.set(title=f"{model}: training loss", xlabel="step", ylabel="loss")
        ax_loss.set_yscale("log")
        ax_gap.axhline(0.0, color="gray", lw=0.8, ls="--")
        ax_gap.set(title=f"{model}: training loss vs {TWIN}, same seed",
                   xlabel="step", ylabel="gap, %")
        for ax in (ax_loss, ax_gap):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _describe(model: str, steps: int, setting: dict) -> str:
    what = {"char": "the text preset's 2 x 64 GPT", "wide": "the GPT at width 256",
            "text": "the text preset as it ships", "mlm": "the mlm preset as it ships"}[model]
    clip = setting["grad_clip"]
    return (f"{what}, {steps} adamw steps, peak lr {setting['lr']:g}, "
            f"{setting['warmup_steps']} warmup steps, "
            + (f"gradients clipped to norm {clip:g}" if clip else "no clipping"))


def run(args) -> list[dict]:
    tiny = args.tiny
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS) - set(PRESET_MODELS))
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join((*MODELS, *PRESET_MODELS))}")
    arms = arms_to_run(list(TINY_ARMS) if tiny else [a for a in args.arms.split(",") if a])
    seeds = ({**TINY_SEEDS, **dict.fromkeys(PRESET_MODELS, 1)} if tiny else
             {"char": args.seeds, "wide": args.wide_seeds,
              **dict.fromkeys(PRESET_MODELS, args.seeds)})
    os.makedirs(args.out, exist_ok=True)
    setting = {"lr": args.lr, "warmup_steps": args.warmup_steps, "grad_clip": args.grad_clip}
    rows, settings = [], {}
    for model in models:
        steps, model_setting = ((args.steps, setting) if model in MODELS else
                                preset_setting(model))
        steps = 4 if tiny else steps
        settings[model] = (steps, model_setting)
        # Seed by seed, so that an interrupted protocol has paired runs of every arm.
        plan = [(model, a, s) for s in range(seeds[model]) for a in arms]
        rows += run_protocol(plan, steps, tiny, os.path.join(args.out, "numerics_runs.jsonl"),
                             model_setting)
    found = summarize(rows)
    plot(rows, os.path.join(args.out, "numerics.png"))
    harness.write_outputs(
        "numerics", found,
        ["model", "arm", "vs", "seeds", "eval_loss", "gap", "ci_low", "ci_high", "goal",
         "holds"], args.out, None,
        f"{harness.machine()}; " + "; ".join(
            f"{m}: {_describe(m, *settings[m])}" for m in models)
        + "; eval on the whole held-out split (mlm: 23 batches, masks drawn with the seed); "
        "gap: eval loss over the `vs` arm's with the same seed, minus 1, mean over seeds; ci: "
        "its 95% Student-t interval; a goal holds when ci_high <= goal.")
    return found
