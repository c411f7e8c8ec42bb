"""The memory a step needs on a GPU, compiled by XLA:GPU on a machine without one.

XLA:GPU compiles for a GPU described by a target description rather than an attached device
(the "deviceless" route of jax's own AOT tests): the compiled program's sizes, its buffer
assignment and its optimized HLO are then readable on any Linux machine with jax's CUDA plugin
installed, no GPU, no driver. :func:`gpu_memory` compiles a step that way and reports what the
GPU would hold: arguments, outputs, donations and the temporary buffer, the temporary buffer
split by shape and dtype.

This is not :func:`jaxamp.audit`'s figure. The audit reads the jaxpr: what JAX's autodiff saves
for the backward pass, before XLA runs. XLA then fuses, recomputes, keeps a value in another
dtype than the jaxpr's (a ``convert`` fused into its consumers keeps its fp32 input alive) and
schedules buffers; only the compiled program says what a GPU allocates.
"""

from jaxamp._diagnoses._memory import GPU_TARGETS
from jaxamp._diagnoses._memory import GpuMemoryReport
from jaxamp._diagnoses._memory import gpu_memory
from jaxamp._diagnoses._memory import gpu_mesh

__all__ = ["GPU_TARGETS", "GpuMemoryReport", "gpu_memory", "gpu_mesh"]
