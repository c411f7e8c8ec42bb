"""Suite ``step_memory``: the whole step's memory (training state + saved activations) for each
``master=`` and ``moments_dtype=`` of ``jaxamp.mixed_precision``, and their step times.

    python -m benchmarks step_memory [--rounds 30] [--tiny]

Two tables:

- **memory** (abstract shapes, nothing runs): ResNet-50 at batch 64 (224 x 224) and BERT-Large
  at 32 x 512, the NNX reference models of ``train/models/``, adamw. Bytes per param of the
  state (working params, master or compensation, moments, the rounding key), the saved
  activations of one step's gradient (``jaxamp.audit_grad``), and their sum against fp32's
  (fp32 params, adamw's moments, fp32 activations).
- **time**: the encoder step of the overhead suite under ``mixed_bfloat16`` with each option,
  jitted with the state donated and timed interleaved, as ratios to ``master="float32"``.

XLA:CPU's ``memory_analysis()`` is not used: XLA:CPU computes in fp32 what a GPU computes in
bf16, so its buffers do not show the bf16 savings.
"""

from __future__ import annotations

import jax
import optax

import jaxamp
from benchmarks import harness
from benchmarks import memory
from benchmarks import overhead
from benchmarks.harness import tree_bytes

ROUNDS = 30
COST_ONLY = True  # --rounds 0: the memory table alone, nothing timed
# (master, moments_dtype): the options of jaxamp.mixed_precision, all under mixed_bfloat16.
BF16_MU = {"mu": "bfloat16"}  # adamw's first moment in bf16, the second in fp32
OPTIONS = (("float32", None), ("float32", "bfloat16"), ("kahan", None), ("kahan", BF16_MU),
           ("kahan", "bfloat16"), ("kahan", "8bit"), ("stochastic", None),
           ("stochastic", "bfloat16"), ("none", None), ("none", "bfloat16"))
TIMED = (("float32", None), ("kahan", None), ("stochastic", None), ("none", None),
         ("kahan", BF16_MU), ("kahan", "bfloat16"), ("kahan", "8bit"),
         ("stochastic", "bfloat16"))
SUFFIXES = {None: "", "bfloat16": "+bf16_moments", "8bit": "+8bit_moments"}


def _name(master: str, moments_dtype: str | dict | None) -> str:
    if isinstance(moments_dtype, dict):
        return master + "".join(f"+bf16_{field}" for field in moments_dtype)
    return master + SUFFIXES[moments_dtype]


def _cases(tiny: bool) -> dict[str, dict]:
    if tiny:
        return {"ResNet (tiny)": dict(kind="image", model="resnet50_small",
                                      kw=dict(stage_sizes=(1, 1), width=8), shape=(2, 32, 32, 3)),
                "BERT (tiny)": dict(kind="text", model="bert_tiny", kw=dict(depth=1, width=32),
                                    shape=(2, 16))}
    return {"ResNet-50, batch 64 (224x224)": dict(kind="image", model="resnet50", kw={},
                                                 shape=(64, 224, 224, 3)),
            "BERT-Large, 32 x 512": dict(kind="text", model="bert_large", kw={},
                                         shape=(32, 512))}


def _model(case: dict, policy: str):
    """``(abstract params, loss(params, batch), batch)`` of a reference model."""
    params, loss, batch = memory.reference_loss(case["model"], case["kw"], case["kind"],
                                                case["shape"], policy)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), loss, batch


def _saved_bytes(case: dict, policy: str) -> int:
    params, loss, batch = _model(case, policy)
    working = jax.eval_shape(jaxamp.get_policy(policy).cast_params_to_compute, params)
    return jaxamp.audit_grad(loss, working, batch).saved_bytes


def _state_bytes(params, policy: str, master: str = "float32",
                 moments_dtype: str | dict | None = None) -> int:
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy, master=master,
                                moments_dtype=moments_dtype)
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    return tree_bytes(state.params) + tree_bytes(state.opt_state)


def memory_rows(tiny: bool) -> list[dict]:
    rows = []
    for label, case in _cases(tiny).items():
        params = _model(case, "float32")[0]
        n = sum(x.size for x in jax.tree.leaves(params))
        saved32, saved16 = _saved_bytes(case, "float32"), _saved_bytes(case, "mixed_bfloat16")
        total32 = _state_bytes(params, "float32") + saved32
        rows.append({"model": label, "option": "fp32 (float32 policy)",
                     "state_bytes_per_param": _state_bytes(params, "float32") / n,
                     "state_gb": _state_bytes(params, "float32") / 1e9,
                     "activations_gb": saved32 / 1e9, "total_gb": total32 / 1e9,
                     "total_vs_fp32": 1.0})
        for master, moments in OPTIONS:
            state = _state_bytes(params, "mixed_bfloat16", master, moments)
            rows.append({"model": label, "option": _name(master, moments),
                         "state_bytes_per_param": state / n, "state_gb": state / 1e9,
                         "activations_gb": saved16 / 1e9, "total_gb": (state + saved16) / 1e9,
                         "total_vs_fp32": (state + saved16) / total32})
    return rows


def time_rows(tiny: bool, rounds: int) -> list[dict]:
    cfg, batch_size = overhead.encoder_config(tiny)
    task = overhead.encoder_task(cfg, batch_size)
    variants = {_name(m, d): overhead.jaxamp_variant(task, "mixed_bfloat16", master=m,
                                                     moments_dtype=d) for m, d in TIMED}
    compiled, states = harness.compile_variants(
        variants, task.batch, harness.tiny_compiler_options(tiny))
    runners = {name: harness.stepper(compiled, states, name, task.batch) for name in variants}
    times = harness.time_rounds(runners, rounds)
    ref = _name("float32", None)
    rows = []
    for name in variants:
        ratio, q25, q75 = harness.paired_ratio(times, name, ref)
        cost = harness.cost(compiled[name])
        rows.append({"option": name, "step_ms": 1e3 * sorted(times[name])[len(times[name]) // 2],
                     "vs_float32": ratio, "q25": q25, "q75": q75,
                     "bytes_vs_float32": cost["bytes"] / harness.cost(compiled[ref])["bytes"]})
    return rows


def run(args) -> list[dict]:
    rounds = ROUNDS if args.rounds is None else args.rounds
    memory = memory_rows(args.tiny)
    header = (f"{harness.machine()}; abstract shapes, nothing runs. State = working params + "
              "master or compensation + adamw's moments (+ the 8-byte rounding key); "
              "activations = the saved residuals of one step's gradient; fp32 = the float32 "
              "policy (params + moments, fp32 activations).")
    harness.write_outputs("step_memory", memory,
                          ["model", "option", "state_bytes_per_param", "state_gb",
                           "activations_gb", "total_gb", "total_vs_fp32"], args.out,
                          None, header)
    timed = time_rows(args.tiny, rounds) if rounds else []
    if timed:
        harness.write_outputs(
            "step_memory_time", timed,
            ["option", "step_ms", "vs_float32", "q25", "q75", "bytes_vs_float32"], args.out,
            None, f"{harness.machine()}; the overhead suite's encoder under mixed_bfloat16, "
                  f"adamw, {rounds} interleaved rounds; ratios are per round, median "
                  "(quartiles).")
    return memory + timed


