"""The peers' recipes, written as their documentation writes them, one module per library.

- :mod:`benchmarks.peers.jmp_recipe`: jmp's ``cast_to_compute``, ``DynamicLossScale``,
  ``all_finite`` and ``select_tree``;
- :mod:`benchmarks.peers.flax_recipe`: flax's ``DynamicScale`` and layers built with
  ``dtype=bfloat16``;
- :mod:`benchmarks.peers.optax_recipe`: optax's ``apply_if_finite``;
- :mod:`benchmarks.peers.pytorch_recipe`: PyTorch's ``autocast`` and ``GradScaler``;
- :mod:`benchmarks.peers.pytorch_saved`: the Linen encoder in PyTorch, and the bytes
  ``torch.autocast`` saves for backward.

A JAX recipe is ``train_step(loss, tx) -> (init, step)``: ``init(params)`` builds the state and
``step(state, batch)`` returns ``(state, loss)``, the loss in fp32.
"""
