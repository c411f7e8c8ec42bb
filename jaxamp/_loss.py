"""The loss function's contract, shared by the train step and the overflow diagnosis (private)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_loss(loss: Any, *, scalar: str = "loss_fn must return a scalar loss",
               floating: str = "loss_fn must return a floating loss") -> jax.Array:
    """``loss`` as an fp32 scalar, or a clear error that starts with ``scalar`` or
    ``floating`` (the caller's own words for its argument)."""
    loss = jnp.asarray(loss)
    if loss.ndim != 0:
        raise ValueError(f"{scalar}, got shape {loss.shape}; reduce it with jnp.mean "
                         "(per-example losses are averaged by you)")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"{floating}, got dtype {loss.dtype}: an integer or bool loss has no "
                        "gradient; compute it from the model's floating outputs, in float32")
    return loss.astype(jnp.float32)


def described(out: Any) -> str:
    """What a loss function returned, for an error message: a tuple's length, an array's dtype
    and shape, or the type."""
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"a single {jnp.dtype(out.dtype).name}{list(out.shape)} array"
    return type(out).__name__


def split_outputs(out: Any, has_aux: bool, has_model_state: bool) -> tuple[Any, Any, Any]:
    """Unpacks ``loss``, ``(loss, aux)``, ``(loss, model_state)`` or ``(loss, state, aux)``."""
    expected = 1 + has_aux + has_model_state
    if expected == 1 and isinstance(out, tuple):
        raise ValueError(f"loss_fn returned a tuple of {len(out)} with has_aux=False and "
                         "has_model_state=False, where the loss alone is expected: a (loss, "
                         "aux) tuple needs has_aux=True, (loss, new_model_state) "
                         "has_model_state=True, (loss, new_model_state, aux) both")
    if expected == 1:
        return out, None, None
    if not isinstance(out, tuple) or len(out) != expected:
        shape = {(True, False): "(loss, aux)", (False, True): "(loss, new_model_state)",
                 (True, True): "(loss, new_model_state, aux)"}[(has_aux, has_model_state)]
        raise ValueError(f"loss_fn must return {shape} with has_aux={has_aux} and "
                         f"has_model_state={has_model_state}; got {described(out)}. Return that "
                         "tuple, or set the flags to what loss_fn returns")
    loss = out[0]
    model_state = out[1] if has_model_state else None
    aux = out[-1] if has_aux else None
    return loss, model_state, aux
