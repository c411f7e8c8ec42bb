"""Ops that compute in fp32 and save half-precision tensors for the backward pass.

For models built by hand (a jnp function, an NNX or Linen module written from scratch): the
normalizations, softmaxes, GELU and the cross-entropy that a mixed-precision model should run
in fp32, written so that they do not cost fp32 activation memory.

Each op casts its half-precision input to fp32, computes in fp32 and casts the result back to
the input's dtype (the loss stays fp32), so the next matmul runs in the compute dtype. With plain
autodiff the fp32 intermediates (``x - mean``, the fp32 softmax, the fp32 logits) would be the
residuals saved for backward, and a bf16 model would keep about as many activation bytes as an
fp32 one. Here each op is a ``jax.custom_vjp`` whose residuals are its half-precision input (or
output) plus a few fp32 statistics per row or channel; the backward rule recomputes what it
needs in fp32 and returns every gradient in its argument's dtype. Each backward rule reads its
residuals through an optimization barrier, and the softmax hands on its bf16 probabilities
through one: without them XLA merges the backward's fp32 recomputation with the forward's, or
fuses the cast to bf16 into each consumer, and keeps the forward's fp32 tensors alive instead
of the half-precision residuals (on an H200, the reference BERT-Large step needed 82 GB with the
plain rules and 45 GB with the barriers; the jaxpr's saved bytes are the same either way). Under
an fp32 input every op is the usual fp32 computation, without barriers.

>>> import jax
>>> import jax.numpy as jnp
>>> import jaxamp
>>> from jaxamp import ops
>>> x = jnp.ones((64, 256), jnp.bfloat16)
>>> scale, bias = jnp.ones(256), jnp.zeros(256)
>>> def upcast(x):  # the usual recipe: the same layer norm, written in fp32 with jnp
...     x32 = x.astype(jnp.float32)
...     mean = x32.mean(-1, keepdims=True)
...     xc = x32 - mean
...     y = xc * jax.lax.rsqrt(jnp.square(xc).mean(-1, keepdims=True) + 1e-6) * scale + bias
...     return y.astype(x.dtype)
>>> def saved(norm):  # x * 2: the norm's input is an activation, as in a model
...     return jaxamp.audit_grad(lambda x: norm(x * 2), x).saved_bytes_by_dtype
>>> saved(upcast)["float32"] > 64 * 256 * 4  # more than one fp32 copy of x
True
>>> saved(lambda x: ops.layer_norm(x, scale, bias))  # x in bf16, 2 fp32 statistics per row
{'bfloat16': 32768, 'float32': 512}

The ops are reached as ``jaxamp.ops.layer_norm`` (``from jaxamp import ops``), not as top-level
``jaxamp`` names: the top level stays the mixed-precision machinery (the policy, the loss scale,
the master weights, the step, the audit), as small as jmp's, and the ops read like ``jax.nn``'s
without shadowing their names. The result is in the dtype of the op's main input (the loss in
fp32), so cast that input to the compute dtype first; the norms' scales and biases may stay fp32.
"""

from jaxamp._autocast._ops import attention_softmax
from jaxamp._autocast._ops import batch_norm_eval
from jaxamp._autocast._ops import batch_norm_train
from jaxamp._autocast._ops import bias_add
from jaxamp._autocast._ops import embed_lookup
from jaxamp._autocast._ops import gelu
from jaxamp._autocast._ops import layer_norm
from jaxamp._autocast._ops import linear_softmax_cross_entropy
from jaxamp._autocast._ops import softmax_cross_entropy

__all__ = ["attention_softmax", "batch_norm_eval", "batch_norm_train", "bias_add", "embed_lookup",
           "gelu", "layer_norm", "linear_softmax_cross_entropy", "softmax_cross_entropy"]
