"""A Flax NNX model trained with ``nnx.Optimizer`` around ``jaxamp.mixed_precision``.

    python examples/nnx_optimizer.py

The model is built with NNX's defaults (fp32 params). ``nnx.Optimizer`` is created first, so
that the fp32 master weights in its state start from the fp32 init; then the model's params
become the bf16 working copy, and every ``nnx.Linear`` (``dtype=None``) computes in the dtype of
its bf16 inputs and params. The loss is differentiated through ``jaxamp.state.scale_loss`` and
``optimizer.update`` does the rest: the fp32 update, the skip of a non-finite step, and the
new bf16 working params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x_BxD):
        return self.out(nnx.relu(self.hidden(x_BxD)))


def regression_data(n: int = 64):
    x_Nx4 = jnp.linspace(-1.0, 1.0, 4 * n).reshape(n, 4)
    return x_Nx4, jnp.sin(x_Nx4.sum(-1))


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x_Bx4, y_B):
    def loss_fn(model):
        pred_B = model(x_Bx4.astype(jnp.bfloat16))[:, 0].astype(jnp.float32)  # loss in fp32
        loss = jnp.mean((pred_B - y_B) ** 2)
        return jaxamp.state.scale_loss(loss, optimizer.opt_state), loss
    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def main(steps: int = 200, seed: int = 0) -> dict:
    policy = jaxamp.get_policy("mixed_bfloat16")
    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, jaxamp.mixed_precision(optax.adam(1e-2), policy),
                              wrt=nnx.Param)
    nnx.update(model, policy.cast_params_to_compute(nnx.state(model, nnx.Param)))
    x, y = regression_data()
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(steps)]
    working = jax.tree.leaves(nnx.state(model, nnx.Param))
    master = jax.tree.leaves(jaxamp.state.get_master_params(optimizer.opt_state))
    out = {"first_loss": losses[0], "last_loss": losses[-1],
           "params_dtypes": sorted({str(w.dtype) for w in working}),
           "master_dtypes": sorted({str(m.dtype) for m in master}),
           # The working params are the master rounded to bf16, after every step.
           "working_is_rounded_master": all(
               bool(jnp.array_equal(w, m.astype(w.dtype))) for w, m in zip(working, master,
                                                                            strict=True)),
           "output_dtype": str(model(x.astype(jnp.bfloat16)).dtype),
           "skipped_steps": int(jaxamp.state.find_state(optimizer.opt_state).health.skipped_steps)}
    print(out)
    return out


if __name__ == "__main__":
    main()
