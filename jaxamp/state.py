"""The state of :func:`jaxamp.mixed_precision`, and reading it in a train step written by hand.

The state sits anywhere in an optimizer state (under ``optax.chain``, ``inject_hyperparams``,
``MultiSteps``): :func:`find_state` finds the :class:`MixedPrecisionState`, and the others read
it. :func:`scale_loss` and :func:`next_working_params` are the two calls a hand-written step
makes around ``tx.update`` (:func:`jaxamp.make_train_step` makes them itself);
:func:`get_master_params` gives the fp32 params to evaluate or to export. :data:`MASTERS` lists
where the master can live (``mixed_precision(..., master=...)``).
"""

from jaxamp._optimizer._state import MixedPrecisionState
from jaxamp._optimizer._state import find_state
from jaxamp._optimizer._state import get_loss_scale
from jaxamp._optimizer._state import get_master_params
from jaxamp._optimizer._state import next_working_params
from jaxamp._optimizer._state import policy_of
from jaxamp._optimizer._state import scale_loss
from jaxamp._optimizer._state import working_params
from jaxamp._optimizer._storage import MASTERS

__all__ = ["MASTERS", "MixedPrecisionState", "find_state", "get_loss_scale", "get_master_params",
           "next_working_params", "policy_of", "scale_loss", "working_params"]
