"""The train step and its distribution: the objective (the user's loss and how it is called),
:func:`jaxamp.make_train_step` and its state, data parallelism over ``pmap``, ``shard_map``
and a sharded ``jit``, and the Equinox entry points."""
