"""The ``swiglu`` suite: SwiGLU forward + backward, our Pallas kernel and XLA custom VJP against ``jax.grad`` of the
reference, f32 and bf16, timed one after the other in one process (:func:`jaxgrad.bench.harness.run_variants`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrad.bench import harness as bm


SWIGLU_SHAPES = {"small": [(64, 96)], "full": [(16384, 4096), (8192, 14336)]}
SWIGLU_DTYPES = (jnp.float32, jnp.bfloat16)


def swiglu_cost(shape: tuple[int, ...], dtype) -> tuple[float, float]:
    """(flops, bytes_moved) of SwiGLU fwd+bwd on ``N = prod(shape)`` elements.

    Bytes: the forward kernel reads gate, up and writes y (3N); the backward kernel reads gate, up, dy and writes
    dgate, dup (5N): ``8 N itemsize``. This is the floor of the fwd-kernel + bwd-kernel schedule. The benchmark's
    loss ``sum(y * cot)`` adds reads of y and cot (2N) when y is materialised, while a variant that XLA fuses into
    one pass could touch only 5N (read gate, up, cot; write dgate, dup), so an achieved fraction a little above 1
    is possible for the fused ``xla``/``jax.grad`` variants.

    FLOPs: ~20 per element (sigmoid, products, silu'), all elementwise on the FP32 units, so the op is memory
    bound by two orders of magnitude; the compute floor uses the ``"elementwise"`` peak.
    """
    n = 1
    for d in shape:
        n *= int(d)
    return 20.0 * n, 8.0 * n * jnp.dtype(dtype).itemsize


def _swiglu_variants() -> dict[str, Callable]:
    from jaxgrad.ops.swiglu import swiglu, swiglu_reference

    def fwd_bwd(f):
        def loss(gate, up, cot):
            return jnp.sum(f(gate, up) * cot)

        return jax.value_and_grad(loss, argnums=(0, 1))

    return {
        "pallas": fwd_bwd(lambda g, u: swiglu(g, u, backend="pallas")),
        "xla": fwd_bwd(lambda g, u: swiglu(g, u, backend="xla")),
        "jax.grad(reference)": fwd_bwd(swiglu_reference),
    }


def suite_swiglu(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """SwiGLU fwd+bwd (``value_and_grad`` of ``sum(swiglu(gate, up) * cot)`` w.r.t. gate and up), 3 variants."""
    variants = _swiglu_variants()
    rows: list[bm.Row] = []
    key = jax.random.key(0)
    for shape in SWIGLU_SHAPES[sizes]:
        for dtype in SWIGLU_DTYPES:
            kg, ku, kc = jax.random.split(jax.random.fold_in(key, len(rows)), 3)
            args = tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in (kg, ku, kc))
            flops, bytes_moved = swiglu_cost(shape, dtype)
            n = int(args[0].size)
            rows += bm.run_variants(
                "swiglu",
                variants,
                args,
                sizes={"shape": list(shape), "N": n},
                flops=flops,
                bytes_moved=bytes_moved,
                precision=precision,
                floor_precision="elementwise",
                warmup=warmup,
                repeats=repeats,
            )
            del args
    return rows
