"""Attention found by its structure: ``softmax(q·kᵀ·scale [+ bias] [masked]) · v`` in a jaxpr,
however it is spelled (private).

:mod:`jaxamp._autocast._attention` finds the calls of ``jax.nn.dot_product_attention`` where JAX
traced them. Most attention is not such a call: flax Linen's ``dot_product_attention``, MaxText's
``dot_product`` attention, a hand-written ``softmax(q @ k.T * scale + mask) @ v``, each an einsum or
a ``dot_general`` of the scores, a scale, a bias or a mask, a softmax and a
``dot_general`` of the probabilities. This module finds that chain by what its equations
compute:

1. **The probabilities' matmul**: a ``dot_general`` one of whose operands is a softmax along
   the axis it contracts: ``exp(s - max(s)) / sum(exp(s - max(s)))`` over one axis, inline
   or as ``jax.nn.softmax``'s ``custom_jvp`` (a dtype cast on the way allowed).
2. **The scores**: from ``s`` back to a ``dot_general`` of two operands that contracts one
   axis each (the head), through casts, multiplications and divisions by a scalar (the scale,
   on the scores or on the query), additions of a tensor (a bias, an additive mask) and
   ``where(mask, s, -big)`` (a boolean mask).
3. **The layouts**: the scores' batch axes (batch, heads, a ``vmap``'s) and the query's other
   free axes (a grouped query's group, its positions) are independent rows of attention, so the
   call is arranged as one batch axis, one head, the query's rows and the keys:
   ``[B, T, 1, H]`` for ``jax.nn.dot_product_attention``, which cuDNN runs fused. A mask that
   is a compile-time lower triangle (a causal mask built from ``iota``) becomes
   ``is_causal``; another is handed as the mask.

What does not match runs as written: dropout on the probabilities, a softmax over another axis
than the one the second matmul contracts, scores read elsewhere (returned, or a second use),
two-axis contractions, a bias added before a scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._jaxpr import Level
from jaxamp._jaxpr import Literal

# Equations a value may pass through unchanged in meaning (a dtype, a copy).
_CASTS = ("convert_element_type", "copy", "copy_p")
# Views of a reduced statistic brought back to the scores' rank.
_VIEWS = ("broadcast_in_dim", "reshape", "expand_dims", "squeeze", *_CASTS)


@dataclasses.dataclass(frozen=True)
class Structure:
    """What the chain computes: where its inputs come from and how to arrange them."""

    scores: Any              # the scores' dot_general equation
    query: Any               # the variables of the query, key and value as the matmuls read them
    key: Any
    value: Any
    scale: float
    biases: tuple[Any, ...]  # added to the scores (after the scale)
    masks: tuple[Any, ...]   # boolean: True keeps a score
    causal: bool             # one of the masks was a compile-time lower triangle (left out)
    arrange: Callable[..., tuple]   # (query, key, value, *biases, *masks) -> q, k, v, bias, mask
    restore: Callable[[Any], Any]   # [B, T, 1, Hv] -> the output as the second matmul gives it
    indices: tuple[int, ...]        # the chain's equations
    before: tuple[int, ...]         # equations inside its stretch that make what it reads


def find(level: Level, j: int) -> Structure | None:
    """The attention whose probabilities' matmul is equation ``j`` of ``level``, or ``None``."""
    found = _matches(level, j)
    return found if isinstance(found, Structure) else None


def why_not(level: Level, j: int) -> str | None:
    """Why the ``dot_general`` equation ``j``, which reads a softmax's output (through at
    most a few elementwise equations), is not attention this module takes; ``None`` where it
    is, or where it reads no softmax."""
    found = _matches(level, j)
    if isinstance(found, str):
        return found
    if found is not None or level.eqns[j].primitive.name != "dot_general":
        return None
    for operand in level.eqns[j].invars:
        names = []
        for _ in range(6):
            i, eqn = _producer(level, operand)
            if eqn is None or eqn.primitive.name not in ("mul", "div", "select_n", *_CASTS):
                break
            if eqn.primitive.name not in _CASTS:
                names.append(eqn.primitive.name)
            operand = eqn.invars[0]
            if names and _softmax(level, operand, []) is not None:
                return (f"the probabilities pass through {', '.join(dict.fromkeys(names))} "
                        "before the second matmul (dropout on the weights?)")
    return None


def _matches(level: Level, j: int) -> Structure | str | None:
    if level.eqns[j].primitive.name != "dot_general":
        return None
    reasons = [_match(level, j, side) for side in (0, 1)]
    return (next((r for r in reasons if isinstance(r, Structure)), None)
            or next((r for r in reasons if isinstance(r, str)), None))


def _producer(level: Level, v: Any) -> tuple[int, Any]:
    """``(index, equation)`` that makes ``v``; ``(-1, None)`` for an input or a literal."""
    i = None if isinstance(v, Literal) else level.producer.get(v)
    return (-1, None) if i is None else (i, level.eqns[i])


def _through(level: Level, v: Any, prims: tuple[str, ...], seen: list[int]) -> Any:
    """``v`` followed back through unary equations of ``prims``."""
    while True:
        i, eqn = _producer(level, v)
        if eqn is None or eqn.primitive.name not in prims or len(eqn.invars) != 1:
            return v
        seen.append(i)
        v = eqn.invars[0]


def _softmax(level: Level, p: Any, seen: list[int]) -> tuple[Any, int] | None:
    """``(s, axis)`` where ``p`` is ``softmax(s, axis)``, inline or ``jax.nn.softmax``'s
    ``custom_jvp``; the equations on the way added to ``seen``."""
    p = _through(level, p, _CASTS, seen)
    i, eqn = _producer(level, p)
    if eqn is None:
        return None
    if eqn.primitive.name == "custom_jvp_call":
        body = eqn.params["call_jaxpr"]
        inner = Level(body)
        jaxpr = getattr(body, "jaxpr", body)
        if len(jaxpr.invars) != 1 or len(jaxpr.outvars) != 1:
            return None
        found = _softmax(inner, jaxpr.outvars[0], [])
        if found is None or found[0] is not jaxpr.invars[0]:
            return None
        seen.append(i)
        return eqn.invars[0], found[1]
    if eqn.primitive.name != "div":
        return None
    seen.append(i)
    e, z = eqn.invars
    e = _through(level, e, _CASTS, seen)
    z = _through(level, z, _VIEWS, seen)
    zi, zeqn = _producer(level, z)
    if zeqn is None or zeqn.primitive.name != "reduce_sum" or len(zeqn.params["axes"]) != 1:
        return None
    seen.append(zi)
    if _through(level, zeqn.invars[0], _CASTS, seen) is not e:
        return None
    axis = zeqn.params["axes"][0]
    ei, eeqn = _producer(level, e)
    if eeqn is None or eeqn.primitive.name != "exp":
        return None
    seen.append(ei)
    di, deqn = _producer(level, _through(level, eeqn.invars[0], _CASTS, seen))
    if deqn is None or deqn.primitive.name != "sub":
        return None
    seen.append(di)
    s, m = deqn.invars
    m = _through(level, m, (*_VIEWS, "stop_gradient"), seen)
    mi, meqn = _producer(level, m)
    if meqn is not None and meqn.primitive.name == "max":  # jax.nn.softmax's max(-inf, m)
        guard, m = meqn.invars
        if _scalar(level, guard) != -np.inf:
            guard, m = m, guard
        if _scalar(level, guard) != -np.inf:
            return None
        seen.append(mi)
        mi, meqn = _producer(level, m)
    if meqn is None or meqn.primitive.name != "reduce_max" or tuple(meqn.params["axes"]) != (
            axis,):
        return None
    seen.append(mi)
    if _through(level, meqn.invars[0], (*_CASTS, "stop_gradient"), seen) is not _through(
            level, s, _CASTS, []):
        return None
    return _through(level, s, _CASTS, seen), axis


def _where(eqn: Any) -> tuple | None:
    """``(condition, where true, where false)`` of ``jnp.where``'s jitted call, else
    ``None``."""
    if eqn.params.get("name") != "_where" or len(eqn.invars) != 3 or "jaxpr" not in eqn.params:
        return None
    return tuple(eqn.invars)


def _scalar(level: Level, v: Any) -> float | None:
    """The value of a scalar made of literals alone (``1 / jnp.sqrt(64.0)``, a broadcast of
    one), else ``None``."""
    value: np.ndarray | None
    if isinstance(v, Literal):
        value = np.asarray(v.val)
    elif math.prod(v.aval.shape) != 1 and not _is_broadcast_scalar(level, v):
        return None
    else:
        value = _constant_value(level, v)
        if value is None:
            return None
    flat = np.unique(np.asarray(value, np.float64))
    return float(flat[0]) if flat.size == 1 else None


def _is_broadcast_scalar(level: Level, v: Any) -> bool:
    _, eqn = _producer(level, v)
    return (eqn is not None and eqn.primitive.name == "broadcast_in_dim"
            and math.prod(getattr(eqn.invars[0].aval, "shape", ())) == 1)


def _reaches_matmul(level: Level, v: Any, depth: int = 12) -> bool:
    """Whether ``v`` comes from a ``dot_general`` through at most ``depth`` elementwise
    equations of the scores (the side of an addition that is the scores)."""
    for _ in range(depth):
        _, eqn = _producer(level, v)
        if eqn is None:
            return False
        if eqn.primitive.name == "dot_general":
            return True
        where = _where(eqn)
        if where is not None:
            v = where[1]
            continue
        if eqn.primitive.name in ("mul", "div", "add", "sub", "select_n", *_CASTS):
            v = eqn.invars[-1] if eqn.primitive.name == "select_n" else eqn.invars[0]
            if eqn.primitive.name == "add" and not _reaches_matmul(level, v, depth - 1):
                v = eqn.invars[1]
            continue
        return False
    return False


def _scores(level: Level, s: Any, seen: list[int]) -> tuple | None:
    """``(dot_general index, axes, scale, biases, masks)`` of the scores ``s``: ``axes[a]``
    is the ``dot_general`` output's axis that ``s``'s axis ``a`` is (a transpose right after
    the matmul, an einsum's, allowed)."""
    scale, biases, masks = 1.0, [], []  # type: ignore[var-annotated]
    axes = list(range(s.aval.ndim))
    transposed = False
    for _ in range(32):
        i, eqn = _producer(level, s)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "dot_general":
            return i, axes, scale, biases, masks
        seen.append(i)
        if name in _CASTS:
            s = eqn.invars[0]
        elif name == "transpose":
            perm = eqn.params["permutation"]
            axes = [perm[a] for a in axes]
            transposed = True
            s = eqn.invars[0]
        elif name in ("mul", "div"):
            c = _scalar(level, eqn.invars[1])
            if c is None and name == "mul":
                c, s = _scalar(level, eqn.invars[0]), eqn.invars[1]
            else:
                s = eqn.invars[0]
            if c is None or c <= 0.0:
                return None
            scale *= c if name == "mul" else 1.0 / c
        elif transposed:  # a bias or a mask before a transpose: another layout
            return None
        elif name == "add":
            a, b = eqn.invars
            if not _reaches_matmul(level, a):
                a, b = b, a
            # Not a bias added before a scale (walking back, a scale already seen).
            if isinstance(b, Literal) or not _reaches_matmul(level, a) or scale != 1.0:
                return None
            biases.append(b)
            s = a
        elif _where(eqn) is not None or (name == "select_n" and len(eqn.invars) == 3):
            pred, kept, masked = _where(eqn) or (eqn.invars[0], eqn.invars[2], eqn.invars[1])
            big = _scalar(level, masked)
            if (big is None or big > -1e4 or isinstance(pred, Literal)
                    or pred.aval.dtype != jnp.bool_ or kept.aval.shape != s.aval.shape):
                return None
            masks.append(pred)
            s = kept
        else:
            return None
    return None


def _match(level: Level, j: int, side: int) -> Structure | str | None:
    """The attention of equation ``j`` with the probabilities as operand ``side``; a reason
    where a softmax feeds it but the chain is not one; ``None`` where no softmax does."""
    out_eqn = level.eqns[j]
    (lc, rc), (lb, rb) = out_eqn.params["dimension_numbers"]
    probs_v, value = out_eqn.invars[side], out_eqn.invars[1 - side]
    pc, vc = (lc, rc) if side == 0 else (rc, lc)
    pb, vb = (lb, rb) if side == 0 else (rb, lb)
    if (len(pc) != 1 or len(vc) != 1 or isinstance(probs_v, Literal)
            or isinstance(value, Literal)):
        return None
    seen: list[int] = [j]
    found = _softmax(level, probs_v, seen)
    if found is None:
        return None
    s, axis = found
    if axis != pc[0] or tuple(s.aval.shape) != tuple(probs_v.aval.shape):
        return "the softmax is over another axis than the one the second matmul contracts"
    scores = _scores(level, s, seen)
    if scores is None:
        return ("the softmax's input is not a matmul's scores, scaled, with a bias added after "
                "the scale, or masked")
    i, axes, scale, biases, masks = scores
    seen.append(i)
    d1 = level.eqns[i]
    # The scores' matmul: which of its output axes are batch, the query's rows, the key.
    (c0, c1), (b0, b1) = d1.params["dimension_numbers"]
    if len(c0) != 1:
        return "the scores' matmul contracts more than one axis"
    nb = len(b0)
    free0 = [d for d in range(d1.invars[0].aval.ndim) if d not in b0 and d not in c0]
    free1 = [d for d in range(d1.invars[1].aval.ndim) if d not in b1 and d not in c1]
    # The dot_general's output: batch axes, then operand 0's free axes, then operand 1's.
    owner = [("b", k) for k in range(nb)] + [(0, d) for d in free0] + [(1, d) for d in free1]
    key_side, key_dim = owner[axes[axis]] if owner[axes[axis]][0] != "b" else (None, None)
    if key_side is None or len(free1 if key_side == 1 else free0) != 1:
        return "the softmax is over a batch axis of the scores"
    query, key = d1.invars[1 - key_side], d1.invars[key_side]
    qb, kb = (b1, b0) if key_side == 0 else (b0, b1)
    qc, kc = (c1, c0) if key_side == 0 else (c0, c1)
    batch_axes = [a for a in range(len(axes)) if owner[axes[a]][0] == "b"]
    row_axes = [a for a in range(len(axes)) if owner[axes[a]][0] == 1 - key_side]
    if not row_axes or isinstance(query, Literal) or isinstance(key, Literal):
        return "the query has no axis of positions"
    # The probabilities' matmul: batched over the scores' batch axes, its free axes the rows.
    if sorted(pb) != batch_axes or len(vb) != len(pb):
        return "the second matmul is not batched as the scores"
    p_free = [a for a in range(len(axes)) if a not in pb and a != axis]
    v_free = [d for d in range(value.aval.ndim) if d not in vb and d not in vc]
    if p_free != row_axes or len(v_free) != 1:
        return "the second matmul's free axes are not the query's"
    # Scaled query: ``(q * c) @ k``.
    q_seen: list[int] = []
    qi, qeqn = _producer(level, query)
    if qeqn is not None and qeqn.primitive.name in ("mul", "div"):
        c = _scalar(level, qeqn.invars[1])
        if c is not None and c > 0.0:
            scale *= c if qeqn.primitive.name == "mul" else 1.0 / c
            query = qeqn.invars[0]
            q_seen.append(qi)
    members = set(seen) | set(q_seen)
    if not _closed(level, members, j):
        return "a value inside the chain is read elsewhere (the scores or the probabilities kept)"
    before = _before(level, members)
    if before is None:
        return "what the chain reads is made after it, or with an effect"
    s_shape = tuple(s.aval.shape)
    causal, seq_axis, kept_masks = _causal(level, masks, s_shape, row_axes, axis)
    groups = [a for a in row_axes if a != seq_axis]
    # The heads: the last batch axis, the key's and value's heads; the query's grouped rows
    # its heads' groups (grouped-query attention). The other batch axes are the batch.
    heads = batch_axes[-1:]
    batch = batch_axes[:-1]

    def q_dim(a):
        return qb[owner[axes[a]][1]] if a in batch_axes else owner[axes[a]][1]

    def k_dim(a):
        return kb[owner[axes[a]][1]]

    def v_dim(a):
        return vb[list(pb).index(a)]
    layout = _Layout(
        s_shape=s_shape, batch=tuple(batch), seq=seq_axis, heads=tuple(heads),
        groups=tuple(groups), key_axis=axis,
        q_dims=tuple([q_dim(a) for a in (*batch, seq_axis, *heads, *groups)] + list(qc)),
        k_dims=tuple([k_dim(a) for a in batch] + [owner[axes[axis]][1]]
                     + [k_dim(a) for a in heads] + list(kc)),
        v_dims=tuple([v_dim(a) for a in batch] + list(vc) + [v_dim(a) for a in heads]
                     + v_free),
        out_batch=tuple(pb), side=side, out_shape=tuple(out_eqn.outvars[0].aval.shape))
    return Structure(d1, query, key, value, scale, tuple(biases), tuple(kept_masks), causal,
                     layout.arrange(len(biases)), layout.restore, tuple(sorted(members)),
                     before)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the attention's axes are in the scores (``s_shape``): the batch, the query's
    positions (``seq``), the heads (of the key and value) and the query's groups of them,
    and the keys; and the order of each operand's axes that gives
    ``jax.nn.dot_product_attention``'s ``[batch, positions, heads, head size]``."""

    s_shape: tuple[int, ...]
    batch: tuple[int, ...]
    seq: int
    heads: tuple[int, ...]
    groups: tuple[int, ...]
    key_axis: int
    q_dims: tuple[int, ...]   # the query's axes: batch, positions, heads, groups, head size
    k_dims: tuple[int, ...]   # the key's: batch, keys, heads, head size
    v_dims: tuple[int, ...]   # the value's: batch, keys, heads, its head size
    out_batch: tuple[int, ...]  # the scores' batch axes in the second matmul's order
    side: int                 # 0: probabilities @ value; 1: value @ probabilities
    out_shape: tuple[int, ...]

    def _size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.s_shape[a] for a in axes)

    def arrange(self, biases: int) -> Callable[..., tuple]:
        b, t, n = self._size(self.batch), self.s_shape[self.seq], self.s_shape[self.key_axis]
        k_heads, heads = self._size(self.heads), self._size(self.heads + self.groups)
        order = (*self.batch, *self.heads, *self.groups, self.seq, self.key_axis)

        def scores_like(x):  # a bias or a mask, as [B, N, T, S]
            return jnp.transpose(jnp.broadcast_to(x, self.s_shape), order).reshape(
                b, heads, t, n)

        def arrange(q, k, v, *rest):
            q = jnp.transpose(q, self.q_dims).reshape(b, t, heads, -1)
            k = jnp.transpose(k, self.k_dims).reshape(b, n, k_heads, -1)
            v = jnp.transpose(v, self.v_dims).reshape(b, n, k_heads, -1)
            bias = mask = None
            for x in rest[:biases]:
                bias = scores_like(x) if bias is None else bias + scores_like(x)
            for x in rest[biases:]:
                mask = scores_like(x) if mask is None else mask & scores_like(x)
            return q, k, v, bias, mask
        return arrange

    def restore(self, out: Any) -> Any:
        """``[B, T, N, Hv]`` back to the second matmul's output."""
        s = self.s_shape
        named = (*self.batch, self.seq, *self.heads, *self.groups)
        out = out.reshape(*[s[a] for a in named], out.shape[-1])
        # The matmul's output: its batch axes in its order, then the rows (the query's free
        # axes in the scores' order) and the head size, or the head size and the rows.
        rows = sorted((self.seq, *self.groups))
        batch = [named.index(a) for a in self.out_batch]
        free = [named.index(a) for a in rows]
        head = [out.ndim - 1]
        out = jnp.transpose(out, batch + (free + head if self.side == 0 else head + free))
        return out.reshape(self.out_shape)


def _closed(level: Level, members: set[int], j: int) -> bool:
    """Whether no value made inside the chain is read outside it, but its output."""
    for i in members:
        if i == j:
            continue
        for v in level.eqns[i].outvars:
            if v in level.outvars or any(c not in members for c in level.consumers.get(v, ())):
                return False
    return True


def _before(level: Level, members: set[int]) -> tuple[int, ...] | None:
    """The equations between the chain's first and last that make what it reads (a mask made
    after the scores), to run before it; ``None`` where one reads the chain or has an
    effect."""
    first, last = min(members), max(members)
    made = {v for i in members for v in level.eqns[i].outvars}
    before: set[int] = set()
    stack = [v for i in members for v in level.eqns[i].invars
             if not isinstance(v, Literal) and v not in made]
    while stack:
        k = level.producer.get(stack.pop())
        if k is None or k < first or k in before:
            continue
        eqn = level.eqns[k]
        if k > last or eqn.effects or any(not isinstance(v, Literal) and v in made
                                          for v in eqn.invars):
            return None
        before.add(k)
        stack.extend(v for v in eqn.invars if not isinstance(v, Literal))
    return tuple(sorted(before))


def _causal(level: Level, masks: list, s_shape: tuple, row_axes: list,
            key_axis: int) -> tuple[bool, int, list]:
    """``(causal, the query's positions, the masks kept)``: a mask that is a compile-time lower
    triangle over one of the query's row axes and the keys, the same along every other axis
    (a causal mask from ``iota``), is left out for ``is_causal``, and that row axis is the
    query's positions (else its last row axis)."""
    kept, causal, seq = [], False, row_axes[-1]
    for m in masks:
        value = _constant_value(level, m)
        if value is not None and not causal:
            full = np.broadcast_to(value, s_shape)
            for r in row_axes:
                rest = [a for a in range(len(s_shape)) if a not in (r, key_axis)]
                square = np.transpose(full, (*rest, r, key_axis))
                t, n = square.shape[-2:]
                if t == n and np.all(square == np.tril(np.ones((t, n), bool))):
                    causal, seq = True, r
                    break
            if causal:
                continue
        kept.append(m)
    return causal, seq, kept


def _constant_value(level: Level, v: Any, budget: int = 64) -> np.ndarray | None:
    """``v``'s value where the equations that make it read nothing but literals (``iota``,
    comparisons, broadcasts), evaluated now; else ``None``."""
    order: list[int] = []

    def collect(x: Any) -> bool:
        if isinstance(x, Literal):
            return True
        i = level.producer.get(x)
        if i is None or len(order) > budget:
            return False
        eqn = level.eqns[i]
        if eqn.effects:
            return False
        if i not in order:
            if not all(collect(u) for u in eqn.invars):
                return False
            order.append(i)
        return True
    if not collect(v) or math.prod(v.aval.shape) > 1 << 24:
        return None
    env: dict = {}

    def read(x):
        return x.val if isinstance(x, Literal) else env[x]
    try:
        with jax.ensure_compile_time_eval():
            for i in order:
                eqn = level.eqns[i]
                ins = [read(u) for u in eqn.invars]
                if eqn.primitive.name == "pvary":  # inside shard_map: the value as it is
                    outs = ins
                else:
                    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                    outs = outs if eqn.primitive.multiple_results else [outs]
                env.update(zip(eqn.outvars, outs, strict=True))
    except Exception:  # noqa: BLE001 - what cannot be evaluated now is no constant
        return None
    return np.asarray(env[v])


def reference(structure: Structure, q: Any, k: Any, v: Any, *rest: Any,
              implementation: Any = "xla") -> Any:
    """The attention of ``structure`` computed by ``jax.nn.dot_product_attention`` from the
    chain's inputs, in the layout of the chain's output: what runs fused on a GPU."""
    q, k, v, bias, mask = structure.arrange(q, k, v, *rest)
    out = jax.nn.dot_product_attention(q, k, v, bias, mask, scale=structure.scale,
                                       is_causal=structure.causal,
                                       implementation=implementation)
    return structure.restore(out)


__all__ = ["Structure", "find", "reference"]
