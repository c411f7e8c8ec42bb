"""``python -m benchmarks <suite> [options]``: runs one suite, or ``all`` of them in turn."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import benchmarks
from benchmarks import autocast
from benchmarks import autocast_step
from benchmarks import cpu_dtypes
from benchmarks import cpu_flags
from benchmarks import fp8
from benchmarks import gpu
from benchmarks import layout
from benchmarks import long_fp16
from benchmarks import master_numerics
from benchmarks import memory
from benchmarks import overhead
from benchmarks import step_memory
from benchmarks import torch_amp
from benchmarks import zero

SUITES = {"overhead": overhead, "memory": memory, "torch": torch_amp, "cpu_flags": cpu_flags,
          "gpu": gpu, "layout": layout, "cpu_dtypes": cpu_dtypes, "long_fp16": long_fp16,
          "autocast": autocast, "autocast_step": autocast_step, "zero": zero,
          "step_memory": step_memory, "master_numerics": master_numerics, "fp8": fp8}
_COMMON = ("tiny", "rounds", "out", "xla_flags")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds (default: the suite's, 30 or 100; 2 with "
                             "--tiny; 0: cost analysis only, for overhead and layout)")
    parser.add_argument("--out", default="runs/bench", help="folder for JSON lines and charts")
    parser.add_argument("--xla-flags", default=None,
                        help="extra XLA_FLAGS for this run (set before the backend starts)")


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description=benchmarks.__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="suite", required=True, metavar="suite")
    suites = {}
    for name, module in SUITES.items():
        doc = module.__doc__ or ""
        summary = " ".join(doc.split("\n\n")[0].split()).split(": ", 1)[-1].split(". ")[0]
        suites[name] = p = sub.add_parser(name, help=summary, description=doc,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p)
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
    _add_common(sub.add_parser("all", help="every suite in turn (with --tiny: what the tests run)"))
    return ap, suites


def _suite_args(ap, suites, name: str, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for one suite: its own defaults under ``all``, the rounds resolved."""
    ns = suites[name].parse_args([]) if args.suite == "all" else argparse.Namespace(**vars(args))
    for key in _COMMON:
        setattr(ns, key, getattr(args, key))
    ns.suite = name
    ns.via_all = args.suite == "all"
    module = SUITES[name]
    if ns.rounds is None:
        ns.rounds = 2 if ns.tiny else module.ROUNDS
    elif ns.rounds < 0:
        ap.error(f"--rounds {ns.rounds}: expected a count >= 0")
    elif ns.rounds == 0 and module.ROUNDS is not None and not getattr(module, "COST_ONLY", False):
        ap.error(f"--rounds 0 (cost analysis only) applies to the overhead and layout suites, "
                 f"not to {name!r}; give --rounds N with N >= 1, or leave it out")
    return ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the suites; returns each suite's result (its rows, or its figures) by name."""
    ap, suites = _parsers()
    args = ap.parse_args(argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    per_suite = {name: _suite_args(ap, suites, name, args) for name in names}
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    return {name: SUITES[name].run(per_suite[name]) for name in names}


if __name__ == "__main__":
    main(sys.argv[1:])
