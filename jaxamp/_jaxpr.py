"""Walking and evaluating jaxprs: shared by the audit and the overflow diagnosis (private).

Only public JAX APIs: ``jax.extend.core`` for jaxpr types, a jaxpr equation's own
``source_info`` for source lines and name stacks. Every diagnostic here is best effort and
never raises: a missing attribute in a future JAX version gives ``"<unknown>"``, not a crash of
the train step that asked for a warning.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import jaxlib
from jax.extend.core import Literal
from jax.extend.core import jaxpr_as_fun

__all__ = ["CALLS", "CUSTOM_DERIVATIVES", "Literal", "MATMULS", "REMATS", "body", "environment",
           "evaluate", "is_backward", "made_order", "nested_stack", "run_traced", "scan_layout",
           "scope", "walk", "walk_levels", "where", "while_layout"]

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


# How many times a body runs per run of its equation, for the primitives that repeat theirs: a
# scan its length, a pmap or shard_map once per device. A while loop's trip count is unknown at
# trace time (once).
_REPEATS: dict[str, Callable[[Any], float]] = {
    "scan": lambda params: float(params.get("length", 1)),
    "xla_pmap": lambda params: float(params.get("axis_size", 1)),
    "pmap": lambda params: float(params.get("axis_size", 1)),
    "shard_map": lambda params: float(getattr(params.get("mesh"), "size", 1) or 1),
}


def sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, float]]:
    """Yields ``(jaxpr, multiplicity)`` for each jaxpr nested in ``eqn``: a custom derivative's
    primal body only (its rule runs under the gradient), the branch of a platform-dependent
    cond that runs here, every branch of another cond (a report shows the upper bound), and
    every other nested jaxpr, repeated as :data:`_REPEATS` says."""
    name = eqn.primitive.name
    primal = body(eqn, (CUSTOM_DERIVATIVES,))
    if primal is not None:
        yield getattr(primal, "jaxpr", primal), 1.0
        return
    if name == "cond":
        chosen = _platform_branch(eqn)
        branches = [chosen] if chosen is not None else eqn.params.get("branches", ())
        for branch in branches:
            yield getattr(branch, "jaxpr", branch), 1.0
        return
    repeat = _REPEATS.get(name)
    mult = repeat(eqn.params) if repeat is not None else 1.0
    for value in eqn.params.values():
        yield from ((j, mult) for j in jaxprs_in(value))


def jaxprs_in(value: Any) -> Iterator[Any]:
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


def walk_levels(jaxpr: Any, mult: float = 1.0,
                 outer: str = "") -> Iterator[tuple[Any, float, dict, str]]:
    """Like :func:`walk`, with the map from each variable to the equation producing it and the
    enclosing name stack."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    producers: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producers[v] = eqn
    for eqn in jaxpr.eqns:
        yield eqn, mult, producers, outer
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


# The higher-order primitives whose one body the interpreters (autocast's, the overflow
# diagnosis's) enter, by kind, each with the param that holds the body. JAX's renames are kept
# together here: a new JAX needs one line.
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
"""Calls: the body runs once, as it is."""
REMATS = {"checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}
"""Rematerialisation: the body runs once and again in the backward pass."""
CUSTOM_DERIVATIVES = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
                      "custom_vjp_call_jaxpr": "fun_jaxpr"}
"""Custom derivatives: the primal body (the rule is the user's)."""


def body(eqn: Any, kinds: tuple[dict, ...] = (CALLS, REMATS, CUSTOM_DERIVATIVES)) -> Any:
    """The body of ``eqn`` when its primitive is one of ``kinds`` (a closed or open jaxpr),
    else ``None``."""
    for kind in kinds:
        key = kind.get(eqn.primitive.name)
        if key is not None and key in eqn.params:
            return eqn.params[key]
    return None


def environment(jaxpr: Any, consts: list, args: list) -> tuple[dict, Callable[[Any], Any]]:
    """``(env, read)`` for evaluating ``jaxpr``: its constants and arguments bound, and a
    reader of variables and literals."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]
    return env, read


def evaluate(jaxpr: Any, consts: list, args: list, on_eqn: Callable, outer: str = "") -> list:
    """Evaluates ``jaxpr`` equation by equation, calling ``on_eqn(eqn, outputs, outer)`` after
    each primitive. Call-like equations (jit, remat, custom_jvp/vjp) are entered, so that
    ``on_eqn`` sees the primitives inside them; others are bound as they are."""
    env, read = environment(jaxpr, consts, args)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = body(eqn)
        if inner is not None:
            outs = evaluate(getattr(inner, "jaxpr", inner), list(getattr(inner, "consts", ())),
                            invals, on_eqn, nested_stack(eqn, outer))
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
            on_eqn(eqn, outs, outer)
        for v, x in zip(eqn.outvars, outs, strict=True):
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
        inner = body(jaxpr.eqns[i], (CALLS, REMATS))
        if inner is None:
            return (i,)
        if i not in inner_positions:
            inner_positions[i] = _positions(getattr(inner, "jaxpr", inner))
        return (i, *inner_positions[i][k])
    return [position(v) for v in jaxpr.outvars]


def run_traced(fn: Callable, *args: Any) -> tuple[Any, Any]:
    """``(fn(*args), order)``: ``fn`` traced once into a jaxpr and run (inside the caller's
    trace, as if called), and :func:`made_order` of its outputs, a tree of ints with the
    outputs' structure."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    tree = jax.tree.structure(shape)
    outputs = jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return (jax.tree.unflatten(tree, outputs),
            jax.tree.unflatten(tree, made_order(closed.jaxpr)))
