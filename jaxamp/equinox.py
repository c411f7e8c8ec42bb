"""Mixed-precision training of an Equinox module, the Equinox way: functions that take the
module itself and a loss written against it, as ``eqx.filter_value_and_grad`` does.

* :func:`init`: the working model and the optimizer state (the fp32 master and the loss scale
  of :func:`jaxamp.mixed_precision`);
* :func:`make_step`: the whole step, ``(model, [state,] opt_state, *args) -> (model,
  [state,] opt_state, metrics)``, with dynamic loss scaling and non-finite steps skipped
  (model, optimizer state and ``eqx.nn.State`` bit-identical);
* :func:`filter_value_and_grad`: the scaled gradients alone, for a step written by hand.

The model between steps is the *working* model: its inexact arrays in their working dtypes
(bf16 or fp16), the cast of the fp32 master that the optimizer state holds. It is not cast
per step from an fp32 model, for three reasons: the fp32 values already live in the master, so
an fp32 model beside it would be a second fp32 copy of every param (4 bytes each); the step
computes the new working params anyway, as the cast of the new master, so handing them back
costs nothing; and a model that keeps its dtypes from step to step is traced once by
``eqx.filter_jit``. The model a step returns is the one to pass to the next; the fp32 model,
to evaluate or save, is ``eqx.combine(jaxamp.state.get_master_params(opt_state, params),
model)`` with ``params = eqx.filter(model, eqx.is_inexact_array)``. A model that is not the
working model (an fp32 model passed to a step) is a ``ValueError`` that names the array.

Only the model's inexact arrays are trained (``eqx.partition(model, eqx.is_inexact_array)``);
its other leaves (static fields, integer arrays, PRNG keys, activation functions,
``eqx.nn.Dropout``'s flags) are handed back untouched. The step is
:func:`jaxamp.make_train_step`'s, on those arrays, so both paths train bit for bit alike.

Equinox is an optional dependency: ``import jaxamp`` works without it, and importing this
module without it raises an ``ImportError`` that says ``pip install equinox``.
"""

try:
    import equinox as _eqx  # noqa: F401 - the dependency, checked before the helpers load it
except ImportError as e:
    raise ImportError("jaxamp.equinox needs Equinox, which is not installed: pip install "
                      "equinox") from e

from jaxamp._step._equinox import filter_value_and_grad
from jaxamp._step._equinox import init
from jaxamp._step._equinox import make_step

__all__ = ["filter_value_and_grad", "init", "make_step"]
