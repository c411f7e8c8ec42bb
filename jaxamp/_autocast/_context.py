"""What an autocast function fixes when it is built, and what one call learns as it evaluates
(private)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from jaxamp._autocast._rules import _EVERYTHING_FLOAT32_RULE
from jaxamp._autocast._rules import _FLOAT32_RULE
from jaxamp._autocast._rules import _ORIGINAL_RULE
from jaxamp._autocast._rules import _RULES

if TYPE_CHECKING:
    from jaxamp._autocast._rules import _Rule


_FULL_PRECISION = "jaxamp_full_precision"


@dataclasses.dataclass
class _Call:
    """What one call of the autocast function learns as it evaluates: its own, never shared
    with another call."""

    # id(fp32 value) -> (that value, the half-precision value it was upcast from).
    upcasts: dict = dataclasses.field(default_factory=dict)
    # The name scopes seen, and whether any op fell in ``fp32_scopes`` (shared by the calls of
    # one trace, for the warning about scopes that matched nothing).
    scopes_seen: dict = dataclasses.field(default_factory=dict)
    # recompute=True: id -> value of the arguments and their casts and views. A matmul operand
    # among them is not saved for backward: it is there already, or cheap.
    cheap: dict | None = None
    # recompute=True: id -> (value, depth) of the matmuls' outputs (depth 0) and of the values
    # an elementwise chain of at most ``_NEAR_DEPTH`` ops computes from them (and from cheap
    # values). A matmul operand among them is recomputed in the backward pass from the saved
    # matmul outputs rather than saved beside them: a softmax's probabilities from the
    # scores, a GELU from its matmul's output.
    near: dict | None = None
    # id -> (value, path) of the arguments and their views (casts, reshapes, transposes):
    # which matmul reads which argument (an FP8 policy keeps the head's in the compute dtype).
    arguments: dict = dataclasses.field(default_factory=dict)

    def argument_path(self, x: Any) -> str | None:
        """The path of the argument ``x`` is (or is a view of), or ``None``."""
        entry = self.arguments.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def inherit(self, new: Any, old: Any, source: Any = None) -> None:
        """Records ``new`` (a cast or a new trace's value of ``old``) as what ``old`` is: cheap
        (as ``source`` may be, the value ``old`` was upcast from), or near kept values."""
        path = self.argument_path(old)
        if path is not None:
            self.arguments[id(new)] = (new, path)
        if self.cheap is not None and (id(old) in self.cheap or id(source) in self.cheap):
            self.cheap[id(new)] = new
        elif self.near is not None:
            entry = self.near.get(id(old))
            if entry is not None and entry[0] is old:
                self.near[id(new)] = (new, entry[1])


@dataclasses.dataclass(frozen=True)
class _Context:
    """The rules of an autocast function (fixed when it is built), the level being evaluated
    (inside an fp32 region or not), and the state of the call it serves (:class:`_Call`)."""

    compute: Any
    rules: Mapping[str, str]
    fp32_scopes: tuple[str, ...]
    regions: bool = True
    all_float32: bool = False  # inside an fp32 region
    fp8_recipe: Any = None  # the jaxamp.fp8.CurrentScaling of the "fp8" rule
    # Inside a model's own remat (under recompute=True): its policy (the outermost's, as JAX
    # applies it), which alone decides what is kept there.
    model_remat: Callable[..., Any] | None = None
    # A remat's body (a model's block), whose full-size outputs go on to the caller's ops.
    remat_body: bool = False
    call: _Call = dataclasses.field(default_factory=_Call, compare=False)

    def rule(self, eqn: Any, stack: str) -> _Rule:
        if _FULL_PRECISION in stack:
            return _ORIGINAL_RULE
        if self.all_float32:
            return _FLOAT32_RULE
        if self.fp32_scopes:
            matched = _in_scopes(stack, self.fp32_scopes)
            seen = self.call.scopes_seen
            seen[stack] = seen.get(stack, False) or matched
            if matched:
                return _EVERYTHING_FLOAT32_RULE  # every op, matmuls included
        return _RULES[self.rules.get(eqn.primitive.name, "promote")]


def _in_scopes(stack: str, scopes: tuple[str, ...]) -> bool:
    parts = [p for p in re.split(r"[()/]", stack) if p]
    joined = "/".join(parts)
    return any(s in parts or f"/{s}/" in f"/{joined}/" for s in scopes)
