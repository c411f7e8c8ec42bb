"""Suite ``fp8``: FP8 training against bf16 on real data, the FP8 share of the matmuls, and what
FP8 adds to the step.

    python -m benchmarks fp8 [--tables parity,cost,errors] [--seeds 3] [--first-seed 0]
                             [--steps 1500] [--errors-every 250]
                             [--error-granularities tensor,rowwise,...] [--tiny]

Four tables:

- **parity**: the CLI's ``text`` preset (the 2 x 64 character GPT on Python's ``pydoc_data``,
  32 x 64 bytes a step) under ``mixed_bfloat16`` and ``mixed_fp8`` with every matmul in FP8
  (the head's and the attention's too, ``--fp8-every-matmul``): the ``current`` recipe
  (``jaxamp.autocast``) and the ``delayed`` one (``jaxamp.fp8`` layers, amax history 16);
  per seed and the mean, the eval loss and its change against bf16 with the same seed. The
  default recipe and the finer ones are the ``numerics`` suite's.
- **share**: ``jaxamp.audit_grad`` of the same model's loss: the share of matmul FLOPs in FP8.
- **cost**: the compiled train step (adamw, state donated) of each precision, from XLA's
  ``cost_analysis()`` (FLOPs and bytes accessed) and the saved activations of its gradient,
  against ``mixed_bfloat16``. XLA:CPU has no FP8 matmul unit: it converts the 8-bit operands
  and multiplies in fp32, so these are the program's bytes, not a GPU's.
- **errors**: which FP8 matmul loses what, along training. The same model under the default
  ``mixed_fp8`` recipe (the embeddings, the head and the attention's batched matmuls in bf16)
  trains for ``--steps`` (seed 0); every ``--errors-every`` steps, ``jaxamp.fp8.error_report``
  of the loss on the first held-out batch, from the fp32 master params: per matmul, the
  relative error of its forward, input-gradient and weight-gradient GEMMs against the same
  matmul in fp32. ``fp8_errors.png`` plots each matmul's three errors against the step.
  ``--error-granularities`` asks the same of other scalings at each report, on the same params
  (the ones the default recipe trained): ``tensor`` (the default's), ``rowwise``, ``blocks``,
  ``mxfp8`` (``jaxamp.fp8.CurrentScaling(granularity=...)``, the default's bf16 layers kept).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile

import jax

import jaxamp
from benchmarks import harness

ROUNDS = None  # nothing is timed
VARIANTS = (("bf16", "mixed_bfloat16", "current"), ("fp8_current", "mixed_fp8", "current"),
            ("fp8_delayed", "mixed_fp8", "delayed"))


def add_arguments(parser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--steps", type=int, default=1500, help="steps per run (default 1500)")
    parser.add_argument("--tables", default=",".join(TABLES),
                        help=f"comma-separated, of {', '.join(TABLES)} (default: all)")
    parser.add_argument("--errors-every", type=int, default=250,
                        help="steps between two error reports (default 250)")
    parser.add_argument("--error-granularities", default="tensor",
                        help="comma-separated scalings the error reports compare, of "
                             "tensor,rowwise,blocks,mxfp8 (default: tensor, the default "
                             "recipe's)")


TABLES = ("parity", "cost", "errors")


TINY = dict(model_overrides={"gpt": {"depth": 1, "width": 32, "mlp": 64}}, batch_size=4,
            seq_len=16, eval_batches=2)


def _config(precision: str, recipe: str, tiny: bool = False, **kw):
    from train.configs import get_config
    every_matmul = {"fp8_keep_bf16": False} if (precision, recipe) == ("mixed_fp8",
                                                                        "current") else {}
    return get_config("text", precision=precision, fp8_recipe=recipe, progress=False,
                      checkpoint_every=10**9, **(TINY if tiny else {}), **every_matmul, **kw)


def _parity(steps: int, seeds: range, tiny: bool) -> list[dict]:
    from train import train as train_lib
    rows, losses = [], {}
    for seed in seeds:
        base = None
        for name, precision, recipe in VARIANTS:
            with tempfile.TemporaryDirectory() as workdir:
                summary = train_lib.train_and_evaluate(
                    _config(precision, recipe, tiny, steps=steps, seed=seed),
                    os.path.join(workdir, "run"))
            loss = summary["eval_loss"]
            base = loss if base is None else base
            losses.setdefault(name, []).append(loss)
            rows.append({"seed": seed, "precision": name, "eval_loss": loss,
                         "vs_bf16": loss / base - 1, "skipped_steps": summary["skipped_steps"]})
            print(rows[-1], flush=True)
    base = statistics.mean(losses["bf16"])
    for name, values in losses.items():
        rows.append({"seed": "mean", "precision": name, "eval_loss": statistics.mean(values),
                     "vs_bf16": statistics.mean(values) / base - 1, "skipped_steps": None})
    return rows


def _built(precision: str, recipe: str, tiny: bool):
    """``(state, loss(params, batch, model_state) -> loss, step, batch)`` of the text preset's
    model, without data files (a random batch of its shape)."""
    from train import train as train_lib
    config = _config(precision, recipe, tiny, steps=10)
    policy = train_lib.policy_of(config)
    params, model_state, loss_fn, _, flags = train_lib.build_model(config, policy,
                                                                    {"vocab": 256})
    state = train_lib.create_train_state(config, policy, params, model_state)
    autocast = train_lib.uses_autocast(config, policy)
    step = jaxamp.make_train_step(loss_fn, autocast=autocast, **flags)
    tokens = jax.random.randint(jax.random.key(0), (config.batch_size, config.seq_len + 1), 0,
                                256)
    batch = {"tokens": tokens}
    run = jaxamp.autocast(loss_fn, policy) if autocast else loss_fn

    def loss(params, batch, model_state):
        out = run(params, policy.cast_to_compute(batch),
                  **({"model_state": model_state} if flags.get("has_model_state") else {}))
        return out[0]
    return state, loss, step, batch


def _share_and_cost(tiny: bool) -> list[dict]:
    rows, base = [], None
    for name, precision, recipe in VARIANTS:
        state, loss, step, batch = _built(precision, recipe, tiny)
        report = jaxamp.audit_grad(loss, state.params, batch, state.model_state)
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        c = harness.cost(compiled)
        row = {"precision": name, "fp8_share": report.fp8_matmul_share,
               "matmul_gflop": report.total_matmul_flops / 1e9,
               "saved_mb": report.saved_bytes / 1e6,
               "saved_by_dtype": {k: v for k, v in sorted(report.saved_bytes_by_dtype.items())},
               "state_mb": harness.tree_bytes(state) / 1e6,
               "xla_gbytes": c["bytes"] / 1e9, "xla_gflop": c["flops"] / 1e9}
        base = base or row
        row.update(bytes_vs_bf16=row["xla_gbytes"] / base["xla_gbytes"],
                   saved_vs_bf16=row["saved_mb"] / base["saved_mb"],
                   state_vs_bf16=row["state_mb"] / base["state_mb"])
        rows.append(row)
        print(row, flush=True)
    return rows


def _errors(steps: int, every: int, tiny: bool,
            granularities: tuple[str, ...] = ("tensor",)) -> list[dict]:
    from train import train as train_lib
    from train.configs import get_config
    config = get_config("text", precision="mixed_fp8", progress=False, steps=steps, seed=0,
                        **(TINY if tiny else {}))
    policy = train_lib.policy_of(config)
    batches, evals, meta = train_lib.build_data(config)
    params, model_state, loss_fn, _, flags = train_lib.build_model(config, policy, meta)
    state = train_lib.create_train_state(config, policy, params, model_state)
    step = jax.jit(jaxamp.make_train_step(loss_fn, autocast=True, **flags), donate_argnums=0)
    probe = next(iter(evals))
    extra = {"model_state": state.model_state} if flags.get("has_model_state") else {}

    def loss(p, batch):
        return loss_fn(p, batch, **extra)[0]
    default = (policy.fp8 if isinstance(policy.fp8, jaxamp.fp8.CurrentScaling)
               else jaxamp.fp8.CurrentScaling())  # fp8=True: the default recipe
    rows = []
    for i in range(steps + 1):
        if i % every == 0 or i == steps:
            for granularity in granularities:
                recipe = jaxamp.fp8.CurrentScaling(granularity=granularity, keep=default.keep,
                                                   batched=default.batched)
                report = jaxamp.fp8.error_report(loss, state.master_params, probe,
                                                 policy=dataclasses.replace(policy, fp8=recipe))
                for m in report.matmuls:
                    rows.append({"step": i, "granularity": granularity, "matmul": m.site,
                                 "shapes": m.shapes, "forward": m.forward,
                                 "grad_lhs": m.grad_lhs, "grad_rhs": m.grad_rhs})
                print(f"[fp8 errors] step {i}, {granularity}\n{report}", flush=True)
        if i < steps:
            state, _ = step(state, next(batches))
    return rows


def _plot_errors(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxamp._fp8._errors import GEMMS
    fig, axes = plt.subplots(1, len(GEMMS), figsize=(14, 4.2), sharey=True)
    for ax, gemm in zip(axes, GEMMS, strict=True):
        for site in dict.fromkeys(r["matmul"] for r in rows):
            mine = [r for r in rows if r["matmul"] == site]
            ax.plot([r["step"] for r in mine], [100 * r[gemm] for r in mine], marker="o",
                    ms=3, lw=1.1, label=site.removeprefix("args[0]/"))
        ax.set(title=f"{gemm}: FP8 against fp32", xlabel="step", ylabel="relative error, %")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    tiny = args.tiny
    tables = [t for t in getattr(args, "tables", ",".join(TABLES)).split(",") if t]
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(TABLES)}")
    out: dict = {}
    if "parity" in tables:
        out["parity"] = _parity_table(args, tiny)
    if "cost" in tables:
        out["cost"] = _cost_table(args, tiny)
    if "errors" in tables:
        steps = 4 if tiny else args.steps
        granularities = tuple(g for g in getattr(args, "error_granularities", "tensor")
                              .split(",") if g)
        unknown = sorted(set(granularities) - set(jaxamp.fp8.CurrentScaling.GRANULARITIES))
        if unknown:
            raise ValueError(f"unknown granularity {', '.join(unknown)}; expected some of "
                             f"{', '.join(jaxamp.fp8.CurrentScaling.GRANULARITIES)}")
        errors = _errors(steps, 2 if tiny else args.errors_every, tiny, granularities)
        harness.write_outputs(
            "fp8_errors", errors, ["step", "granularity", "matmul", "shapes", "forward",
                                   "grad_lhs", "grad_rhs"], args.out, None,
            f"{harness.machine()}; the text preset (char GPT) under mixed_fp8's default recipe, "
            f"seed 0, {steps} steps; jaxamp.fp8.error_report on the first held-out batch: each "
            "GEMM's mean relative error over its rows against fp32.")
        _plot_errors([r for r in errors if r["granularity"] == granularities[0]],
                     os.path.join(args.out, "fp8_errors.png"))
        out["errors"] = errors
    return out


def _parity_table(args, tiny: bool) -> list[dict]:
    first = getattr(args, "first_seed", 0)
    parity = _parity(4 if tiny else args.steps,
                     range(1) if tiny else range(first, first + args.seeds), tiny)
    harness.write_outputs(
        "fp8_parity", parity, ["seed", "precision", "eval_loss", "vs_bf16", "skipped_steps"],
        args.out, None,
        f"{harness.machine()}; the text preset (char GPT), adamw with warmup and cosine decay; "
        "vs_bf16 is the relative change of the eval loss against mixed_bfloat16, same seed.")
    return parity


def _cost_table(args, tiny: bool) -> list[dict]:
    cost = _share_and_cost(tiny)
    harness.write_outputs(
        "fp8_cost", cost, ["precision", "fp8_share", "matmul_gflop", "saved_mb",
                           "saved_vs_bf16", "state_mb", "xla_gbytes", "bytes_vs_bf16",
                           "xla_gflop"], args.out, None,
        f"{harness.machine()}; one train step of the text preset's model "
        f"({'tiny' if tiny else '32 x 64 tokens'}): FP8 share by jaxamp.audit_grad; bytes "
        "and FLOPs by XLA:CPU's cost_analysis().")
    return cost
