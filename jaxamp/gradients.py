"""Gradient statistics: one pass over the gradients gives the finite check, the global norm and
the per-leaf diagnosis (:func:`grad_stats`), and :func:`nonfinite_leaf_path` names the leaf;
:func:`all_finite` is the finite check alone, :func:`tree_path_str` the path of a leaf as the
diagnostics write it.

Both count leaves with the same predicate (``jaxamp._tree.is_floating``), so the index that
``grad_stats`` reports always maps back to the right path.
"""

from jaxamp._optimizer._gradients import GradStats
from jaxamp._optimizer._gradients import all_finite
from jaxamp._optimizer._gradients import grad_stats
from jaxamp._optimizer._gradients import nonfinite_leaf_path
from jaxamp._optimizer._gradients import tree_path_str

__all__ = ["GradStats", "all_finite", "grad_stats", "nonfinite_leaf_path", "tree_path_str"]
