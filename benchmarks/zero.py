"""Suite ``zero``: data parallelism under ``jit`` on 8 devices, the state replicated or sharded.

    python -m benchmarks zero [--rounds 20] [--tiny]

Three tables:

- **state**: per-device bytes per param of BERT-Large's training state (``mixed_bfloat16``
  working params, fp32 master, adamw's two moments) on an 8-device mesh, from abstract shapes
  (nothing runs): replicated, ZeRO-1/2 (``jaxamp.parallel.state_sharding(params="replicated")``) and
  ZeRO-3 (``params="sharded"``);
- **collectives**: for the encoder of the overhead suite under ``mixed_bfloat16``, the
  collectives of each layout by kind and dtype, in the step's jaxpr (the dtype the program
  asks for) and in the compiled HLO (what XLA runs: XLA:CPU computes bf16 collectives in fp32,
  so only the jaxpr tells bf16 from fp32 there; a GPU's HLO keeps bf16);
- **time**: the steps timed interleaved, as ratios to the replicated state with the fp32
  reduction (the CPU's collectives between virtual devices are memory copies on 2 cores, so
  the figure says little about a GPU's).

The layouts: ``implicit`` (``data_axis=None``: XLA inserts the reduction, in bf16),
``replicated`` (fp32 ``pmean``), ``zero1`` and ``zero3``, on an ``Explicit`` mesh
(``jax.make_mesh``'s default), and ``zero1_auto`` on an ``Auto`` one, whose shardings the step
cannot read (fp32 all-reduce, then XLA slices). With fewer than 8 devices, the suite runs
itself again with 8 virtual CPU devices.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

import jaxamp
from benchmarks import harness
from benchmarks import overhead
from jaxamp._jaxpr import walk
from jaxamp._step import _parallel

ROUNDS = 20
N_DEVICES = 8
LAYOUTS = ("implicit", "replicated", "zero1", "zero3", "zero1_auto")
_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                "collective-permute")
_JAXPR_COLLECTIVES = ("psum", "psum_invariant", "reduce_scatter", "psum_scatter", "all_gather",
                      "all_to_all", "ppermute")
_INSTRUCTION = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32|f64|s64|u64)\[([0-9,]*)\]")
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
         "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


# --------------------------------------------------------------------------------------------
# The state's bytes per param, from abstract shapes
# --------------------------------------------------------------------------------------------

def _abstract_state(model: str, overrides: dict) -> tuple[Any, int]:
    """``(abstract TrainState, number of params)`` of a reference model under mixed_bfloat16."""
    from train import models
    params = jax.eval_shape(lambda: models.split(models.build(model, "float32",
                                                              **overrides))[1])
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
    return state, sum(x.size for x in jax.tree.leaves(params))


def _min_size(tiny: bool) -> int:
    """``state_sharding``'s threshold: its default, or small enough to split the tiny models."""
    return 64 if tiny else _parallel.MIN_SHARD_SIZE


def state_rows(tiny: bool) -> list[dict]:
    model, overrides = ("bert_tiny", dict(depth=1, width=64)) if tiny else ("bert_large", {})
    state, n_params = _abstract_state(model, overrides)
    mesh = jax.make_mesh((N_DEVICES,), ("batch",))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
    zero = functools.partial(jaxamp.parallel.state_sharding, state, mesh, min_size=_min_size(tiny))
    rows = []
    for layout, sh in (("replicated", replicated), ("zero1", zero()),
                       ("zero3", zero(params="sharded"))):
        per_device = jaxamp.parallel.per_device_bytes(state, sh)
        parts = {name: jaxamp.parallel.per_device_bytes(getattr(state, name), getattr(sh, name))
                 for name in ("params", "opt_state")}
        rows.append({"model": model, "params_m": n_params / 1e6, "layout": layout,
                     "bytes_per_param": per_device / n_params,
                     "working_params": parts["params"] / n_params,
                     "master_and_moments": parts["opt_state"] / n_params,
                     "gb_per_device_7b": per_device / n_params * 7e9 / 1e9,
                     "vs_replicated": None})
    for r in rows:
        r["vs_replicated"] = r["bytes_per_param"] / rows[0]["bytes_per_param"]
    return rows


# --------------------------------------------------------------------------------------------
# The steps of each layout on the encoder
# --------------------------------------------------------------------------------------------

def _mesh(kind: AxisType):
    return jax.make_mesh((N_DEVICES,), ("batch",), axis_types=(kind,))


def layout_step(task: overhead.EncoderTask, layout: str, min_size: int):
    """``(jitted step -> (state, loss), fresh state, placed batch)`` of ``layout``."""
    mesh = _mesh(AxisType.Auto if layout in ("implicit", "zero1_auto") else AxisType.Explicit)
    tx = jaxamp.mixed_precision(task.tx, "mixed_bfloat16")
    template = jaxamp.TrainState.create(params=task.params, tx=tx)
    if layout in ("implicit", "replicated"):
        sh = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), template)
    else:
        sh = jaxamp.parallel.state_sharding(template, mesh, min_size=min_size,
                                   params="sharded" if layout == "zero3" else "replicated")
    amp_step = jaxamp.make_train_step(task.loss,
                                      data_axis=None if layout == "implicit" else "auto")

    def step(state, batch):
        state, metrics = amp_step(state, batch)
        return state, metrics["loss"]

    batch_sh = jaxamp.parallel.batch_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(sh, batch_sh),
                     out_shardings=(sh, NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=0)

    create = jax.jit(lambda p: jaxamp.TrainState.create(params=p, tx=tx), out_shardings=sh)
    return jitted, amp_step, functools.partial(create, task.params), jaxamp.parallel.put_sharded(
        task.batch, batch_sh)


def hlo_collectives(text: str) -> dict[tuple[str, str], list[int]]:
    """``{(kind, dtype): [count, bytes]}`` of the collectives in an optimized HLO module."""
    out: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in text.splitlines():
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            entry = out[(m.group(2), dtype)]
            entry[0] += 1
            entry[1] += n * _ITEM[dtype]
    return dict(out)


def jaxpr_collectives(fn, *args) -> dict[tuple[str, str], list[int]]:
    """``{(primitive, dtype): [count, operand bytes]}`` of the collectives in ``fn``'s jaxpr."""
    out: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for eqn, _ in walk(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name not in _JAXPR_COLLECTIVES:
            continue
        for v in eqn.invars:
            aval = v.aval
            entry = out[(eqn.primitive.name, jnp.dtype(aval.dtype).name)]
            entry[0] += 1
            entry[1] += int(aval.size) * jnp.dtype(aval.dtype).itemsize
    return dict(out)


def _summary(found: dict[tuple[str, str], list[int]]) -> str:
    return "; ".join(f"{kind} {dtype} x{count} ({nbytes / 1e6:.2f} MB)"
                     for (kind, dtype), (count, nbytes) in sorted(found.items()))


def collective_and_time_rows(tiny: bool, rounds: int) -> list[dict]:
    cfg, batch_size = overhead.encoder_config(tiny)
    batch_size = max(batch_size, N_DEVICES)
    task = overhead.encoder_task(cfg, batch_size)
    compiled, states, batches, rows = {}, {}, {}, []
    for layout in LAYOUTS:
        jitted, amp_step, fresh, batch = layout_step(task, layout, _min_size(tiny))
        state = fresh()
        compiled[layout] = jitted.lower(state, batch).compile(harness.tiny_compiler_options(tiny))
        states[layout], batches[layout] = fresh(), batch
        hlo = hlo_collectives(compiled[layout].as_text())
        jaxpr = jaxpr_collectives(amp_step, state, batch)
        rows.append({"layout": layout, "jaxpr_collectives": _summary(jaxpr),
                     "hlo_collectives": _summary(hlo),
                     "state_mb_per_device": jaxamp.parallel.per_device_bytes(state) / 1e6})
    if rounds:
        runners = {k: functools.partial(_run, compiled, states, k, batches[k]) for k in LAYOUTS}
        times = harness.time_rounds(runners, rounds)
        for r in rows:
            ratio, q25, q75 = harness.paired_ratio(times, r["layout"], "replicated")
            r.update({"median_ms": 1e3 * statistics.median(times[r["layout"]]),
                      "time_vs_replicated": ratio, "iqr": f"{q25:.3f}–{q75:.3f}"})
    return rows


def _run(compiled, states, name, batch):
    states[name], loss = compiled[name](states[name], batch)
    jax.block_until_ready((states[name], loss))


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------

def _rerun_with_devices(args) -> list[dict]:
    """The suite in a fresh process with 8 virtual CPU devices (this one has fewer)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} " \
            f"--xla_force_host_platform_device_count={N_DEVICES}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "benchmarks", "zero", "--out", args.out,
            "--rounds", str(args.rounds)] + (["--tiny"] if args.tiny else [])
    subprocess.run(argv, env=env, check=True)
    with open(os.path.join(args.out, "zero.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(args) -> list[dict]:
    if jax.device_count() < N_DEVICES:
        return _rerun_with_devices(args)
    state = state_rows(args.tiny)
    steps = collective_and_time_rows(args.tiny, args.rounds)
    cfg, batch_size = overhead.encoder_config(args.tiny)
    header = (f"{harness.machine()}. State: abstract shapes, per-device bytes on a mesh of "
              f"{N_DEVICES}; 7B: the same bytes per param for 7e9 params.")
    harness.write_outputs("zero", state, ["model", "params_m", "layout", "bytes_per_param",
                                          "working_params", "master_and_moments",
                                          "gb_per_device_7b", "vs_replicated"],
                          args.out, None, header)
    timing = (f"{args.rounds} interleaved rounds, ratios are the median and quartiles of the "
              "per-round ratios" if args.rounds else "not timed")
    header = (f"{harness.machine()}; encoder {cfg}, batch {max(batch_size, N_DEVICES)} over "
              f"{N_DEVICES} devices, mixed_bfloat16, adamw, donated state; {timing}")
    rows = [{"table": "state", **r} for r in state] + [{"table": "steps", **r} for r in steps]
    print(f"## zero: the steps\n\n{header}\n\n" + harness.markdown(
        steps, ["layout", "median_ms", "time_vs_replicated", "iqr", "state_mb_per_device",
                "jaxpr_collectives", "hlo_collectives"]) + "\n", flush=True)
    with open(os.path.join(args.out, "zero.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({"suite": "zero", **r}) + "\n")
    return rows
