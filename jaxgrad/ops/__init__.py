"""jaxgrad's ops: each module holds an op's reference, custom VJP and Pallas kernels side by side."""

from jaxgrad.ops.swiglu import swiglu, swiglu_reference

__all__ = ["swiglu", "swiglu_reference"]
