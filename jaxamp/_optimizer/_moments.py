"""The inner optimizer's moments stored in fewer bytes: ``moments_dtype=`` of
:func:`jaxamp.mixed_precision`, and :func:`quantized_moments`.

A moment is a floating array of rank >= 1 in the inner optimizer's state (Adam's ``mu`` and
``nu``, any per-parameter buffer). Between steps it is kept in one of three formats, and the
inner optimizer always computes on fp32 copies:

- ``"float32"``: as it is.
- ``"bfloat16"``: rounded stochastically (:func:`jaxamp.rounding.stochastic_round`), 2 bytes.
  Rounding to the nearest would freeze a second moment: at ``b2 = 0.999`` its per-step decay,
  0.1%, is below half a bf16 ulp (0.2-0.4%), so ``nu`` can only go up (the ratchet, measured
  by ``python -m benchmarks moments``: 2x the fp32 average on stationary gradients, 31x while
  they shrink 55x). Stochastic rounding is unbiased; it adds 4-6% relative noise to ``nu`` at
  ``b2 = 0.999`` (1.7-1.9% at 0.99), about the noise of ``nu``'s own average.
- ``"8bit"``: block-wise 8-bit quantization (Dettmers et al., 2022): each block of
  ``block_size`` consecutive values (the flattened array, zero-padded) keeps one fp32 absmax and
  one uint8 code per value, an index into a dynamic map (:func:`jaxamp.rounding.dynamic_map`),
  rounded to the nearest: 1 + 4 / ``block_size`` bytes. A second moment (the field ``nu``) takes
  the unsigned map, which has no zero: a small ``nu`` in a block with a large one becomes
  ``1e-7`` of the block's max, not 0, so its update is never divided by ``eps`` alone. Every
  other moment takes the signed map. Moments of fewer than ``min_size`` values stay fp32 (the
  norms' scales and the biases: a few KB). The largest value of each block is kept exactly (the
  fp32 absmax), and every other value of the block moves with it, so a decaying block decays.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any
from typing import cast

import jax
import jax.numpy as jnp
import optax

from jaxamp._optimizer._rounding import Blockwise8bit
from jaxamp._optimizer._rounding import dequantize_blockwise
from jaxamp._optimizer._rounding import quantize_blockwise
from jaxamp._optimizer._rounding import stochastic_round
from jaxamp._tree import is_floating_array

__all__ = ["FORMATS", "Moments", "parse_moments", "quantized_moments", "stored_moments",
           "warn_half_second_moments"]

FORMATS = ("float32", "bfloat16", "8bit")
"""The formats a moment can be stored in between steps."""

SECOND_MOMENTS = ("nu",)
"""The state fields that hold second moments (optax's adam family): the 8-bit format gives them
the unsigned map without zero."""

BLOCK_SIZE = 256
MIN_SIZE = 4096


def _is_moment(x: Any) -> bool:
    """A per-parameter buffer of the inner state (a moment): a floating array of rank >= 1.
    Scalars (an injected learning rate, a schedule's value) keep their dtype."""
    return is_floating_array(x) and getattr(x, "ndim", 0) >= 1


def _is_stored(x: Any) -> bool:
    return isinstance(x, Blockwise8bit)


def _field_names(path: tuple) -> list[str]:
    """The state fields a leaf sits in: the attribute names on its path (NamedTuple fields,
    such as ``mu`` or ``nu`` of optax's ``ScaleByAdamState``, under ``inner_state`` of
    ``inject_hyperparams``'s)."""
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def _is_second_moment(path: tuple) -> bool:
    return any(name in SECOND_MOMENTS for name in _field_names(path))


@dataclasses.dataclass(frozen=True)
class Moments:
    """How each moment is stored: ``everywhere`` for every moment, or ``fields`` per state field
    (the moments of the fields not named keep the dtype ``inner`` builds)."""

    everywhere: str | None = None
    fields: tuple[tuple[str, str], ...] = ()
    block_size: int = BLOCK_SIZE
    min_size: int = MIN_SIZE

    def format_of(self, path: tuple, x: Any) -> str | None:
        """The format of the leaf at ``path``, or None (kept as ``inner`` builds it)."""
        if _is_stored(x):
            return "8bit"
        if not _is_moment(x):
            return None
        fmt = self.everywhere
        names = _field_names(path)
        for field, f in self.fields:
            if field in names:
                fmt = f
                break
        if fmt == "8bit" and math.prod(x.shape) < self.min_size:
            return "float32"
        return fmt

    @property
    def formats(self) -> set[str]:
        return {f for f in (self.everywhere, *(f for _, f in self.fields)) if f is not None}

    @property
    def rounds_stochastically(self) -> bool:
        return "bfloat16" in self.formats

    def __str__(self) -> str:
        if self.everywhere is not None:
            return repr(self.everywhere)
        return repr(dict(self.fields))


def _check_format(value: Any, where: str) -> str:
    name = value
    if not (isinstance(value, str) and value in FORMATS):
        try:
            name = jnp.dtype(value).name
        except TypeError:
            name = None
    if name not in FORMATS:
        raise ValueError(
            f"{where} must be one of {', '.join(map(repr, FORMATS))}, got {value!r}: "
            "'float32' keeps the moments as they are, 'bfloat16' stores them in bf16 (rounded "
            "stochastically), '8bit' in block-wise 8-bit codes; float16 moments would overflow "
            "with the squared gradients")
    return name


def parse_moments(value: Any, *, block_size: int = BLOCK_SIZE,
                  min_size: int = MIN_SIZE) -> Moments | None:
    """``moments_dtype=`` as given: None, a format (``"float32"``, ``"bfloat16"``,
    ``"8bit"``, or a dtype) for every moment, or a mapping from state fields to formats."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be an int >= 0, got {min_size!r}")
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) for k in value):
            raise ValueError(
                f"moments_dtype as a mapping takes the inner state's field names to formats, "
                f"e.g. {{'mu': 'bfloat16'}} (Adam's first moment in bf16, nu in fp32); got "
                f"{value!r}")
        fields = tuple((k, _check_format(v, f"moments_dtype[{k!r}]")) for k, v in value.items())
        return Moments(fields=fields, block_size=block_size, min_size=min_size)
    return Moments(everywhere=_check_format(value, "moments_dtype"), block_size=block_size,
                   min_size=min_size)


def _store(fmt: str | None, x: Any, path: tuple, key: Any, block_size: int) -> Any:
    """``x`` (fp32) kept in ``fmt``."""
    if fmt is None:
        return x
    if fmt == "float32":
        return x.astype(jnp.float32)
    if fmt == "bfloat16":
        if key is None:
            return x.astype(jnp.bfloat16)  # at init: the nearest
        return stochastic_round(x, jnp.bfloat16, key)
    return quantize_blockwise(x, signed=not _is_second_moment(path), block_size=block_size)


def _load(x: Any) -> Any:
    """A stored moment as fp32; every other leaf as it is."""
    if _is_stored(x):
        return dequantize_blockwise(x)
    return x.astype(jnp.float32) if _is_moment(x) else x


def _check_fields(moments: Moments, state: Any) -> None:
    """Every field ``moments`` names must hold moments in the inner state."""
    found = set()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if _is_moment(x):
            found.update(_field_names(path))
    missing = [f for f, _ in moments.fields if f not in found]
    if missing:
        raise ValueError(
            f"moments_dtype names the field(s) {', '.join(map(repr, missing))}, which hold no "
            f"moments in the inner optimizer's state; its moments are in "
            f"{', '.join(map(repr, sorted(found))) or 'no field'} (for optax's adam family, "
            "'mu' is the first moment and 'nu' the second)")


def warn_half_second_moments(state: Any, moments: Moments | None = None) -> None:
    """Warns where the inner optimizer keeps a second moment (a ``nu`` field) in bf16 or fp16
    itself, and ``moments`` does not store it: it rounds it to the nearest on every step,
    where ``nu`` ratchets up."""
    for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_stored)[0]:
        if moments is not None and moments.format_of(path, x) is not None:
            continue
        if _is_moment(x) and jnp.dtype(x.dtype).itemsize < 4 and _is_second_moment(path):
            warnings.warn(
                f"the inner optimizer keeps its second moment {jax.tree_util.keystr(path)} in "
                f"{jnp.dtype(x.dtype).name} and rounds it to the nearest on every step: at "
                "b2 >= 0.995 its decay per step is below half an ulp, so it can only grow "
                "(2x the fp32 value on stationary gradients at b2 = 0.999). Let "
                "jaxamp.mixed_precision store it: moments_dtype={'nu': 'bfloat16'} rounds it "
                "stochastically, computing in fp32", UserWarning, stacklevel=4)
            return


def stored_moments(inner: optax.GradientTransformationExtraArgs,
                   moments: Moments) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its moments stored as ``moments`` says and computed with in fp32.
    bf16 moments are rounded stochastically on update, with the ``rounding_key`` extra argument
    (a PRNG key, required for bf16), and to the nearest at init."""

    def formats(state):
        # The stored state's leaves (a quantized moment is one), each with its format.
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_stored)
        return [(path, x, moments.format_of(path, x)) for path, x in leaves], treedef

    def init(params):
        state = inner.init(params)
        _check_fields(moments, state)
        warn_half_second_moments(state, moments)
        leaves, treedef = formats(state)
        return jax.tree.unflatten(treedef, [_store(f, x, p, None, moments.block_size)
                                            for p, x, f in leaves])

    def update(updates, state, params=None, *, rounding_key=None, **extra_args):
        if moments.rounds_stochastically and rounding_key is None:
            raise ValueError("bf16 moments are rounded stochastically: pass update(..., "
                             "rounding_key=key), a PRNG key for this step")
        leaves, treedef = formats(state)
        loaded = jax.tree.map(_load, state, is_leaf=_is_stored)
        updates, new = inner.update(updates, loaded, params, **extra_args)
        out = []
        for j, ((path, old, fmt), x) in enumerate(zip(leaves, jax.tree.leaves(new), strict=True)):
            key = None if rounding_key is None else jax.random.fold_in(rounding_key, j)
            if fmt is None:
                out.append(x.astype(old.dtype) if hasattr(old, "dtype") else x)
            else:
                out.append(_store(fmt, x, path, key, moments.block_size))
        return updates, jax.tree.unflatten(treedef, out)

    return optax.GradientTransformationExtraArgs(init, update)


def quantized_moments(inner: optax.GradientTransformation, *, block_size: int = BLOCK_SIZE,
                      min_size: int = MIN_SIZE) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its moments kept in block-wise 8-bit codes between steps.

    Each moment of ``min_size`` values or more (a floating array of rank >= 1 in ``inner``'s
    state: Adam's ``mu`` and ``nu``) is stored as a :class:`jaxamp.rounding.Blockwise8bit`:
    one uint8 code per value into a dynamic map and one fp32 absmax per block of ``block_size``
    values, 1 + 4 / ``block_size`` bytes per value against fp32's 4. ``inner`` computes on the
    fp32 values (:func:`jaxamp.rounding.dequantize_blockwise`), and its new moments are
    quantized again, to the nearest code. Second moments (the field ``nu``) take the unsigned
    map, which has no zero; every other moment the signed map. Deterministic: a resumed run
    repeats the same codes.

    It composes as an optax transform: inside :func:`jaxamp.mixed_precision` (which also takes
    ``moments_dtype="8bit"`` for the same thing), with ``optax.MultiSteps``, the skip of a
    non-finite step, the sharded state of ``jaxamp.parallel`` and checkpoints (the state's
    leaves are arrays: the codes, uint8 of shape ``(blocks, block_size)``, and the absmax).

    Args:
      inner: any optax transform (typically ``optax.adamw``).
      block_size: the values per block (default 256; a block's absmax sets its scale).
      min_size: moments with fewer values stay fp32 (default 4096: a norm's scale, a bias).

    >>> import jax.numpy as jnp, optax
    >>> tx = quantized_moments(optax.adam(1e-3), min_size=0)
    >>> state = tx.init({"w": jnp.ones((4, 300))})
    >>> mu = state[0].mu["w"]
    >>> mu.codes.dtype.name, mu.codes.shape, mu.absmax.shape
    ('uint8', (5, 256), (5,))
    >>> updates, state = tx.update({"w": jnp.full((4, 300), 0.5)}, state)
    >>> round(float(dequantize_blockwise(state[0].nu["w"])[0, 0]), 8)  # (1 - b2) * 0.5**2
    0.00025
    """
    moments = cast(Moments, parse_moments("8bit", block_size=block_size, min_size=min_size))
    return stored_moments(optax.with_extra_args_support(inner), moments)
