"""jaxgrad: JAX ops whose backward passes are written by hand and verified.

Every op has a plain-JAX reference, a ``jax.custom_vjp`` mirroring the documented math, and a Pallas kernel; all
are checked against each other and against float64 finite differences by :mod:`jaxgrad.verify`.
"""

__version__ = "0.1.0"
