"""Checkpoints of a run: orbax's ``CheckpointManager`` over ``workdir/checkpoints``, with two
items per step, ``state`` (the whole ``jaxamp.TrainState``) and ``data`` (the position of the
batches consumed).

Crash safety: orbax writes each checkpoint into a temporary directory and renames it when it is
complete, so a run killed at any point (even with SIGKILL, mid-write) resumes from the latest
complete checkpoint. Every process takes part in a save.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxamp


class CheckpointMismatch(ValueError):
    """``--resume`` found a checkpoint written for another model or state layout."""


def _leaf_specs(tree: Any) -> dict[str, str]:
    """``{'params/head/kernel': 'float16[16, 10]', ...}`` for the array leaves of ``tree``."""
    return {jaxamp.gradients.tree_path_str(path): f"{np.dtype(x.dtype).name}{list(x.shape)}"
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}


def check_checkpoint_matches(path: str, state: Any) -> None:
    """Raises :class:`CheckpointMismatch` unless the saved state at ``path`` has the leaves,
    shapes and dtypes of ``state``. Reads only the checkpoint's metadata."""
    # The item's own handler: a StandardCheckpointer looks for a step's _CHECKPOINT_METADATA in
    # the item's folder (the manager writes it one level up) and logs a warning at each resume.
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
    meta = getattr(meta, "item_metadata", meta)
    saved, wanted = _leaf_specs(getattr(meta, "tree", meta)), _leaf_specs(state)
    diffs = [f"{k!r} is {saved[k]} in the checkpoint but {wanted[k]} in this run"
             for k in wanted if k in saved and saved[k] != wanted[k]]
    diffs += [f"{k!r} is missing from the checkpoint" for k in wanted if k not in saved]
    diffs += [f"{k!r} is in the checkpoint but not in this run" for k in saved if k not in wanted]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise CheckpointMismatch(
            f"--resume: the checkpoint {path} was written by another model or state layout: "
            f"{'; '.join(diffs[:3])}{more}. Resume with the --config, --model and --precision "
            "it was written with, or train afresh in another --workdir.")


def manager(workdir: str, *, keep: int) -> ocp.CheckpointManager:
    """The run's checkpoint manager, keeping the latest ``keep`` checkpoints."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(directory(workdir), options=options,
                                 item_names=("state", "data"))


def directory(workdir: str) -> str:
    return os.path.abspath(os.path.join(workdir, "checkpoints"))


def restore_latest(checkpoints: ocp.CheckpointManager, state: Any,
                   batches: Any) -> tuple[Any, int]:
    """``(state, step)`` of the latest complete checkpoint, with ``batches`` moved to its data
    position; ``(state, 0)`` untouched when there is none.

    Raises :class:`CheckpointMismatch` (and closes the manager) when the checkpoint's layout is
    not ``state``'s.
    """
    # latest_step() only sees committed checkpoints: a write cut short (a kill, a crash) leaves
    # a "<step>.orbax-checkpoint-tmp" directory that is never loaded and is replaced on save.
    step = checkpoints.latest_step()
    if step is None:
        return state, 0
    step = int(step)
    path = os.path.join(str(checkpoints.directory), str(step), "state")
    try:
        check_checkpoint_matches(path, state)
    except CheckpointMismatch:
        checkpoints.close()
        raise
    restored = checkpoints.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), data=ocp.args.JsonRestore()))
    batches.restore(tuple(restored.data))
    return restored.state, step


def save(checkpoints: ocp.CheckpointManager, step: int, state: Any, data_position: Any) -> None:
    """Saves ``state`` and the data position at ``step`` and waits until it is committed."""
    checkpoints.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(list(data_position))),
        force=True)
    checkpoints.wait_until_finished()
