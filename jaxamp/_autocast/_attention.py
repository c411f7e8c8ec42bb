"""``jax.nn.dot_product_attention``'s calls, found in a jaxpr as JAX traced them.

A call that leaves ``implementation`` unset traces JAX's XLA implementation inline: a dozen to
forty equations (the scores' ``dot_general``, the scale, the masks, the softmax, the
probabilities' ``dot_general``). Autocast runs such a call as cuDNN's fused kernel where the
step is compiled for an NVIDIA GPU, so it finds them in the jaxpr it interprets, with nothing of
JAX's changed:

1. **Where the equations were traced.** Each equation keeps the Python stack it was traced
   from (``eqn.source_info.traceback``). The equations of one call are a run of equations traced
   inside ``jax.nn.dot_product_attention``, at the same line of it (its branch for
   ``implementation=None``: a call that names ``"xla"`` traces the same equations from another
   line, and runs as asked) and from the same caller.
2. **The same equations again.** The run's inputs (query, key, value, then a bias and a mask
   where the call has them; one array may be several of them, ``k is v`` or self-attention's
   ``q is k is v``) and the scale it multiplies the scores by give the call's options;
   JAX's function, traced again on those inputs with those options, must give the run's
   equations one for one (primitives, parameters, literals and data flow), from the same line.
   Where nothing matches (a ``vmap`` of the call, sequence lengths, a local window, the
   residual), the equations run as they are.

So a function imported by name (``from jax.nn import dot_product_attention``), flax NNX's
attention, and two traces in two threads all see JAX's own function. What the recognition
reads of JAX's private structure, and why: ``source_info.traceback`` (the only record of which
function traced an equation; ``tests/test_jax_apis.py`` pins it) and the path of the module
that defines the function (``jax/_src/nn/functions.py``), which the re-trace confirms.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import _attention_structure
from jaxamp._jaxpr import Level
from jaxamp._jaxpr import Literal

_FUNCTION = "dot_product_attention"
# The module that defines jax.nn.dot_product_attention (a private path: see the docstring).
_MODULE = os.path.join("jax", "_src", "nn", "functions.py")


@dataclasses.dataclass(frozen=True)
class Equations:
    """Some of a jaxpr's equations, with the variables they read and the one they give: what
    the package's evaluator reads of a jaxpr (a ``jax.core.Jaxpr`` would want JAX's private
    debug information)."""

    invars: tuple[Any, ...]
    outvars: tuple[Any, ...]
    eqns: tuple[Any, ...]
    constvars: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Call:
    """One ``jax.nn.dot_product_attention`` call in a jaxpr."""

    indices: tuple[int, ...]  # its equations in the jaxpr
    inputs: tuple[Any, ...]   # the variables of query, key, value, then bias and mask if given
    output: Any               # the variable of its result
    options: dict             # scale, is_causal, bias (given), mask (given)
    body: Any                 # JAX's function on the inputs, traced again: a ClosedJaxpr
    scores: Any               # the equation of its first dot_general
    equations: Equations      # its own equations, of ``reads``
    reads: tuple[Any, ...]    # the variables its equations read
    # What the fused call is made of (:mod:`jaxamp._autocast._attention_structure`): the
    # inputs' values arranged as query, key, value, bias and mask of
    # ``jax.nn.dot_product_attention``, and
    # its output put back in the layout of ``output``; ``None``: the inputs are those already.
    arrange: Any = None
    restore: Any = None
    before: tuple[int, ...] = ()  # equations to run first: they make what the call reads


def site(eqn: Any) -> tuple | None:
    """Where ``eqn`` was traced, from ``jax.nn.dot_product_attention``'s frame outwards (code
    objects and their bytecode offsets), or ``None`` outside that function."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return None
    codes, offsets = traceback.raw_frames()  # the innermost frame first
    for j, code in enumerate(codes):
        if code.co_name == _FUNCTION and code.co_filename.endswith(_MODULE):
            return tuple(zip(codes[j:], offsets[j:], strict=True))
    return None


def find_calls(jaxpr: Any) -> dict[int, Call]:
    """The calls in ``jaxpr`` (a jaxpr or its :class:`~jaxamp._jaxpr.Level`; not in its
    sub-jaxprs), by the index of their first equation."""
    level = jaxpr if isinstance(jaxpr, Level) else Level(jaxpr)
    eqns = level.eqns
    runs: list[tuple[tuple, list[int]]] = []
    for i, eqn in enumerate(eqns):
        where = site(eqn)
        if where is None:
            continue
        if runs and runs[-1][0] == where and runs[-1][1][-1] == i - 1:
            runs[-1][1].append(i)
        else:
            runs.append((where, [i]))
    if not runs:
        return _by_structure(level, {})
    calls = {}
    for _, indices in runs:
        # Calls made one after another from one line (a loop) are one run: cut it after
        # each call's second dot_general, where JAX's function confirms a call.
        while indices:
            dots = [k for k, i in enumerate(indices) if eqns[i].primitive.name == "dot_general"]
            if len(dots) < 2:
                break
            last = dots[2] if len(dots) > 2 else len(indices)
            for end in range(dots[1] + 1, last + 1):
                call = _confirmed(level, indices[:end])
                if call is not None:
                    calls[indices[0]] = call
                    indices = indices[end:]
                    break
            else:
                break
    return _by_structure(level, calls)


def _by_structure(level: Level, calls: dict[int, Call]) -> dict[int, Call]:
    """``calls`` and the attention found by its structure elsewhere in ``level``
    (:mod:`jaxamp._autocast._attention_structure`): flax's, MaxText's, a hand-written one."""
    taken = {i for call in calls.values() for i in call.indices}
    found = dict(calls)
    for j, eqn in enumerate(level.eqns):
        if eqn.primitive.name != "dot_general" or j in taken:
            continue
        chain = _attention_structure.find(level, j)
        # A call of jax.nn.dot_product_attention is the site finder's to take or refuse (one
        # that names its implementation runs as asked).
        if (chain is None or taken & {*chain.indices, *chain.before}
                or site(chain.scores) is not None):
            continue
        inputs = (chain.query, chain.key, chain.value, *chain.biases, *chain.masks)
        reads = tuple(dict.fromkeys(
            v for i in chain.indices for v in level.eqns[i].invars
            if not isinstance(v, Literal) and level.producer.get(v) not in chain.indices))
        output = eqn.outvars[0]
        equations = Equations(invars=reads, outvars=(output,),
                              eqns=tuple(level.eqns[i] for i in chain.indices))
        options = {"scale": chain.scale, "is_causal": chain.causal,
                   "bias": bool(chain.biases), "mask": bool(chain.masks)}
        first = min(chain.indices)
        found[first] = Call(chain.indices, inputs, output, options, None, chain.scores,
                            equations, reads, chain.arrange, chain.restore, chain.before)
        taken.update(chain.indices, chain.before)
    return found


# Marks a value as varying over a mesh axis (inside ``shard_map``, a step's data-parallel
# body): JAX inserts it before constants meet varying values, and a reference traced outside
# the mesh has none; its outputs stand for its inputs.
_VARYING = "pvary"


def _without_varying(eqns: Any) -> tuple[list, dict]:
    """``eqns`` but their ``pvary`` equations, and what each of those outputs stands for."""
    aliases: dict = {}
    kept = []
    for eqn in eqns:
        if eqn.primitive.name == _VARYING:
            for out, x in zip(eqn.outvars, eqn.invars, strict=True):
                aliases[out] = _alias(x, aliases)
        else:
            kept.append(eqn)
    return kept, aliases


def _confirmed(level: Level, indices: list[int]) -> Call | None:
    eqns = level.eqns
    members = set(indices)
    run, aliases = _without_varying(eqns[i] for i in indices)
    defined = {v for eqn in run for v in eqn.outvars} | set(aliases)
    reads: list = []
    for i in indices:
        for v in eqns[i].invars:
            if not isinstance(v, Literal) and v not in defined and v not in reads:
                reads.append(v)
    inputs: list = []
    for eqn in run:
        for v in eqn.invars:
            v = _alias(v, aliases)
            if not isinstance(v, Literal) and v not in defined and v not in inputs:
                inputs.append(v)
    outputs = [v for v in defined
               if v in level.outvars or set(level.consumers.get(v, ())) - members]
    dots = [eqn for eqn in run if eqn.primitive.name == "dot_general"]
    if len(outputs) != 1 or len(dots) != 2:
        return None
    scale = _scale(run, dots[0].outvars[0], aliases)
    floats = [v for v in inputs if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    masks = [v for v in inputs if v.aval.dtype == jnp.bool_]
    if scale is None or len(floats) + len(masks) != len(inputs) or len(masks) > 1:
        return None
    for order in _orders(len(floats)):
        ordered = (*[floats[k] for k in order], *masks)
        for is_causal in (False, True):
            options = {"scale": scale, "is_causal": is_causal, "bias": len(order) == 4,
                       "mask": bool(masks)}
            body = _reference(tuple((v.aval.shape, v.aval.dtype, getattr(v.aval, "weak_type",
                                                                          False))
                                    for v in ordered), **options)
            if body is not None and _same(run, ordered, outputs[0], body, aliases):
                equations = Equations(invars=tuple(reads), outvars=tuple(outputs),
                                      eqns=tuple(eqns[i] for i in indices))
                return Call(tuple(indices), ordered, outputs[0], options, body, dots[0],
                            equations, tuple(reads))
    return None


# The order in which the equations of JAX's function read its floating inputs: the query
# first; a bias before the key and value (4-d operands) or after them (3-d operands, made 4-d
# first).
_READ_ORDERS = (("query", "key", "value"), ("query", "bias", "key", "value"),
                ("query", "key", "value", "bias"))
_ARGUMENTS = ("query", "key", "value", "bias")


@functools.cache
def _orders(n: int) -> tuple[tuple[int, ...], ...]:
    """Each way a call may have read ``n`` distinct floating inputs, as the index of each of its
    arguments (query, key, value, then a bias) among them, in the order they were first read.

    One array may be given for several arguments (``key is value``, self-attention's ``query
    is key is value``): the call's equations read it where they read the first of them, so
    ``n`` can be below the number of arguments. A bias is an array of its own. The re-trace
    decides between the ways."""
    orders = []
    for read in _READ_ORDERS:
        for indices in _first_read_indices(len(read), n):
            given = dict(zip(read, indices, strict=True))
            order = tuple(given[a] for a in _ARGUMENTS if a in given)
            if order not in orders and ("bias" not in given
                                        or indices.count(given["bias"]) == 1):
                orders.append(order)
    return tuple(orders)


def _first_read_indices(length: int, n: int) -> list[tuple[int, ...]]:
    """The sequences of ``length`` indices that use each index below ``n``, each first used
    after every smaller one: (0, 1, 1) for query, key, value with the key given as the value."""
    sequences: list[tuple[int, ...]] = [()]
    for _ in range(length):
        sequences = [(*s, i) for s in sequences
                     for i in range(min(max(s, default=-1) + 2, n))]
    return [s for s in sequences if len(set(s)) == n]


def _alias(v: Any, aliases: dict) -> Any:
    return v if isinstance(v, Literal) else aliases.get(v, v)


def _scale(run: list, scores: Any, aliases: dict) -> float | None:
    """The literal the scores are multiplied by."""
    for eqn in run:
        if eqn.primitive.name == "mul" and scores in eqn.invars:
            for v in eqn.invars:
                v = _alias(v, aliases)
                if isinstance(v, Literal) and np.ndim(v.val) == 0:
                    return float(np.asarray(v.val))
    return None


@functools.lru_cache(maxsize=256)
def _reference(avals: tuple, scale: float, is_causal: bool, bias: bool,
               mask: bool) -> Any:
    """JAX's function traced on these inputs with these options (``None`` if it refuses)."""
    def call(query, key, value, *rest):
        it = iter(rest)
        return jax.nn.dot_product_attention(
            query, key, value, next(it) if bias else None, next(it) if mask else None,
            scale=scale, is_causal=is_causal)
    try:
        return jax.make_jaxpr(call)(*[jax.ShapeDtypeStruct(s, d, weak_type=w)
                                      for s, d, w in avals])
    except (TypeError, ValueError, AssertionError):  # JAX asserts some shapes
        return None


def _same(run: list, inputs: tuple, output: Any, body: Any, aliases: dict) -> bool:
    """Whether ``run`` is ``body``'s equations one for one on ``inputs``, from the same line of
    JAX's function."""
    ref = body.jaxpr
    if body.consts or len(ref.invars) != len(inputs):
        return False
    env = dict(zip(ref.invars, inputs, strict=True))
    mine, reference = (site(run[0]) if run else None), (site(ref.eqns[0]) if ref.eqns else None)
    return (_same_eqns(run, ref.eqns, env, aliases) and env.get(ref.outvars[0]) is output
            and mine is not None and reference is not None and mine[0] == reference[0])


def _same_eqns(mine: list, theirs: list, env: dict, aliases: dict) -> bool:
    """Equations alike one for one, ``env`` mapping each of ``theirs``' variables to
    ``mine``'s (extended with their outputs); ``mine`` without ``pvary`` equations, whose
    outputs ``aliases`` maps to what they stand for."""
    if len(mine) != len(theirs):
        return False
    for eqn, other in zip(mine, theirs, strict=True):
        if (eqn.primitive is not other.primitive or len(eqn.invars) != len(other.invars)
                or len(eqn.outvars) != len(other.outvars)
                or not _same_params(eqn.params, other.params)):
            return False
        for a, b in zip(eqn.invars, other.invars, strict=True):
            a = _alias(a, aliases)
            if isinstance(b, Literal):
                if (not isinstance(a, Literal) or _type(a.aval) != _type(b.aval)
                        or not np.array_equal(np.asarray(a.val), np.asarray(b.val))):
                    return False
            elif env.get(b) is not a:
                return False
        for a, b in zip(eqn.outvars, other.outvars, strict=True):
            if _type(a.aval) != _type(b.aval):
                return False
            env[b] = a
    return True


def _same_jaxpr(a: Any, b: Any) -> bool:
    """Two (closed) jaxprs alike: their arguments' types, equations and results."""
    a_consts, b_consts = getattr(a, "consts", ()), getattr(b, "consts", ())
    a, b = getattr(a, "jaxpr", a), getattr(b, "jaxpr", b)
    if (len(a_consts) != len(b_consts)
            or not all(_same_params(np.asarray(x), np.asarray(y))
                       for x, y in zip(a_consts, b_consts, strict=False))
            or len(a.invars) != len(b.invars)
            or len(a.constvars) != len(b.constvars) or len(a.outvars) != len(b.outvars)
            or any(_type(x.aval) != _type(y.aval) for x, y in zip(
                (*a.constvars, *a.invars), (*b.constvars, *b.invars), strict=True))):
        return False
    env = dict(zip((*b.constvars, *b.invars), (*a.constvars, *a.invars), strict=True))
    kept, aliases = _without_varying(a.eqns)
    if not _same_eqns(kept, b.eqns, env, aliases):
        return False
    for x, y in zip(a.outvars, b.outvars, strict=True):
        x = _alias(x, aliases)
        same = (isinstance(x, Literal) and isinstance(y, Literal)
                and np.array_equal(np.asarray(x.val), np.asarray(y.val))) or env.get(y) is x
        if not same:
            return False
    return True


def _type(aval: Any) -> tuple:
    """An abstract value's shape, dtype and weak type (not its sharding: the step may be
    traced for a mesh, the reference is not)."""
    return (getattr(aval, "shape", None), getattr(aval, "dtype", None),
            getattr(aval, "weak_type", None))


def _same_params(a: Any, b: Any) -> bool:
    """Equal parameters (but shardings): jaxprs alike equation for equation, containers item
    by item, values equal; other objects (a custom derivative's rule, a traced function) of
    the same type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):  # shardings aside: a step traced for a mesh sets them
        return a.keys() == b.keys() and all(_same_params(a[k], b[k]) for k in a
                                            if "sharding" not in str(k))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_params(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "eqns") or hasattr(a, "jaxpr"):
        return _same_jaxpr(a, b)
    if a is None or isinstance(a, (bool, int, float, str, np.dtype, np.generic)):
        return a == b
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if callable(a) or hasattr(a, "call_wrapped") or type(a).__eq__ is object.__eq__:
        return True  # a function (a traced one too), or an object compared by identity
    try:
        same = a == b
    except Exception:  # noqa: BLE001 - an equality that fails: its type decides
        return True
    return bool(same) if isinstance(same, (bool, np.bool_)) else True
