"""Where the bytes of a step go: XLA's byte count, instruction by instruction.

    python -m train.bench_layout [--rounds 100] [--tiny]

Compiles the encoder step of ``python -m train.bench overhead`` three ways: the bare bf16 step,
jaxamp's ``mixed_bfloat16`` step as shipped (gradients pinned to row-major on XLA:CPU), and the
same step without the pin. It prints

- the bytes accessed by kind of instruction (fusions named by XLA's fusion kind), for each step,
  and the difference to the bare step; the per-instruction count (operands plus result, of every
  instruction the entry computation and its conditional branches run) reproduces
  ``cost_analysis()["bytes accessed"]`` to within 0.1% (XLA counts a few fusion operands by the
  part they read), which the script checks;
- the three steps timed interleaved, as the median of per-round ratios to the bare step.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

import jaxamp.master
from train import bench

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
    comps, entry = bench.hlo_computations(compiled.as_text())
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints both tables; returns each step's bytes accessed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tiny", action="store_true", help="a tiny encoder (for the tests)")
    args = parser.parse_args(argv)
    cfg, batch_size = bench.encoder_config(args.tiny)
    pinned_backends = jaxamp.master._PIN_LAYOUT_BACKENDS
    variants, batch = bench.overhead_variants(cfg, batch_size)
    compiled, states = bench.compile_variants(
        {"bare_bf16": variants["bare_bf16"], "jaxamp pinned": variants["jaxamp_mixed_bf16"]}, batch)
    try:
        jaxamp.master._PIN_LAYOUT_BACKENDS = frozenset()
        variants, _ = bench.overhead_variants(cfg, batch_size)
        more = bench.compile_variants({"jaxamp not pinned": variants["jaxamp_mixed_bf16"]}, batch)
    finally:
        jaxamp.master._PIN_LAYOUT_BACKENDS = pinned_backends
    compiled.update(more[0])
    states.update(more[1])

    names = list(compiled)
    total = {n: bench.cost(c)["bytes"] for n, c in compiled.items()}
    counts = {n: bytes_by_instruction(c) for n, c in compiled.items()}
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
    rows = [{"instruction kind": kind,
             **{f"{n} MB": f"{counts_total[n].get(kind, 0) / 1e6:.1f}" for n in names},
             **{f"{n} − bare MB": f"{(counts_total[n].get(kind, 0) - base.get(kind, 0)) / 1e6:+.1f}"
                for n in names[1:]}} for kind in kinds]
    print(f"{bench.machine()}; encoder {cfg}, batch {batch_size}\n")
    print(bench.markdown(rows, list(rows[0])) + "\n")

    times = bench.time_rounds({n: bench.stepper(compiled, states, n, batch) for n in names},
                              args.rounds)
    rows = []
    for n in names:
        ratio, q25, q75 = bench.paired_ratio(times, n, "bare_bf16")
        rows.append({"variant": n, "median ms": f"{1e3 * statistics.median(times[n]):.1f}",
                     "time / bare bf16": f"{ratio:.3f}", "quartiles": f"{q25:.3f}–{q75:.3f}",
                     "GB accessed": f"{total[n] / 1e9:.3f}",
                     "bytes / bare bf16": f"{total[n] / total['bare_bf16']:.4f}"})
    print(f"{args.rounds} interleaved rounds\n")
    print(bench.markdown(rows, list(rows[0])))
    return total


if __name__ == "__main__":
    main()
