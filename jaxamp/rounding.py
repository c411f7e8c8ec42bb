"""Rounding fp32 values into half precision without losing small updates.

An fp32 value rounded to the nearest bf16 loses every change smaller than half a bf16 ulp
(``2**-9`` of its magnitude): an update of ``1e-4 * |param|`` vanishes, every step. Two remedies,
after "Revisiting BFloat16 Training" (Zamirai et al., 2020):

- :func:`stochastic_round` rounds up or down with probabilities that make the result exact in
  expectation, so small updates survive on average;
- :func:`kahan_split` splits the fp32 value into a half-precision high part and a 16-bit low
  part (the compensation): for bfloat16, exactly the 16 bits that rounding drops, so the pair
  holds the fp32 value without loss.

:func:`jaxamp.mixed_precision` uses both to keep bf16 params and moments without an fp32 copy
(``master="kahan"``, ``master="stochastic"``, ``moments_dtype="bfloat16"``).

A third store keeps an optimizer's moments in a quarter of their bytes:
:func:`quantize_blockwise` gives each block of values one fp32 absmax and one 8-bit code per
value into a :func:`dynamic_map` (``moments_dtype="8bit"``, :func:`jaxamp.quantized_moments`).
"""

from jaxamp._optimizer._rounding import Blockwise8bit
from jaxamp._optimizer._rounding import dequantize_blockwise
from jaxamp._optimizer._rounding import dynamic_map
from jaxamp._optimizer._rounding import kahan_join
from jaxamp._optimizer._rounding import kahan_split
from jaxamp._optimizer._rounding import quantize_blockwise
from jaxamp._optimizer._rounding import rounding_noise
from jaxamp._optimizer._rounding import stochastic_round

__all__ = ["Blockwise8bit", "dequantize_blockwise", "dynamic_map", "kahan_join", "kahan_split",
           "quantize_blockwise", "rounding_noise", "stochastic_round"]
