"""Suite ``fp8``: FP8 training against bf16 on real data, the FP8 share of the matmuls, and what
FP8 adds to the step.

    python -m benchmarks fp8 [--seeds 3] [--first-seed 0] [--steps 1500] [--tiny]

Three tables:

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
"""

from __future__ import annotations

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


def run(args) -> dict:
    tiny = args.tiny
    first = getattr(args, "first_seed", 0)
    parity = _parity(4 if tiny else args.steps,
                     range(1) if tiny else range(first, first + args.seeds), tiny)
    harness.write_outputs(
        "fp8_parity", parity, ["seed", "precision", "eval_loss", "vs_bf16", "skipped_steps"],
        args.out, None,
        f"{harness.machine()}; the text preset (char GPT), adamw with warmup and cosine decay; "
        "vs_bf16 is the relative change of the eval loss against mixed_bfloat16, same seed.")
    cost = _share_and_cost(tiny)
    harness.write_outputs(
        "fp8_cost", cost, ["precision", "fp8_share", "matmul_gflop", "saved_mb",
                           "saved_vs_bf16", "state_mb", "xla_gbytes", "bytes_vs_bf16",
                           "xla_gflop"], args.out, None,
        f"{harness.machine()}; one train step of the text preset's model "
        f"({'tiny' if tiny else '32 x 64 tokens'}): FP8 share by jaxamp.audit_grad; bytes "
        "and FLOPs by XLA:CPU's cost_analysis().")
    return {"parity": parity, "cost": cost}
