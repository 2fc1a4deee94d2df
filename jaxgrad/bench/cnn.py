"""The ``cnn`` suite: the cryo-EM seed denoiser (1 -> 16 -> 16 -> 1, 3x3, ReLU, MSE) forward + backward, our
Pallas kernels and XLA custom VJP against ``jax.grad`` of ``lax.conv`` and, on a GPU with torch, PyTorch cuDNN
autograd of the same network (:func:`jaxgrad.bench.peers.cudnn_denoiser`), timed one after the other in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrad.bench import harness as bm
from jaxgrad.bench import peers


CNN_CONFIGS = {"small": [dict(batch=2, size=64)], "full": [dict(batch=2, size=1024)]}
CNN_CHANNELS = (1, 16, 16, 1)


def cnn_cost(batch: int, size: int, itemsize: int, channels=CNN_CHANNELS) -> tuple[float, float]:
    """(flops, bytes_moved) of the denoiser's fwd+bwd (loss and all weight/bias gradients, plus dx of layers 2..L).

    FLOPs: each layer's forward is ``2 * 9 * Cin * Cout`` per pixel and its backward two products of the same
    size (dW, and dx except for the first layer): 1->16, 16->16, 16->1 at 2x1024^2 is ~14.9 GFLOP.
    Bytes (the floor of a kernel that reads each tensor once per product): forward reads x_l and writes x_{l+1};
    backward reads g and y (ReLU mask) and x for dW, writes dx; the last layer's target read and loss; per pixel
    and channel ``itemsize`` bytes. With fused backward products it is ~0.5 GB in f32 at 2x1024^2.
    """
    pixels = batch * size * size
    flops, elems = 0.0, 0.0
    for i, (cin, cout) in enumerate(zip(channels[:-1], channels[1:])):
        products = 3 if i else 2
        flops += products * 2.0 * 9 * cin * cout * pixels
        elems += (cin + cout) * pixels          # forward: read x_l, write y_l
        elems += (cin + 2 * cout) * pixels      # backward: read x_l, g_l, y_l (mask) ...
        elems += cin * pixels if i else 0.0     # ... and write dx_l
    elems += 2 * channels[-1] * pixels          # loss: read target, write the cotangent
    return flops, elems * itemsize


def _cnn_variants(precision_name: str) -> dict[str, Callable]:
    from jaxgrad.cnn import denoiser

    hp = jax.lax.Precision.HIGHEST if precision_name == "highest" else None

    def loss_for(backend):
        return jax.value_and_grad(lambda p, x, t: denoiser.mse_loss(p, x, t, backend=backend, precision=hp))

    def lax_reference(p, x, t):  # plain XLA convs differentiated by jax.grad (what a JAX user writes)
        h = denoiser.apply_lax(p, x, precision=hp)
        return jnp.mean(jnp.square(h.astype(jnp.float32) - t.astype(jnp.float32)))

    extra = {}
    if precision_name == "highest":  # f32-accurate on tensor cores: three TF32 products (split hi/lo operands)
        x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        extra["pallas 3xTF32"] = jax.value_and_grad(
            lambda p, x, t: denoiser.mse_loss(p, x, t, backend="pallas", precision=x3))
    return {**extra, "pallas": loss_for("pallas"), "xla custom_vjp": loss_for("xla"),
            "jax.grad(lax conv)": jax.value_and_grad(lax_reference)}


def suite_cnn(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """The seed denoiser fwd+bwd (``value_and_grad`` of the MSE w.r.t. all weights and biases)."""
    from jaxgrad.cnn import denoiser

    variants = _cnn_variants(precision)
    rows: list[bm.Row] = []
    dtypes = (jnp.float32,) if sizes == "small" or precision == "highest" else (jnp.float32, jnp.bfloat16)
    for cfg in CNN_CONFIGS[sizes]:
        for dtype in dtypes:
            params = jax.tree.map(lambda a: a.astype(dtype), denoiser.init(jax.random.key(0)))
            shape = (cfg["batch"], cfg["size"], cfg["size"], 1)
            x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
            t = jax.random.normal(jax.random.key(2), shape, jnp.float32).astype(dtype)
            flops, bytes_moved = cnn_cost(cfg["batch"], cfg["size"], jnp.dtype(dtype).itemsize)
            rows += bm.run_variants("cnn", variants, (params, x, t), sizes=dict(cfg), flops=flops,
                                    bytes_moved=bytes_moved, precision=precision,
                                    floor_precision="highest" if precision == "highest" else "tf32",
                                    warmup=warmup, repeats=repeats)
            if sizes == "full":
                row = peers.cudnn_denoiser(cfg, "bf16" if dtype == jnp.bfloat16 else "f32",
                                           tf32=precision != "highest", repeats=repeats, warmup=warmup,
                                           flops=flops, bytes_moved=bytes_moved, channels=CNN_CHANNELS)
                if row is not None:
                    rows.append(row)
    return rows
