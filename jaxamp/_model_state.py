"""Model state that the train step differentiates and updates itself: the hooks (private).

A kind of node in the model state (FP8's :class:`~jaxamp.fp8.Fp8State`) registers a
:class:`Hook`. The train step then, without naming the kind:

1. hands ``loss_fn`` each node as :attr:`Hook.hand` makes it for this step's loss scale, and
   differentiates the loss with respect to the handed nodes;
2. reads from each node's cotangent what its step saw (:attr:`Hook.seen`), combined over
   micro-batches and devices by a maximum;
3. updates each node from it (:attr:`Hook.update`), in the new model state, which an applied
   step keeps and a skipped one drops.

While ``loss_fn`` is traced, :attr:`Hook.recording` collects the nodes that ran: a node that
ran but is not in the model state would never be updated, which is an error
(:attr:`Hook.untracked`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax

__all__ = ["Hook", "find", "hand", "nothing_seen", "recording", "register", "replace", "seen",
           "update"]


@dataclasses.dataclass(frozen=True)
class Hook:
    """How the train step treats one kind of model-state node."""

    is_node: Callable[[Any], bool]
    """Whether a pytree node is of this kind."""
    hand: Callable[[Any, jax.Array], Any]
    """``(node, loss scale) -> node`` as ``loss_fn`` receives it."""
    seen: Callable[[Any, jax.Array], jax.Array]
    """``(cotangent of the handed node, loss scale) -> what the step saw``."""
    update: Callable[[Any, jax.Array], Any]
    """``(node, seen) -> node`` after the step."""
    nothing_seen: Callable[[Any], jax.Array]
    """``node -> seen`` of a step where the node did not run (zeros): the start of the
    maximum over micro-batches."""
    recording: Callable[[], contextlib.AbstractContextManager[list]]
    """A context that collects the nodes that ran while ``loss_fn`` was traced."""
    untracked: str
    """The error when nodes ran that are not in the model state."""


_HOOKS: list[Hook] = []


def register(hook: Hook) -> None:
    """Adds ``hook`` (once)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def _hook_of(x: Any) -> Hook | None:
    return next((h for h in _HOOKS if h.is_node(x)), None)


def _is_node(x: Any) -> bool:
    return _hook_of(x) is not None


def find(tree: Any) -> list:
    """Every hooked node in ``tree``, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_node) if _is_node(x)]


def replace(tree: Any, nodes: list, what: str = "the model state") -> Any:
    """``tree`` with its hooked nodes replaced, in tree order, by ``nodes``."""
    found = find(tree)
    if len(found) != len(nodes):
        raise ValueError(
            f"the model state holds {len(nodes)} node(s) the train step updates (such as "
            f"jaxamp.fp8.Fp8State) but {what} has {len(found)}; return the whole model "
            "state, e.g. nnx.state(model, ...) with the same filters as nnx.split")
    it = iter(nodes)
    return jax.tree.map(lambda x: next(it) if _is_node(x) else x, tree, is_leaf=_is_node)


def hand(nodes: list, scale: jax.Array) -> list:
    """The nodes as ``loss_fn`` receives them under the loss scale ``scale``."""
    return [_hook(n).hand(n, scale) for n in nodes]


def seen(nodes: list, cotangents: list, scale: jax.Array) -> list:
    """What each node's step saw, from the cotangents of the handed nodes."""
    return [_hook(n).seen(c, scale) for n, c in zip(nodes, cotangents, strict=True)]


def update(nodes: list, seen_values: list) -> list:
    """Each node after a step that saw ``seen_values``."""
    return [_hook(n).update(n, s) for n, s in zip(nodes, seen_values, strict=True)]


def nothing_seen(nodes: list) -> list:
    """What each node saw in a step where it did not run."""
    return [_hook(n).nothing_seen(n) for n in nodes]


def _hook(node: Any) -> Hook:
    hook = _hook_of(node)
    if hook is None:
        raise TypeError(f"{type(node).__name__} is not a node any model-state hook handles")
    return hook


@contextlib.contextmanager
def recording(tracked: bool) -> Iterator[None]:
    """Runs ``loss_fn``'s trace; raises when a hooked kind ran and the model state holds no
    node (``tracked`` False)."""
    with contextlib.ExitStack() as stack:
        calls = [(h, stack.enter_context(h.recording())) for h in _HOOKS]
        yield
    if not tracked:
        for hook, ran in calls:
            if ran:
                raise ValueError(hook.untracked)
