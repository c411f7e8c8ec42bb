"""Deprecated alias: the benchmark suites moved to the top-level ``benchmarks`` package.

    python -m train.bench overhead   ->   python -m benchmarks overhead

It forwards its arguments to ``python -m benchmarks`` and goes away in the next release.
"""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.__main__ import main as benchmarks_main
    args = sys.argv[1:] if argv is None else argv
    print(f"python -m train.bench is deprecated and goes away in the next release; run "
          f"python -m benchmarks {' '.join(args)}".rstrip(), file=sys.stderr, flush=True)
    return benchmarks_main(args)


if __name__ == "__main__":
    main()
