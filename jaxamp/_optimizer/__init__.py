"""The optimizer state: :func:`jaxamp.mixed_precision`, the optax transform that keeps the fp32
master, the skip and the loss scale in the optimizer's state; where each param's fp32 value
lives (the ``master=`` options), the inner optimizer's moments in fewer bytes, the rounding
they use, and the one pass over the gradients."""
