"""Probe: conv2d[pallas] vs [xla] gradients at the audit's failing size, against a CPU float64 reference."""
import jax, jax.numpy as jnp, numpy as np
from jaxgrad.cnn.conv import conv2d, conv2d_reference
cpu = jax.devices("cpu")[0]
for (n, h, w) in [(1, 7, 9), (2, 13, 10), (2, 64, 48)]:
    kx, kw_, kb, kg = jax.random.split(jax.random.key(n * 100 + h), 4)
    x = jax.random.normal(kx, (n, h, w, 3)); W = jax.random.normal(kw_, (3, 3, 3, 16)) / 27 ** 0.5
    b = jax.random.normal(kb, (16,)) * 0.1; g = jax.random.normal(kg, (n, h, w, 16))
    with jax.enable_x64(True):
        a64 = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (x, W, b, g)]
        y64, vjp64 = jax.vjp(lambda x, W, b: conv2d_reference(x, W, b, activation="relu", precision="highest"), *a64[:3])
        ref = [np.asarray(t) for t in vjp64(a64[3])]
    for backend in ("xla", "pallas"):
        for prec in (None, "highest"):
            y, vjp = jax.vjp(lambda x, W, b: conv2d(x, W, b, activation="relu", backend=backend, precision=prec), x, W, b)
            got = vjp(g)
            errs = [np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r) for a, r in zip(got, ref)]
            yerr = np.linalg.norm(np.asarray(y, np.float64) - np.asarray(y64)) / np.linalg.norm(np.asarray(y64))
            mask_diff = int(np.sum((np.asarray(y) > 0) != (np.asarray(y64) > 0)))
            print(f"{(n,h,w)} {backend:6s} {str(prec):8s} y {yerr:.1e} dx {errs[0]:.1e} dw {errs[1]:.1e} db {errs[2]:.1e} mask-diff {mask_diff}")
