"""What an autocast function fixes when it is built, and what one call learns as it evaluates
(private)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from jaxamp._tree import is_floating_array

_FULL_PRECISION = "jaxamp_full_precision"


# A matmul operand at most this many elementwise ops from kept values is recomputed.
_NEAR_DEPTH = 16


@dataclasses.dataclass(slots=True)
class _Fact:
    """What autocast knows of one value it traced."""

    value: Any  # held, so that no other value takes its id while the fact is kept
    # The half-precision value ``fn`` upcast this fp32 value from: a cast back down returns it.
    upcast_from: Any = None
    # recompute=True: an argument, or a cast or view of one. A matmul operand that is cheap is
    # not saved for the backward pass: it is there already, or recomputed for free.
    cheap: bool = False
    # recompute=True: how many elementwise ops (at most ``_NEAR_DEPTH``) this value is from
    # saved matmul outputs (0: one of them) and cheap values. A matmul operand that is near
    # is recomputed in the backward pass from the saved outputs rather than saved beside
    # them: a softmax's probabilities from the scores, a GELU from its matmul's output.
    near: int | None = None
    # The argument this value is, or is a view of (a cast, reshape, transpose): which matmul
    # reads which argument (an FP8 policy keeps the head's in the compute dtype).
    path: str | None = None
    # An argument of ``fn``, or a view of one (a param: an embedding table).
    argument: bool = False


class _Facts:
    """What one call of the autocast function knows of the values it traces: one
    :class:`_Fact` per value, set where the value is made and handed to the values made from
    it (:meth:`inherit`). A value's fact is found by the value itself: JAX hands each body it
    traces (a remat's, a scan's step) new tracers, which :meth:`inherit` ties to the caller's.
    ``cheap`` and ``near`` are the memory pass's (:mod:`._recompute`), which alone sets them."""

    def __init__(self):
        self._by_id: dict[int, _Fact] = {}

    def clear(self) -> None:
        """Forgets every value (the call is over)."""
        self._by_id.clear()

    def of(self, x: Any) -> _Fact | None:
        fact = self._by_id.get(id(x))
        return fact if fact is not None and fact.value is x else None

    def _fact(self, x: Any) -> _Fact:
        fact = self.of(x)
        if fact is None:
            fact = self._by_id[id(x)] = _Fact(x)
        return fact

    def upcast_from(self, x: Any) -> Any:
        fact = self.of(x)
        return None if fact is None else fact.upcast_from

    def cheap(self, x: Any) -> bool:
        fact = self.of(x)
        return fact is not None and fact.cheap

    def near(self, x: Any) -> int | None:
        fact = self.of(x)
        return None if fact is None else fact.near

    def path(self, x: Any) -> str | None:
        """The path of the argument ``x`` is (or is a view of), or ``None``."""
        fact = self.of(x)
        return None if fact is None else fact.path

    def argument(self, x: Any) -> bool:
        """Whether ``x`` is an argument of ``fn`` (a param), or a view of one."""
        fact = self.of(x)
        return fact is not None and fact.argument

    def set_argument(self, x: Any) -> None:
        self._fact(x).argument = True

    def set_upcast(self, x: Any, source: Any) -> None:
        self._fact(x).upcast_from = source

    def set_path(self, x: Any, path: str | None) -> None:
        if path is not None:
            self._fact(x).path = path

    def set_cheap(self, x: Any) -> None:
        self._fact(x).cheap = True

    def set_near(self, x: Any, depth: int) -> None:
        """``x`` is ``depth`` elementwise ops from kept values (0: one of them); recorded
        within ``_NEAR_DEPTH``."""
        if depth <= _NEAR_DEPTH:
            self._fact(x).near = depth

    def set_near_all(self, values: Any, depth: int) -> None:
        """Each floating value of ``values`` is ``depth`` elementwise ops from kept values."""
        for x in values:
            if is_floating_array(x):
                self.set_near(x, depth)

    def view(self, new: Any, old: Any) -> None:
        """``new`` is a view of ``old`` (a reshape, a transpose): the same argument, and cheap
        when ``old`` is."""
        fact = self.of(old)
        if fact is not None:
            self.set_path(new, fact.path)
            if fact.cheap:
                self.set_cheap(new)
            if fact.argument:
                self.set_argument(new)

    def inherit(self, new: Any, old: Any, source: Any = None) -> None:
        """Records ``new`` (a cast or a new trace's value of ``old``) as what ``old`` is: the
        same argument, cheap (as ``source`` may be, the value ``old`` was upcast from), or
        near kept values."""
        fact = self.of(old)
        if fact is not None:
            self.set_path(new, fact.path)
            if fact.argument:
                self.set_argument(new)
        if (fact is not None and fact.cheap) or (source is not None and self.cheap(source)):
            self.set_cheap(new)
        elif fact is not None and fact.near is not None:
            self.set_near(new, fact.near)


@dataclasses.dataclass
class _Call:
    """What one call of the autocast function learns as it evaluates: its own, never shared
    with another call."""

    facts: _Facts
    # The memory pass (``jaxamp._autocast._recompute._Memory``): what the backward pass keeps.
    memory: Any
    # The name stacks of the ops seen (shared by the calls of one trace, for the warning about
    # scopes that matched nothing).
    scopes_seen: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class _Context:
    """The rules of an autocast function (fixed when it is built), the level being evaluated
    (inside an fp32 region or not), and the state of the call it serves (:class:`_Call`)."""

    compute: Any
    rules: Mapping[str, str]
    fp32_scopes: tuple[str, ...]
    # The user's rules by name scope: (scope, {primitive: rule}), in the order given.
    scope_rules: tuple[tuple[str, Mapping[str, str]], ...] = ()
    regions: bool = True
    all_float32: bool = False  # inside an fp32 region
    fp8_recipe: Any = None  # the jaxamp.fp8.CurrentScaling of the "fp8" rule
    # Inside a model's own remat (under recompute=True): its policy (the outermost's, as JAX
    # applies it), which alone decides what is kept there.
    model_remat: Callable[..., Any] | None = None
    # A remat's body (a model's block), whose full-size outputs go on to the caller's ops.
    remat_body: bool = False
    # Inside a loop's body (a scan's step, a while's), at any depth.
    in_loop: bool = False
    call: _Call = dataclasses.field(compare=False, kw_only=True)
