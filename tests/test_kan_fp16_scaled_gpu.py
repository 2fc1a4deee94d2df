"""``precision="fp16_scaled"`` on the GPU: float16 tensor-core products (cuBLAS, float32 accumulation) of operands
scaled by powers of two must round as TF32 does.

``check_vjp`` under the TF32 model (``precision="tf32"``: the reference's product operands rounded to 10 mantissa
bits) at B=4096, 512 -> 512, G=5, k=3 (the benchmark's layer at a quarter of its batch), against the float64
reference: forward, every trained param and ``x``. The compiled program must really take float16 operands (not
TF32 ones): its optimized HLO holds ``f16`` dots. A second case scales alternate output rows by 1e5 and 1e-6, a
range no unscaled float16 cast holds. Timings belong to ``jaxgrad.bench kan``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.layer import kan_linear, kan_linear_reference
from jaxgrad.verify import check_vjp

pytestmark = pytest.mark.gpu


def _layer(seed, n, *, grid_size=5, spline_order=3, row_scales=None):
    rng = np.random.default_rng(seed)
    G, k = grid_size, spline_order
    knots = -1.0 + np.arange(-k, G + k + 1) * (2.0 / G)
    s = np.ones(n) if row_scales is None else np.asarray(row_scales, np.float64)
    trainable = {
        "base_weight": rng.standard_normal((n, n)) / math.sqrt(n) * s[:, None],
        "spline_weight": rng.standard_normal((n, n, G + k)) * s[:, None, None],
        "spline_scaler": rng.standard_normal((n, n)) / math.sqrt(n),
        "bias": rng.standard_normal((n,)) * s,
    }
    trainable = {name: jnp.asarray(v, jnp.float32) for name, v in trainable.items()}
    return trainable, jnp.asarray(np.broadcast_to(knots, (n, knots.size)), jnp.float32)


def _check(trainable, grid, x):
    fn = jax.jit(lambda t, x: kan_linear({**t, "grid": grid}, x, precision="fp16_scaled"))
    ref = jax.jit(lambda t, x: kan_linear_reference({**t, "grid": grid}, x))
    return fn, check_vjp(fn, ref, trainable, x, arg_names=("params", "x"), precision="tf32", fd=False)


@pytest.mark.parametrize("row_scales", [None, "1e5/1e-6"])
def test_fp16_scaled_layer_passes_the_tf32_model_on_the_gpu(row_scales):
    assert jax.default_backend() == "gpu"
    n, batch = 512, 4096
    scales = None if row_scales is None else [1e5 if o % 2 else 1e-6 for o in range(n)]
    trainable, grid = _layer(0, n, row_scales=scales)
    x = jnp.asarray(np.random.default_rng(1).uniform(-1.2, 1.2, (batch, n)), jnp.float32)
    fn, report = _check(trainable, grid, x)
    print(report)
    assert report.passed, str(report)
    assert report.precision.precision == "tf32"
    # the products run on float16 operands on the device (float32 results)
    hlo = jax.jit(jax.grad(lambda t, x: jnp.sum(fn(t, x)), argnums=(0, 1))).lower(trainable, x).compile().as_text()
    assert "f16[" in hlo
