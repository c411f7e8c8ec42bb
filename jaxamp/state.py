"""Reading the state of :func:`jaxamp.mixed_precision` in a train step written by hand.

The state sits anywhere in an optimizer state (under ``optax.chain``, ``inject_hyperparams``,
``MultiSteps``): :func:`find_state` finds it, and the others read it. :func:`scale_loss` and
:func:`next_working_params` are the two calls a hand-written step makes around ``tx.update``
(:func:`jaxamp.make_train_step` makes them itself). ``find_state``, ``get_master_params`` and
``scale_loss`` are also at the top level, as ``jaxamp.find_state`` and so on.
"""

from jaxamp._master_weights import MixedPrecisionState
from jaxamp._master_weights import find_state
from jaxamp._master_weights import get_loss_scale
from jaxamp._master_weights import get_master_params
from jaxamp._master_weights import next_working_params
from jaxamp._master_weights import policy_of
from jaxamp._master_weights import scale_loss
from jaxamp._master_weights import working_params

__all__ = ["MixedPrecisionState", "find_state", "get_loss_scale", "get_master_params",
           "next_working_params", "policy_of", "scale_loss", "working_params"]
