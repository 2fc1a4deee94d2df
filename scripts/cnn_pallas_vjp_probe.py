"""Probe: conv2d (+ReLU) gradients of the pallas and xla backends at the audit's sizes, against a CPU float64
reference, and against a float64 reference that uses the *device's own* ReLU mask.

If an error vanishes once the mask is the device's, it comes from ReLU mask flips: pre-activations within
rounding (TF32: ~u_tf32 sum|terms|) of zero that land on the other side of the kink. That is rounding, not
a kernel bug, but its size is O(|g| |x|) per flipped position, not O(u).

    PYTHONPATH=$PWD python3 scripts/cnn_pallas_vjp_probe.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.cnn.conv import conv2d, conv2d_reference

cpu = jax.devices("cpu")[0]


def rel(a, r):
    return float(np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r))


for (n, h, w) in [(1, 7, 9), (2, 13, 10), (2, 64, 48)]:
    kx, kw_, kb, kg = jax.random.split(jax.random.key(n * 100 + h), 4)
    x = jax.random.normal(kx, (n, h, w, 3))
    W = jax.random.normal(kw_, (3, 3, 3, 16)) / 27 ** 0.5
    b = jax.random.normal(kb, (16,)) * 0.1
    g = jax.random.normal(kg, (n, h, w, 16))
    with jax.enable_x64(True):
        a64 = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (x, W, b, g)]
        y64, vjp64 = jax.vjp(lambda x, W, b: conv2d_reference(x, W, b, activation="relu", precision="highest"),
                             *a64[:3])
        ref = [np.asarray(t) for t in vjp64(a64[3])]
        z64, lin_vjp64 = jax.vjp(lambda x, W, b: conv2d_reference(x, W, b, precision="highest"), *a64[:3])
        z64 = np.asarray(z64)
        mag = np.asarray(conv2d_reference(jnp.abs(a64[0]), jnp.abs(a64[1]), jnp.abs(a64[2]), precision="highest"))
    for backend in ("xla", "pallas"):
        for prec in (None, "highest"):
            y, vjp = jax.vjp(lambda x, W, b: conv2d(x, W, b, activation="relu", backend=backend, precision=prec),
                             x, W, b)
            got = vjp(g)
            yn = np.asarray(y)
            flips = (yn > 0) != (z64 > 0)
            with jax.enable_x64(True):
                gz = jax.device_put(np.asarray(g, np.float64) * (yn > 0), cpu)
                same_mask = [np.asarray(t) for t in lin_vjp64(gz)]
            errs = [rel(a, r) for a, r in zip(got, ref)]
            errs_m = [rel(a, r) for a, r in zip(got, same_mask)]
            zrel = np.abs(z64[flips]) / mag[flips] if flips.any() else np.zeros(1)
            print(f"{(n, h, w)} {backend:6s} {str(prec):8s} y {rel(y, np.asarray(y64)):.1e} | vs f64: "
                  f"dx {errs[0]:.1e} dw {errs[1]:.1e} db {errs[2]:.1e} | vs f64 with the device's mask: "
                  f"dx {errs_m[0]:.1e} dw {errs_m[1]:.1e} db {errs_m[2]:.1e} | flips {int(flips.sum())} "
                  f"(max |z|/sum|terms| {zrel.max():.1e})", flush=True)
