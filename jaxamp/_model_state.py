"""Model state that the train step differentiates and updates itself (private).

A kind of node in the model state (FP8's :class:`~jaxamp.fp8.Fp8State`) subclasses
:class:`Node`. The train step then, without naming the kind:

1. hands ``loss_fn`` each node as :meth:`Node.hand` makes it for this step's loss scale, and
   differentiates the loss with respect to the handed nodes;
2. reads from each node's cotangent what its step saw (:meth:`Node.seen`), combined over
   micro-batches and devices by a maximum;
3. updates each node from it (:meth:`Node.update`), in the new model state, which an applied
   step keeps and a skipped one drops.

While ``loss_fn`` is traced, :func:`recording` collects the nodes that ran (each calls
:func:`ran`): a node that ran but is not in the model state would never be updated, which is an
error (:attr:`Node.untracked`). A kind is a node by its class, so what a step does never
depends on which modules were imported.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any
from typing import ClassVar

import jax

__all__ = ["Node", "find", "hand", "nothing_seen", "ran", "recording", "replace", "seen",
           "update"]


class Node:
    """A kind of model-state node the train step differentiates and updates (a mixin of a
    pytree class)."""

    untracked: ClassVar[str] = "a model-state node ran that is not in the model state"
    """The error when a node of this kind ran while ``loss_fn`` was traced and the model state
    holds none."""

    def hand(self, scale: jax.Array) -> Any:
        """The node as ``loss_fn`` receives it under the loss scale ``scale``."""
        raise NotImplementedError

    def seen(self, scale: jax.Array) -> jax.Array:
        """What the step saw, read from ``self``, the cotangent of the handed node."""
        raise NotImplementedError

    def update(self, seen: jax.Array) -> Any:
        """The node after a step that saw ``seen``."""
        raise NotImplementedError

    def nothing_seen(self) -> jax.Array:
        """What a step where the node did not run saw (zeros): the start of the maximum over
        micro-batches."""
        raise NotImplementedError


def _is_node(x: Any) -> bool:
    return isinstance(x, Node)


def find(tree: Any, kind: type = Node) -> list:
    """Every node of ``kind`` in ``tree``, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_node) if isinstance(x, kind)]


def replace(tree: Any, nodes: list, what: str = "the model state", kind: type = Node) -> Any:
    """``tree`` with its nodes of ``kind`` replaced, in tree order, by ``nodes``."""
    found = find(tree, kind)
    if len(found) != len(nodes):
        raise ValueError(
            f"the model state holds {len(nodes)} node(s) the train step updates (such as "
            f"jaxamp.fp8.Fp8State) but {what} has {len(found)}; return the whole model "
            "state, e.g. nnx.state(model, ...) with the same filters as nnx.split")
    it = iter(nodes)
    return jax.tree.map(lambda x: next(it) if isinstance(x, kind) else x, tree,
                        is_leaf=_is_node)


def hand(nodes: list, scale: jax.Array) -> list:
    """The nodes as ``loss_fn`` receives them under the loss scale ``scale``."""
    return [n.hand(scale) for n in nodes]


def seen(nodes: list, cotangents: list, scale: jax.Array) -> list:
    """What each node's step saw, from the cotangents of the handed nodes."""
    return [c.seen(scale) for _, c in zip(nodes, cotangents, strict=True)]


def update(nodes: list, seen_values: list) -> list:
    """Each node after a step that saw ``seen_values``."""
    return [n.update(s) for n, s in zip(nodes, seen_values, strict=True)]


def nothing_seen(nodes: list) -> list:
    """What each node saw in a step where it did not run."""
    return [n.nothing_seen() for n in nodes]


# Trace-time only: the nodes that ran while a train step traced its loss.
_RAN: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxamp_nodes_ran",
                                                                   default=None)


def ran(node: Node) -> None:
    """Called by the code that runs a node (at trace time): notes it for :func:`recording`."""
    nodes = _RAN.get()
    if nodes is not None:
        nodes.append(node)


@contextlib.contextmanager
def recording(tracked: bool) -> Iterator[None]:
    """Runs ``loss_fn``'s trace; raises a node's :attr:`Node.untracked` when one ran and the
    model state holds none (``tracked`` False)."""
    nodes: list = []
    token = _RAN.set(nodes)
    try:
        yield
    finally:
        _RAN.reset(token)
    if nodes and not tracked:
        raise ValueError(type(nodes[0]).untracked)
