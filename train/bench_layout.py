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


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY ")) and line.rstrip().endswith("{"):
            name = (line.split()[1] if line.startswith("ENTRY ") else line.split()[0]).lstrip("%")
            entry = name if line.startswith("ENTRY ") else entry
            current = comps[name] = []
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            current.append(line.strip())
    return comps, entry


def bytes_by_instruction(compiled) -> collections.Counter:
    """Bytes accessed by each kind of instruction of a compiled step (``kind -> bytes``).

    A kind is the instruction's name without its number (``multiply_add_fusion``,
    ``wrapped_convert``, ``copy``). Conditionals count the bytes of their branches.
    """
    comps, entry = _computations(compiled.as_text())
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

    counts = {name: bytes_by_instruction(c) for name, c in compiled.items()}
    for name, c in compiled.items():
        total = bench.cost(c)["bytes"]
        if abs(sum(counts[name].values()) - total) > 1e-3 * total:
            raise SystemExit(f"{name}: the instruction count gives {sum(counts[name].values())} "
                             f"bytes, cost_analysis {total}")
    print(f"{bench.machine()}; encoder {cfg}, batch {batch_size}\n")
    names = list(compiled)
    print("| instruction kind | " + " | ".join(f"{n} MB" for n in names)
          + " | " + " | ".join(f"{n} − bare MB" for n in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    kinds = set().union(*counts.values())
    base = counts["bare_bf16"]
    shown = 1e-3 * sum(base.values())  # kinds that move less than 0.1% are left out
    for kind in sorted(kinds, key=lambda k: -max(abs(counts[n][k] - base[k]) for n in names)):
        if max(abs(counts[n][kind] - base[kind]) for n in names) < shown:
            continue
        print(f"| {kind} | " + " | ".join(f"{counts[n][kind] / 1e6:.1f}" for n in names) + " | "
              + " | ".join(f"{(counts[n][kind] - base[kind]) / 1e6:+.1f}" for n in names[1:])
              + " |")
    print("| **total** | " + " | ".join(f"{sum(counts[n].values()) / 1e6:.1f}" for n in names)
          + " | " + " | ".join(f"{(sum(counts[n].values()) - sum(base.values())) / 1e6:+.1f}"
                               for n in names[1:]) + " |\n")

    times = bench.time_rounds({n: bench.stepper(compiled, states, n, batch) for n in names},
                              args.rounds)
    print(f"{args.rounds} interleaved rounds\n")
    print("| variant | median ms | time / bare bf16 | quartiles | GB accessed "
          "| bytes / bare bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        ratio, q25, q75 = bench.paired_ratio(times, n, "bare_bf16")
        b = bench.cost(compiled[n])["bytes"]
        print(f"| {n} | {1e3 * statistics.median(times[n]):.1f} | {ratio:.3f} | "
              f"{q25:.3f}–{q75:.3f} | {b / 1e9:.3f} | "
              f"{b / bench.cost(compiled['bare_bf16'])['bytes']:.4f} |")
    return {n: bench.cost(c)["bytes"] for n, c in compiled.items()}


if __name__ == "__main__":
    main()
