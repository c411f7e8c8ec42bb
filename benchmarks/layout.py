"""Suite ``layout``: where the bytes of a step go, XLA's byte count instruction by instruction.

    python -m benchmarks layout [--rounds 100] [--tiny]   # --rounds 0: the bytes alone

Compiles one model's step four ways: the bare bf16 step, jaxamp's ``mixed_bfloat16`` step as
built by default, with its gradients pinned to row-major (``pin_grad_layout=True``, what the
default does on XLA:CPU for params on one device), and without the pin
(``pin_grad_layout=False``). ``--model encoder`` (default): the overhead suite's 4 x 256
encoder, batch 16 x 128. ``--model linen``: a param-heavy Flax Linen encoder (2 x 128, a
2048-token vocabulary, ``dtype=bfloat16`` layers, batch 8 x 64), whose bare step casts nothing
itself. It prints

- the bytes accessed by kind of instruction (fusions named by XLA's fusion kind), for each step,
  and the difference to the bare step; the per-instruction count (operands plus result, of every
  instruction the entry computation and its conditional branches run) reproduces
  ``cost_analysis()["bytes accessed"]`` to within 0.1% (XLA counts a few fusion operands by the
  part they read), which the suite checks;
- the three steps timed interleaved, as the median of per-round ratios to the bare step.
"""

from __future__ import annotations

import collections
import re
import statistics

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness
from benchmarks import overhead

ROUNDS = 100
COST_ONLY = True  # --rounds 0 prints the bytes and times nothing
MODELS = ("encoder", "linen")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="encoder", choices=MODELS,
                        help="the overhead suite's encoder (default) or the param-heavy Linen "
                             "encoder")

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([0-9,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEM_BYTES[dtype]
    return total


def bytes_by_instruction(compiled) -> collections.Counter:
    """Bytes accessed by each kind of instruction of a compiled step (``kind -> bytes``).

    A kind is the instruction's name without its number (``multiply_add_fusion``,
    ``wrapped_convert``, ``copy``). Conditionals count the bytes of their branches.
    """
    comps, entry = harness.hlo_computations(compiled.as_text())
    out: collections.Counter = collections.Counter()

    def walk(name: str) -> None:
        result_bytes, lines = {}, comps[name]
        for line in lines:
            lhs, rhs = line.split(" = ", 1)
            shape = rhs[: rhs.index(") ") + 1] if rhs.startswith("(") else rhs.split(" ")[0]
            result_bytes[lhs.replace("ROOT ", "").lstrip("%")] = _shape_bytes(shape)
        for line in lines:
            lhs, rhs = line.split(" = ", 1)
            lhs = lhs.replace("ROOT ", "").lstrip("%")
            op = re.search(r"\s([a-z][\w-]*)\(", rhs).group(1)  # type: ignore[union-attr]
            if op == "conditional":
                for branch in re.findall(r"%([\w.\-]+)", rhs.split("branch_computations=")[-1]
                                         .split("}")[0]):
                    walk(branch)
                continue
            if op in _FREE:
                continue
            args = re.search(re.escape(op) + r"\((.*?)\)(,|$)", rhs)
            operands = re.findall(r"%([\w.\-]+)", args.group(1)) if args else []
            kind = re.sub(r"\.\d+$", "", lhs)
            out[kind] += result_bytes[lhs] + sum(result_bytes.get(o, 0) for o in operands)

    walk(entry)
    return out


def _kinds_table(counts: dict[str, collections.Counter], total: dict[str, float]) -> list[dict]:
    """Rows of bytes by instruction kind, the kinds that move at least 0.1% of the bare step's
    bytes first, largest move first, then the totals."""
    names = list(counts)
    for n in names:
        if abs(sum(counts[n].values()) - total[n]) > 1e-3 * total[n]:
            raise SystemExit(f"{n}: the instruction count gives {sum(counts[n].values())} "
                             f"bytes, cost_analysis {total[n]}")
    counts_total = {n: {**counts[n], "**total**": sum(counts[n].values())} for n in names}
    base = counts_total["bare_bf16"]

    def moved(kind):
        return max(abs(counts_total[n].get(kind, 0) - base.get(kind, 0)) for n in names)
    shown = 1e-3 * total["bare_bf16"]  # kinds that move less than 0.1% are left out
    kinds = sorted((k for k in set().union(*counts.values()) if moved(k) >= shown),
                   key=lambda k: -moved(k)) + ["**total**"]
    return [{"instruction kind": kind,
             **{f"{n} MB": f"{counts_total[n].get(kind, 0) / 1e6:.1f}" for n in names},
             **{f"{n} − bare MB": f"{(counts_total[n].get(kind, 0) - base.get(kind, 0)) / 1e6:+.1f}"
                for n in names[1:]}} for kind in kinds]


def _time_table(compiled, states, batch, total: dict[str, float], rounds: int) -> list[dict]:
    """Rows of each step's time against the bare step's (per-round ratios) and its bytes."""
    names = list(compiled)
    times = harness.time_rounds({n: harness.stepper(compiled, states, n, batch) for n in names},
                                rounds) if rounds else {}
    rows = []
    for n in names:
        row = {"variant": n}
        if times:
            ratio, q25, q75 = harness.paired_ratio(times, n, "bare_bf16")
            row.update({"median ms": f"{1e3 * statistics.median(times[n]):.1f}",
                        "time / bare bf16": f"{ratio:.3f}", "quartiles": f"{q25:.3f}–{q75:.3f}"})
        row.update({"GB accessed": f"{total[n] / 1e9:.3f}",
                    "bytes / bare bf16": f"{total[n] / total['bare_bf16']:.4f}"})
        rows.append(row)
    return rows


def _task(model: str, tiny: bool) -> tuple[overhead.EncoderTask, str]:
    """The model's task (fp32 params, one batch, its loss, adamw) and its description."""
    if model == "encoder":
        cfg, batch_size = overhead.encoder_config(tiny)
        return overhead.encoder_task(cfg, batch_size), f"encoder {cfg}, batch {batch_size}"
    from train.models.linen_encoder import Encoder
    dims = (dict(vocab=64, width=32, depth=1, heads=2, mlp=64) if tiny else
            dict(vocab=2048, width=128, depth=2, heads=4, mlp=512))
    batch, seq_len = (4, 16) if tiny else (8, 64)
    model_ = Encoder(**dims, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, dims["vocab"])

    def loss(p, t):
        logp = jax.nn.log_softmax(model_.apply(p, t).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, t[..., None], -1))
    params = model_.init(jax.random.key(0), tokens[:1])
    return (overhead.EncoderTask(params, tokens, loss, optax.adamw(1e-3)),
            f"Linen encoder {dims}, dtype=bfloat16 layers, batch {batch} x {seq_len}")


def run(args) -> dict[str, float]:
    """Prints both tables; returns each step's bytes accessed."""
    task, described = _task(args.model, args.tiny)
    steps = {
        # The Linen encoder's layers cast the fp32 params to bf16 themselves.
        "bare_bf16": overhead.plain_variant(task, cast=args.model == "encoder"),
        "jaxamp default": overhead.jaxamp_variant(task, "mixed_bfloat16"),
        "jaxamp pinned": overhead.jaxamp_variant(task, "mixed_bfloat16", pin_grad_layout=True),
        "jaxamp not pinned": overhead.jaxamp_variant(task, "mixed_bfloat16",
                                                     pin_grad_layout=False),
    }
    # The fusions XLA:CPU builds by default, whatever XLA_FLAGS says (the test suite turns
    # the fusion emitters off where the XLA has them, to compile faster).
    default_fusions = harness.supported_compiler_options(xla_cpu_use_fusion_emitters=True)
    compiled, states = harness.compile_variants(steps, task.batch, default_fusions or None)
    total = {n: harness.cost(c)["bytes"] for n, c in compiled.items()}
    counts = {n: bytes_by_instruction(c) for n, c in compiled.items()}
    rows = _kinds_table(counts, total)
    print(f"{harness.machine()}; {described}; {jax.device_count()} devices in the process\n")
    print(harness.markdown(rows, list(rows[0])) + "\n")
    rows = _time_table(compiled, states, task.batch, total, args.rounds)
    print(f"{args.rounds} interleaved rounds\n" if args.rounds else "nothing timed (--rounds 0)\n")
    print(harness.markdown(rows, list(rows[0])))
    return total
