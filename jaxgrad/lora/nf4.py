"""NF4 weights of the QLoRA path, under the LoRA family's name: the format itself (bitsandbytes' bytes, quantise,
dequantise, the absmax decoding) is :mod:`jaxgrad.ops.nf4`, shared with :mod:`jaxgrad.ops.nf4_matmul`; its public
names are importable from here too."""

from jaxgrad.ops.nf4 import (DOUBLE_QUANT_BLOCKSIZE, DYNAMIC_CODE, NF4_CODE, NF4_MIDPOINTS, NF4Weight,
                             check_nf4_weight, create_dynamic_map, nf4_absmax, nf4_dequantize, nf4_indices,
                             nf4_quantize)

__all__ = ["NF4_CODE", "NF4_MIDPOINTS", "DYNAMIC_CODE", "DOUBLE_QUANT_BLOCKSIZE", "NF4Weight", "nf4_quantize",
           "nf4_dequantize", "check_nf4_weight", "nf4_absmax", "nf4_indices", "create_dynamic_map"]
