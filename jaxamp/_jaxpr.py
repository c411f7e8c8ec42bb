"""Walking and evaluating jaxprs: shared by the audit and the overflow diagnosis (private).

Only public JAX APIs: ``jax.extend.core`` for jaxpr types, a jaxpr equation's own
``source_info`` for source lines and name stacks. Every diagnostic here is best effort and
never raises: a missing attribute in a future JAX version gives ``"<unknown>"``, not a crash of
the train step that asked for a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sysconfig
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Literal
from jax.extend.core import jaxpr_as_fun

from jaxamp._tree import convert_floating
from jaxamp._tree import is_floating_array
from jaxamp._tree import wider_float

__all__ = ["CALLS", "Enter", "HIGHER_ORDER", "HigherOrder", "Interpreter", "Level", "Literal",
           "MATMULS", "RuleNotKeptWarning",
           "body", "environment", "evaluate", "is_backward", "jaxprs_in", "kind", "made_order",
           "nested_stack", "run_traced", "scan_layout", "scope", "sub_jaxprs", "walk",
           "walk_levels", "where", "while_layout"]

MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
"""The primitives that multiply matrices (``ragged_dot`` is JAX's name before
``ragged_dot_general``): the ops autocast runs in the compute dtype, the audit counts and the
train step's fp32-matmul warning looks for."""

# Frames in these folders are not the user's: JAX itself and Python's standard library.
_JAX_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (jax, jaxlib))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
# Model libraries whose frames are skipped when naming a source line: an nnx.Linear or a Linen
# Dense is reported at the model's line that called it, not inside the library.
_LIBRARY_DIRS = tuple(f"{os.sep}{name}{os.sep}" for name in
                      ("flax", "optax", "equinox", "haiku", "jmp", "penzai"))


def _frames(traceback: Any) -> list[tuple[str, int, int, str]]:
    """``(file, line, column, function)`` of each frame of a jaxlib traceback, innermost first."""
    codes, lastis = traceback.raw_frames()
    out = []
    for code, lasti in zip(codes, lastis, strict=True):
        line, column = code.co_firstlineno, 0
        positions = list(code.co_positions())
        if 0 <= lasti // 2 < len(positions):
            start_line, _, start_col, _ = positions[lasti // 2]
            line = start_line if start_line is not None else line
            column = start_col or 0
        out.append((code.co_filename, line, column, code.co_qualname))
    return out


def _is_user_file(file_name: str) -> bool:
    if file_name.startswith(_JAX_DIRS):
        return False
    return not file_name.startswith(_STDLIB_DIR) or "-packages" + os.sep in file_name


def where(eqn: Any) -> str:
    """``file:line:col (function)`` of the user code that emitted ``eqn``: the innermost frame
    outside JAX and outside model libraries such as flax (falling back to the innermost).
    ``"<unknown>"`` when the equation carries no usable source information."""
    try:
        frames = [f for f in _frames(eqn.source_info.traceback) if _is_user_file(f[0])]
        if not frames:
            return "<unknown>"
        file_name, line, column, function = next(
            (f for f in frames if not any(d in f[0] for d in _LIBRARY_DIRS)), frames[0])
        if column:
            return f"{file_name}:{line}:{column} ({function})"
        return f"{file_name}:{line} ({function})"
    except Exception:  # noqa: BLE001 - source info is best effort, never an error
        return "<unknown>"


def _name_stack(eqn: Any) -> str:
    try:
        return str(eqn.source_info.name_stack)
    except Exception:  # noqa: BLE001
        return ""


def nested_stack(eqn: Any, outer: str = "") -> str:
    """The raw name stack of ``eqn`` inside a nested jaxpr whose enclosing stack is ``outer``
    (equations inside a jit or remat body only record the stack relative to that body)."""
    inner = _name_stack(eqn)
    return f"{outer}/{inner}" if outer and inner else (outer or inner)


def _scope_parts(raw: str) -> list[str]:
    return [p for p in re.split(r"[()/]", raw)
            if p and p not in ("jvp", "transpose", "vmap", "pjit", "jit", "checkpoint",
                               "remat", "remat2", "rematted_computation")]


def is_backward(eqn: Any, outer: str = "") -> bool:
    """Whether ``eqn`` belongs to a transposed (backward) pass."""
    return "transpose(" in nested_stack(eqn, outer)


def scope(eqn: Any, outer: str = "") -> str:
    """The user's name scope of ``eqn`` (``outer`` is the enclosing stack, see
    :func:`nested_stack`) without JAX's transform wrappers; ``" [backward]"`` is appended for
    equations of a backward pass. Empty when there is no scope."""
    outer_parts, inner_parts = _scope_parts(outer), _scope_parts(_name_stack(eqn))
    # Some wrappers (flax's remat) re-enter the enclosing scope inside the body: don't repeat it.
    if inner_parts[:len(outer_parts)] == outer_parts:
        parts = inner_parts
    else:
        parts = outer_parts + inner_parts
    if not parts:
        return ""
    return "/".join(parts) + (" [backward]" if is_backward(eqn, outer) else "")


def scan_layout(eqn: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation, whose operands are its constants,
    then its carry, then the arrays it scans over (and whose outputs are the carry, then the
    stacked ys).

    JAX has no public accessor for this layout, and its params changed: up to jax 0.10 they
    hold the counts ``num_consts`` and ``num_carry``; from jax 0.11 they hold ``ft_in``, a
    flat tree of the three groups of operands whose ``unpack()`` gives them. That object's
    class is private (``jax._src.flattree``); it is reached through the equation, never
    imported, and tests/test_jax_apis.py pins both layouts.

    Raises:
      NotImplementedError: a JAX whose scan params hold neither.
    """
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:  # jax <= 0.10
        return int(params["num_consts"]), int(params["num_carry"])
    groups = params.get("ft_in")  # jax >= 0.11
    if groups is not None and hasattr(groups, "unpack"):
        consts, carry, _ = groups.unpack()
        return len(consts), len(carry)
    raise NotImplementedError(
        f"jaxamp cannot read the operand layout of a scan in jax {jax.__version__}: its "
        f"params are {sorted(params)}, with neither num_consts/num_carry (jax <= 0.10) nor "
        "ft_in (jax 0.11 to 0.12); use a JAX in that range, or report it to jaxamp")


def while_layout(eqn: Any) -> tuple[int, int]:
    """``(cond_nconsts, body_nconsts)`` of a ``while`` equation, read from its structure rather
    than from params of those names: its operands are the condition's constants, the body's,
    then the carry, as many as its outputs; each of its jaxprs takes its constants, then the
    carry."""
    n_carry = len(eqn.outvars)
    cond, body = (getattr(j, "jaxpr", j) for j in (eqn.params["cond_jaxpr"],
                                                   eqn.params["body_jaxpr"]))
    return len(cond.invars) - n_carry, len(body.invars) - n_carry


def sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, float]]:
    """Yields ``(jaxpr, multiplicity)`` for each jaxpr nested in ``eqn``, as
    :data:`HIGHER_ORDER` says (a custom derivative's primal body only, the branch of a
    platform-dependent cond that runs here, a scan's body ``length`` times); for a
    higher-order primitive it does not know, every nested jaxpr, once."""
    known = HIGHER_ORDER.get(eqn.primitive.name)
    if known is not None:
        for sub, mult in known.bodies(eqn):
            yield getattr(sub, "jaxpr", sub), mult
        return
    for value in eqn.params.values():
        yield from ((j, 1.0) for j in jaxprs_in(value))


def jaxprs_in(value: Any) -> Iterator[Any]:
    """The jaxprs in one param's value (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for item in value:
            yield from jaxprs_in(item)


def walk(jaxpr: Any, mult: float = 1.0) -> Iterator[tuple[Any, float]]:
    """Yields ``(eqn, multiplicity)`` for every equation, nested ones included.

    A ``scan`` body counts ``length`` times; a ``while`` body once (its trip count is unknown
    at trace time); a ``cond`` counts every branch.
    """
    for eqn, m, _, _ in walk_levels(jaxpr, mult):
        yield eqn, m


class Level:
    """One jaxpr's equations, indexed once: the equation that produces each variable and
    those that read it (by position in ``eqns``), and the variables it returns. The one
    producer/consumer index of a jaxpr level: autocast's regions, the attention finder and
    the audit read it."""

    def __init__(self, jaxpr: Any):
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        self.eqns = list(jaxpr.eqns)
        self.outvars = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        self.producer: dict[Any, int] = {}
        self.consumers: dict[Any, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    self.consumers.setdefault(v, []).append(i)

    def index(self, eqn: Any) -> int:
        """The position of ``eqn`` in :attr:`eqns`."""
        if not hasattr(self, "_index"):
            self._index = {id(e): i for i, e in enumerate(self.eqns)}
        return self._index[id(eqn)]

    def producing(self, v: Any) -> Any:
        """The equation that produces ``v``, or ``None`` (an input, a constant, a literal)."""
        i = None if isinstance(v, Literal) else self.producer.get(v)
        return None if i is None else self.eqns[i]


def walk_levels(jaxpr: Any, mult: float = 1.0,
                 outer: str = "") -> Iterator[tuple[Any, float, Level, str]]:
    """Like :func:`walk`, with the :class:`Level` of each equation's jaxpr and the enclosing
    name stack: each equation in order, then the equations of its bodies (as
    :func:`sub_jaxprs` gives them). It walks; it evaluates nothing (:func:`evaluate` does)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    level = Level(jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, mult, level, outer
        for sub, m in sub_jaxprs(eqn):
            yield from walk_levels(sub, mult * m, nested_stack(eqn, outer))


def _platform_branch(eqn: Any) -> Any:
    """The branch of a ``lax.platform_dependent`` cond that runs on JAX's default backend
    (None for any other cond). Its branches are alternatives for different platforms (cuDNN's
    attention or XLA's under autocast), not paths of one program."""
    platforms = eqn.params.get("branches_platforms")
    if not platforms:
        return None
    backend = jax.default_backend()
    names = ("cuda", "rocm", "gpu") if backend == "gpu" else (backend,)
    branches = eqn.params["branches"]
    chosen = next((i for i, group in enumerate(platforms)
                   if group is not None and any(p in names for p in group)),
                  next((i for i, group in enumerate(platforms) if group is None), None))
    if chosen is None:  # no branch for this backend: the program cannot run here
        return None
    return getattr(branches[chosen], "jaxpr", branches[chosen])


# --------------------------------------------------------------------------------------------
# Higher-order primitives: registered once, for every interpreter and walker of the package
# --------------------------------------------------------------------------------------------

Enter = Callable[..., Callable[..., list]]
"""An interpreter's way into a body: ``enter(body, const_args=None)`` is a function of the
body's arguments that evaluates it (``const_args`` flags the arguments that are compile-time
constants in the caller)."""


@dataclasses.dataclass(frozen=True)
class HigherOrder:
    """One higher-order primitive, as every interpreter and walker of the package sees it.

    - ``kind``: ``"call"`` (a nested ``jit``: the body runs once, as it is), ``"remat"`` (once,
      and again in the backward pass), ``"custom"`` (a custom derivative: the primal body; the
      rule is the user's), ``"loop"`` (``scan``, ``while``), ``"branch"`` (``cond``) or
      ``"map"`` (``pmap``, ``shard_map``: the body once per device).
    - ``bodies(eqn)``: ``(body, runs per call)`` of each nested jaxpr that runs (the walkers:
      the audit, the fp32-matmul warning, the order of the gradients).
    - ``run(eqn, invals, enter, const_in, **hooks)``: the primitive bound again with each body
      evaluated by an interpreter, so that the result transforms as the original did
      (autocast); ``None`` where it is bound as it is. A scan takes the hook
      ``each_step(slices, stacked)``.
    - ``inline``: whether evaluating the one body on the operands gives the outputs as they are
      (calls, remats, a custom derivative's primal), so that an evaluator of concrete values
      (the overflow diagnosis) steps inside.
    """

    kind: str
    bodies: Callable[[Any], list[tuple[Any, float]]]
    run: Callable[..., list] | None = None
    inline: bool = False


def _one_body(key: str) -> Callable[[Any], list[tuple[Any, float]]]:
    return lambda eqn: [(eqn.params[key], 1.0)] if key in eqn.params else []


def _run_body(key: str) -> Callable[..., list]:
    def run(eqn, invals, enter, const_in, **_):
        return enter(eqn.params[key], const_in)(*invals)
    return run


def _run_remat(eqn: Any, invals: list, enter: Enter, const_in: Any, **_) -> list:
    return jax.checkpoint(enter(eqn.params["jaxpr"]), prevent_cse=eqn.params.get(
        "prevent_cse", True), policy=eqn.params.get("policy"))(*invals)


def _cast_like(values: Sequence[Any], like: Sequence[Any]) -> list:
    """``values`` in the dtypes of ``like`` (floating ones): a loop's carry keeps its dtype
    whatever an interpreter computed it in."""
    return [convert_floating(x, y.dtype) if is_floating_array(y) else x
            for x, y in zip(values, like, strict=True)]


def _carried(eqn: Any, init: list, step: Callable[[list], list]) -> list:
    """A loop's initial carry in the dtypes its body keeps: each floating carry as wide as
    the body computes it (``step(carry) -> new carry``), up to the dtype it was traced with.
    An interpreter may compute a half-precision initial value (``zeros_like`` of a bf16
    input) and an fp32 update (``decay * h``, ``decay`` fp32): the carry is then fp32, not
    rounded to bf16 at every step, where a recurrence compounds the rounding. Traced once more
    (abstractly) only where an initial value is narrower than its traced dtype."""
    traced = [v.aval.dtype for v in eqn.outvars[:len(init)]]
    if all(not is_floating_array(x) or wider_float(x.dtype, t) == x.dtype
           for x, t in zip(init, traced, strict=True)):
        return list(init)
    carry = list(init)
    for _ in range(len(carry) + 1):  # each round widens at least one, or ends
        out = jax.eval_shape(step, carry)
        wider = [convert_floating(x, wider_float(x.dtype, o.dtype))
                 if is_floating_array(x) and is_floating_array(o) else x
                 for x, o in zip(carry, out, strict=True)]
        if [x.dtype for x in wider] == [x.dtype for x in carry]:
            break
        carry = wider
    return carry


def _run_scan(eqn: Any, invals: list, enter: Enter, const_in: Any,
              each_step: Callable[[list, list], None] | None = None, **_) -> list:
    p = eqn.params
    n_consts, n_carry = scan_layout(eqn)
    consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                        invals[n_consts + n_carry:])
    body = enter(p["jaxpr"])
    x0 = [x[0] for x in xs]
    init = _carried(eqn, init, lambda c: body(*consts, *c, *x0)[:n_carry])

    def step(carry, x):
        if each_step is not None:
            each_step(list(x), xs)
        outs = body(*consts, *carry, *x)
        return _cast_like(outs[:n_carry], init), outs[n_carry:]
    carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p.get("unroll", 1))
    return [*carry, *ys]


def _run_while(eqn: Any, invals: list, enter: Enter, const_in: Any, **_) -> list:
    nc, nb = while_layout(eqn)
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    cond, body = enter(eqn.params["cond_jaxpr"]), enter(eqn.params["body_jaxpr"])
    init = _carried(eqn, init, lambda c: body(*body_consts, *c))
    return jax.lax.while_loop(lambda c: cond(*cond_consts, *c)[0],
                              lambda c: _cast_like(body(*body_consts, *c), init), list(init))


def _run_cond(eqn: Any, invals: list, enter: Enter, const_in: Any, **_) -> list:
    """The branches agree on each output's dtype: the widest any of them computes."""
    index, operands = invals[0], invals[1:]
    branches = [enter(b) for b in eqn.params["branches"]]
    shapes = [jax.eval_shape(b, *operands) for b in branches]
    dtypes = [functools.reduce(wider_float, [s[i].dtype for s in shapes])
              if is_floating_array(shapes[0][i]) else None for i in range(len(shapes[0]))]

    def agreeing(branch):
        return lambda *ops: [x if d is None else convert_floating(x, d)
                             for x, d in zip(branch(*ops), dtypes, strict=True)]
    return jax.lax.switch(index, [agreeing(b) for b in branches], *operands)


def _jvp_rule(eqn: Any) -> Callable[..., Any] | None:
    """A ``custom_jvp`` equation's rule: ``rule(*zeros) -> (jaxpr, consts, out_zeros)``, the
    JVP traced for its non-constant inputs (``zeros`` flags the tangents that are symbolic
    zeros), or ``None`` where this JAX's params hold no rule we know. JAX has no public
    accessor: the params hold ``jvp_jaxpr_fun`` (a ``WrappedFun``, reached through the
    equation, never imported; jax 0.10 to 0.12) or ``jvp_jaxpr_thunk`` (a plain function,
    earlier JAX); tests/test_jax_apis.py pins it."""
    fun: Any = eqn.params.get("jvp_jaxpr_fun")
    call: Any = getattr(fun, "call_wrapped", None)
    if callable(call):
        return call
    thunk: Any = eqn.params.get("jvp_jaxpr_thunk")
    return thunk if callable(thunk) else None


class RuleNotKeptWarning(UserWarning):
    """A custom derivative rule an interpreter could not keep (autocast): the function's
    primal body is differentiated instead. :func:`jaxamp.audit` lists them."""


def _run_custom_jvp(eqn: Any, invals: list, enter: Enter, const_in: Any, **_) -> list:
    """A ``custom_jvp`` function bound again as one: its primal body and its own JVP rule,
    each evaluated by the interpreter, so that the rule, not the primal body, differentiates
    it (a straight-through estimator, ``jax.nn.relu``'s derivative at 0, a safe norm). The
    rule's tangents take the dtypes of the primal outputs. Where the rule cannot be read, the
    primal body is inlined (``None`` from :func:`_jvp_rule`)."""
    p = eqn.params
    primal = enter(p["call_jaxpr"], const_in)
    rule = _jvp_rule(eqn)
    if rule is None:
        warnings.warn(RuleNotKeptWarning(
            f"the custom_jvp rule of the function at {where(eqn)} could not be read in jax "
            f"{jax.__version__} (its params are {sorted(eqn.params)}): its primal body is "
            "differentiated instead; use a JAX jaxamp is tested with (0.10 to 0.12)"),
            stacklevel=2)
        return primal(*invals)
    n_consts = int(p["num_consts"])

    def tangent_rule(primals, tangents):
        jvp, consts, out_zeros = rule(*[False] * (len(primals) - n_consts))
        out = enter(ClosedJaxpr(jvp, consts))(*primals[n_consts:], *tangents[n_consts:])
        primal_out = primal(*primals)
        nonzero = iter(out[len(out_zeros):])
        tangent_out = [_zero_tangent(y) if zero else _tangent_like(next(nonzero), y)
                       for y, zero in zip(primal_out, out_zeros, strict=True)]
        return primal_out, tangent_out
    f = jax.custom_jvp(lambda *args: primal(*args))
    f.defjvp(tangent_rule)
    return list(f(*invals))


def _tangent_like(t: Any, y: Any) -> Any:
    return convert_floating(t, y.dtype) if is_floating_array(y) else t


def _zero_tangent(y: Any) -> Any:
    if is_floating_array(y):
        return jax.numpy.zeros_like(y)
    return np.zeros(np.shape(y), jax.dtypes.float0)


def _branches(eqn: Any) -> list[tuple[Any, float]]:
    """The branch of a platform-dependent cond that runs here, else every branch (a report
    shows the upper bound)."""
    chosen = _platform_branch(eqn)
    return [(b, 1.0) for b in ([chosen] if chosen is not None
                                else eqn.params.get("branches", ()))]


def _every_body(runs: Callable[[Any], float]) -> Callable[[Any], list[tuple[Any, float]]]:
    return lambda eqn: [(j, runs(eqn.params)) for v in eqn.params.values()
                        for j in jaxprs_in(v)]


def _devices(params: Any) -> float:
    return float(params.get("axis_size") or getattr(params.get("mesh"), "size", 1) or 1)


HIGHER_ORDER: dict[str, HigherOrder] = {
    # `closed_call` is named `eval_jaxpr` from jax 0.11 on (what partial evaluation makes of a
    # scan's known part, and `jax.extend.core.jaxpr_as_fun` of a jaxpr that holds one).
    **{name: HigherOrder("call", _one_body(key), _run_body(key), inline=True)
       for name, key in (("pjit", "jaxpr"), ("jit", "jaxpr"), ("closed_call", "call_jaxpr"),
                         ("eval_jaxpr", "call_jaxpr"), ("core_call", "call_jaxpr"))},
    **{name: HigherOrder("remat", _one_body("jaxpr"), _run_remat, inline=True)
       for name in ("checkpoint", "remat", "remat2")},
    "custom_jvp_call": HigherOrder("custom", _one_body("call_jaxpr"), _run_custom_jvp,
                                   inline=True),
    **{name: HigherOrder("custom", _one_body(key), None, inline=True)
       for name, key in (("custom_vjp_call", "call_jaxpr"),
                         ("custom_vjp_call_jaxpr", "fun_jaxpr"))},
    "scan": HigherOrder("loop", lambda eqn: [(eqn.params["jaxpr"],
                                              float(eqn.params.get("length", 1)))], _run_scan),
    "while": HigherOrder("loop", lambda eqn: [(eqn.params["cond_jaxpr"], 1.0),
                                              (eqn.params["body_jaxpr"], 1.0)], _run_while),
    "cond": HigherOrder("branch", _branches, _run_cond),
    **{name: HigherOrder("map", _every_body(_devices))
       for name in ("xla_pmap", "pmap", "shard_map")},
}
"""Every higher-order primitive the package knows, by name (JAX's renames side by side: a new
JAX needs one line). A while loop's trip count is unknown at trace time: its body counts once."""

CALLS = frozenset(name for name, h in HIGHER_ORDER.items() if h.kind == "call")
"""The names of the call primitives (a nested ``jit``)."""


def kind(eqn: Any) -> str | None:
    """The kind of a higher-order equation (:class:`HigherOrder`), else ``None``."""
    known = HIGHER_ORDER.get(eqn.primitive.name)
    return None if known is None else known.kind


def body(eqn: Any, kinds: tuple[str, ...] = ("call", "remat", "custom")) -> Any:
    """The one body of ``eqn`` when it is an inline higher-order primitive of one of ``kinds``
    (a closed or open jaxpr), else ``None``."""
    known = HIGHER_ORDER.get(eqn.primitive.name)
    if known is None or not known.inline or known.kind not in kinds:
        return None
    found = known.bodies(eqn)
    return found[0][0] if found else None


def environment(jaxpr: Any, consts: list, args: list) -> tuple[dict, Callable[[Any], Any]]:
    """``(env, read)`` for evaluating ``jaxpr``: its constants and arguments bound, and a
    reader of variables and literals."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]
    return env, read


class Interpreter:
    """How :func:`evaluate` evaluates: the one protocol of the package's interpreters
    (autocast's, the overflow diagnosis's). This base binds each primitive as it is and enters
    the inline higher-order primitives of :data:`HIGHER_ORDER` (calls, remats, a custom
    derivative's primal) with itself."""

    def equation(self, eqn: Any, read: Callable, outer: str) -> list:
        """The outputs of ``eqn`` (``read`` gives a variable's value; ``outer`` is the name
        stack around the jaxpr)."""
        invals = [read(v) for v in eqn.invars]
        inner = body(eqn)
        if inner is not None:
            return evaluate(getattr(inner, "jaxpr", inner), list(getattr(inner, "consts", ())),
                            invals, self, nested_stack(eqn, outer))
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        self.seen(eqn, outs, outer)
        return outs

    def seen(self, eqn: Any, outs: list, outer: str) -> None:
        """Called with each primitive's outputs, as :meth:`equation` binds it."""

    def take(self, i: int, eqn: Any, env: dict, read: Callable, outer: str) -> set[int] | None:
        """May evaluate a group of equations that starts at the ``i``-th itself (autocast's
        fp32 regions, a fused attention), writing their values to ``env``; returns the indices
        it evaluated (the loop skips them), or ``None``."""
        del i, eqn, env, read, outer
        return None


def evaluate(jaxpr: Any, consts: list, args: list, interpreter: Interpreter,
             outer: str = "") -> list:
    """The package's one loop over a jaxpr's equations, in order, each evaluated by
    ``interpreter`` (:class:`Interpreter`)."""
    env, read = environment(jaxpr, consts, args)
    done: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if i in done:
            continue
        taken = interpreter.take(i, eqn, env, read, outer)
        if taken:
            done.update(taken)
            continue
        for v, x in zip(eqn.outvars, interpreter.equation(eqn, read, outer), strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def made_order(jaxpr: Any) -> list[int]:
    """The order in which ``jaxpr`` makes its outputs: a rank per output, equal ranks for
    outputs made together. An output is made by its equation, and inside a call (a nested
    ``jit``, a remat) by the equation of the body that makes it; an input or a literal comes
    first. Equations run in the jaxpr's order, so the ranks follow a backward pass layer by
    layer even where the whole backward is one jitted call."""
    positions = _positions(jaxpr)
    ranks = {p: r for r, p in enumerate(sorted(set(positions)))}
    return [ranks[p] for p in positions]


def _positions(jaxpr: Any) -> list[tuple[int, ...]]:
    made = {v: (i, k) for i, eqn in enumerate(jaxpr.eqns) for k, v in enumerate(eqn.outvars)}
    inner_positions: dict[int, list[tuple[int, ...]]] = {}

    def position(v: Any) -> tuple[int, ...]:
        if isinstance(v, Literal) or v not in made:
            return ()
        i, k = made[v]
        inner = body(jaxpr.eqns[i], ("call", "remat"))
        if inner is None:
            return (i,)
        if i not in inner_positions:
            inner_positions[i] = _positions(getattr(inner, "jaxpr", inner))
        return (i, *inner_positions[i][k])
    return [position(v) for v in jaxpr.outvars]


def run_traced(fn: Callable, *args: Any, inspect: Callable[[Any], None] | None = None,
               interpreter: Interpreter | None = None) -> tuple[Any, Any]:
    """``(fn(*args), order)``: ``fn`` traced once into a jaxpr and run (inside the caller's
    trace, as if called), and :func:`made_order` of its outputs, a tree of ints with the
    outputs' structure. ``inspect``, when given, is called with the closed jaxpr first (a
    diagnostic that reads the program, with no second trace). ``interpreter``, when given,
    evaluates the equations (:func:`evaluate`: eagerly, outside a trace, it sees every value)."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if inspect is not None:
        inspect(closed)
    tree = jax.tree.structure(shape)
    if interpreter is None:
        outputs = jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    else:
        outputs = evaluate(closed.jaxpr, list(closed.consts), jax.tree.leaves(args),
                           interpreter)
    return (jax.tree.unflatten(tree, outputs),
            jax.tree.unflatten(tree, made_order(closed.jaxpr)))
