"""``python -m benchmarks <suite> [options]``: runs one suite, or ``all`` of them in turn."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
from types import ModuleType
from typing import Any

import benchmarks

# Suite name -> module of this package. A suite's module (and with it its peers: jmp, equinox,
# torch) is imported only when that suite runs or its own --help is asked for, so that a
# machine without a peer runs every other suite: the GPU machine has no jmp.
SUITES = {"overhead": "overhead", "memory": "memory", "torch": "torch_amp",
          "cpu_flags": "cpu_flags", "gpu": "gpu", "layout": "layout", "cpu_dtypes": "cpu_dtypes",
          "long_fp16": "long_fp16", "autocast": "autocast", "autocast_step": "autocast_step",
          "zero": "zero", "step_memory": "step_memory", "master_numerics": "master_numerics",
          "fp8": "fp8", "remat": "remat", "compile_time": "compile_time",
          "numerics": "numerics", "moments": "moments", "conformance": "conformance",
          "maxtext": "maxtext"}
_COMMON = ("tiny", "rounds", "out", "xla_flags")
_HERE = os.path.dirname(os.path.abspath(__file__))


def suite_module(name: str) -> ModuleType:
    """The module of suite ``name``, imported now."""
    return importlib.import_module(f"benchmarks.{SUITES[name]}")


def suite_doc(name: str) -> str:
    """Suite ``name``'s module docstring, read from its source without importing it."""
    with open(os.path.join(_HERE, f"{SUITES[name]}.py")) as f:
        return ast.get_docstring(ast.parse(f.read()), clean=False) or ""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds (default: the suite's, 30 or 100; 2 with "
                             "--tiny; 0: cost analysis only, for overhead and layout)")
    parser.add_argument("--out", default="runs/bench", help="folder for JSON lines and charts")
    parser.add_argument("--xla-flags", default=None,
                        help="extra XLA_FLAGS for this run (set before the backend starts)")


def _parsers(loaded: tuple[str, ...]) -> tuple[argparse.ArgumentParser,
                                               dict[str, argparse.ArgumentParser]]:
    """The parser; the suites in ``loaded`` are imported for their own arguments."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description=benchmarks.__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="suite", required=True, metavar="suite")
    suites = {}
    for name in SUITES:
        doc = suite_doc(name)
        summary = " ".join(doc.split("\n\n")[0].split()).split(": ", 1)[-1].split(". ")[0]
        suites[name] = p = sub.add_parser(name, help=summary.replace("%", "%%"), description=doc,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p)
        if name in loaded:
            module = suite_module(name)
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
    module = suite_module(name)
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
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0] if argv else None
    loaded = tuple(SUITES) if first == "all" else (first,) if first in SUITES else ()
    ap, suites = _parsers(loaded)
    args = ap.parse_args(argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    per_suite = {name: _suite_args(ap, suites, name, args) for name in names}
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    return {name: _runner(name, per_suite[name]).run(per_suite[name]) for name in names}


def _runner(name: str, args: argparse.Namespace) -> ModuleType:
    """The module that runs suite ``name`` with ``args``: ``gpu --deviceless`` compiles for a
    GPU on this machine (``gpu_deviceless``, which builds on ``gpu``'s models)."""
    if name == "gpu" and getattr(args, "deviceless", None):
        return importlib.import_module("benchmarks.gpu_deviceless")
    return suite_module(name)


if __name__ == "__main__":
    main(sys.argv[1:])
