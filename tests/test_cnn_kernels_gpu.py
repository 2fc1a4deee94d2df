"""The 3x3 conv kernels (jaxgrad.cnn.kernels) on a GPU beyond ``tests/test_cnn_kernels.py``'s ``gpu`` cases:
launch configurations other than the defaults, and the whole denoiser's loss and gradient built from the kernels.

* A launch configuration (positions per program, the row-strip variant, warps, stages, weight-gradient splits)
  changes the order of the accumulation, never the result beyond rounding: each one listed must meet the error
  model of ``tests/test_cnn_kernels.py`` (every entry within ``k_op u_op + (2 sqrt(n) + 2) u_f32`` of
  ``M = sum |terms|`` of its sum) against the float64 reference, in TF32 and bf16.
* The seed denoiser (1 -> 16 ReLU -> 16 ReLU -> 1, MSE) from the three kernels (forward with bias + ReLU, input
  gradient with the ReLU' mask, weight and bias gradient) against the float64 gradient of the same network: its
  normwise relative error must stay within 3x that of ``jax.value_and_grad`` of the plain XLA (cuDNN) network at
  the same precision, plus one f32 rounding (the kernels may not be less accurate than XLA's convolutions).

Sizes are odd (H != W, no dimension a multiple of a block). Timings belong to the benchmark suites
(``jaxgrad.bench``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cnn import kernels as K
from tests.test_cnn_kernels import BF16_U, F32_U, HP, TF32_U, check_all, make_inputs

pytestmark = pytest.mark.gpu

MODES = {  # name: (dtype, precision, k_op, u_op): the operand-rounding part of the error model
    "f32-tf32": (jnp.float32, None, 8, TF32_U),
    "f32-highest": (jnp.float32, HP, 0, 0.0),
    "bf16": (jnp.bfloat16, None, 2, BF16_U),
}

# A sample of the launch space (the full sweeps are timing questions for the benchmark suites): each kernel's
# variants (row strips, one pipeline stage, weight-gradient splits) at small and large tiles and both warp counts
ROW_STRIPS = [dict(block_p=bp, rows_per_program=rpp, num_warps=nw)  # 3 loads per row instead of 9
              for bp, rpp, nw in ((128, 8, 4), (128, 32, 8), (256, 8, 8), (256, 32, 4))]
ONE_STAGE = [dict(block_p=bp, num_warps=nw, num_stages=1) for bp, nw in ((128, 4), (512, 8))]
WGRAD = ([dict(block_p=bp, num_warps=nw, num_stages=ns) for bp, nw, ns in ((64, 4, 1), (128, 8, 2), (256, 8, 1),
                                                                          (512, 4, 2))]
         + [dict(num_splits=sp) for sp in (132, 1024)])
CONFIGS = ([("fwd", c) for c in ROW_STRIPS + ONE_STAGE] + [("igrad", c) for c in ROW_STRIPS + ONE_STAGE]
           + [("wgrad", c) for c in WGRAD])
# every configuration in TF32; every other one also in bf16 (bf16 operands, f32 accumulation: the same code paths)
CASES = [pytest.param(kind, cfg, mode, id=f"{mode}-{kind}-" + "-".join(f"{k}{v}" for k, v in cfg.items()))
         for i, (kind, cfg) in enumerate(CONFIGS) for mode in (("f32-tf32", "bf16") if i % 2 == 0 else ("f32-tf32",))]


@pytest.mark.parametrize("kind, cfg, mode", CASES)
def test_gpu_launch_configuration_meets_the_error_model(kind, cfg, mode):
    dtype, precision, k_op, u_op = MODES[mode]
    x, wt, b, g, y = make_inputs(31, 2, 67, 129, 16, 16, dtype)
    check_all(x, wt, b, g, y, use_bias=True, relu=True, use_y=True, interpret=False, precision=precision,
              k_op=k_op, u_op=u_op, weight_grad=kind == "wgrad", **{kind: cfg})


# ---------------------------------------------------------------------------------------------------------------
# The seed denoiser from the kernels
# ---------------------------------------------------------------------------------------------------------------
def _conv_xla(x, w, precision):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=precision,
                                        preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))


def xla_loss(params, x, target, precision):
    """MSE of the plain network; activations are stored in ``x.dtype`` between layers, as the kernels do."""
    a = x
    for i, (w, b) in enumerate(params):
        a = (_conv_xla(a, w, precision) + b.astype(jnp.promote_types(b.dtype, jnp.float32))).astype(x.dtype)
        if i < len(params) - 1:
            a = jnp.maximum(a, 0)
    r = a.astype(jnp.promote_types(a.dtype, jnp.float32)) - target.astype(jnp.promote_types(a.dtype, jnp.float32))
    return jnp.mean(r * r)


def kernel_loss_and_grad(params, x, target, precision):
    """Loss and gradient by hand from the kernels: dL/dout = 2 r / size, then input and weight gradients layer by
    layer, the ReLU' mask taken from each layer's stored output."""
    (w1, b1), (w2, b2), (w3, b3) = params
    a1 = K.conv3x3_forward(x, w1, b1, relu=True, precision=precision, interpret=False)
    a2 = K.conv3x3_forward(a1, w2, b2, relu=True, precision=precision, interpret=False)
    out = K.conv3x3_forward(a2, w3, b3, relu=False, precision=precision, interpret=False)
    r = out.astype(jnp.float32) - target.astype(jnp.float32)
    loss = jnp.mean(r * r)
    g3 = (2 / r.size * r).astype(x.dtype)
    dw3, db3 = K.conv3x3_weight_grad(a2, g3, precision=precision, interpret=False)
    da2 = K.conv3x3_input_grad(g3, w3, precision=precision, interpret=False)
    dw2, db2 = K.conv3x3_weight_grad(a1, da2, y=a2, precision=precision, interpret=False)
    da1 = K.conv3x3_input_grad(da2, w2, y=a2, precision=precision, interpret=False)
    dw1, db1 = K.conv3x3_weight_grad(x, da1, y=a1, precision=precision, interpret=False)
    return loss, [(dw1, db1), (dw2, db2), (dw3, db3)]


def init_params(dtype, seed):
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.standard_normal((3, 3, cin, cout)) * np.sqrt(2 / (9 * cin)), dtype),
             jnp.asarray(0.1 * rng.standard_normal(cout), dtype)) for cin, cout in ((1, 16), (16, 16), (16, 1))]


def _normwise(got, want):
    return max(float(np.linalg.norm(np.asarray(a, np.float64) - w) / np.linalg.norm(w))
               for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n, h, w", [(2, 67, 129), (1, 257, 95)])
def test_gpu_denoiser_gradient_from_the_kernels_is_as_accurate_as_xla(mode, n, h, w):
    dtype, precision, _, _ = MODES[mode]
    rng = np.random.default_rng(n * h + w)
    x = jnp.asarray(rng.standard_normal((n, h, w, 1)), dtype)
    target = jnp.asarray(rng.standard_normal((n, h, w, 1)), dtype)
    params = init_params(dtype, seed=h)
    loss_k, grads_k = jax.jit(kernel_loss_and_grad, static_argnums=3)(params, x, target, precision)
    loss_x, grads_x = jax.jit(jax.value_and_grad(xla_loss), static_argnums=3)(params, x, target, precision)
    cpu = jax.devices("cpu")[0]  # the float64 gradient of the same network, from the same (rounded) inputs
    with jax.enable_x64(True):
        p64, x64, t64 = jax.device_put(jax.tree.map(lambda a: np.asarray(a, np.float64), (params, x, target)), cpu)
        loss_64, grads_64 = jax.jit(jax.value_and_grad(xla_loss), static_argnums=3)(p64, x64, t64, HP)
        grads_64 = [np.asarray(v) for v in jax.tree.leaves(grads_64)]
    err_k, err_x = _normwise(grads_k, grads_64), _normwise(grads_x, grads_64)
    assert np.isfinite(float(loss_k)) and err_k <= 3 * err_x + F32_U, (
        f"{mode}: kernels' gradient normwise rel err {err_k:.3g} vs XLA's {err_x:.3g} (both against float64)")
    assert abs(float(loss_k) - float(loss_64)) <= abs(float(loss_x) - float(loss_64)) * 3 + 1e-6 * float(loss_64)
