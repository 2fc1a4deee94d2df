"""The ``tf32_rounding`` tool: does a GPU's TF32 path round its f32 operands to nearest, or truncate them?

    python -m jaxgrad.bench tf32_rounding        # on a GPU (a test marked gpu asserts round to nearest)

For each path -- XLA's default-precision ``dot`` (cuBLAS), a default-precision ``conv_general_dilated`` (cuDNN) and a
Triton-backend Pallas ``dot`` -- the product of f32 operands whose mantissas are filled below TF32's 10 bits is
compared with two float64 models: operands rounded to nearest even (``reduce_precision``) and operands truncated
(low 13 mantissa bits cleared). The model that leaves only f32-accumulation-sized residue is the hardware's. A
truncating path would carry a systematic -u_tf32-sized bias per product, which the verifier's scale test
(``jaxgrad.verify.stats``) reports as a bug rather than absorb as rounding.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.bench.harness import environment


def _rn(a):
    return np.asarray(jax.lax.reduce_precision(jnp.asarray(a, jnp.float32), 8, 10), np.float64)


def _rz(a):
    bits = np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


def _pallas_dot(x, w):
    m, k = x.shape
    n = w.shape[1]

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    return pb.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(1,),
                          in_specs=[pl.BlockSpec((m, k), lambda i: (0, 0)), pl.BlockSpec((k, n), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((m, n), lambda i: (0, 0)), name="tf32_probe_dot")(x, w)


def _paths() -> dict:
    """name -> (run, float64 model, lhs, rhs) of every TF32 path measured."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    xc = rng.standard_normal((2, 16, 16, 32)).astype(np.float32)
    wc = rng.standard_normal((3, 3, 32, 16)).astype(np.float32)
    conv = lambda a, b: jax.lax.conv_general_dilated(a, b, (1, 1), "SAME",  # noqa: E731
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return {
        "xla dot (cuBLAS), default precision": (lambda: jnp.dot(jnp.asarray(x), jnp.asarray(w)), np.matmul, x, w),
        "xla conv (cuDNN), default precision": (lambda: conv(jnp.asarray(xc), jnp.asarray(wc)),
                                                lambda a, b: np.asarray(jax.jit(conv, backend="cpu")(
                                                    jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)),
                                                    np.float64), xc, wc),
        "pallas triton dot": (lambda: _pallas_dot(jnp.asarray(x), jnp.asarray(w)), np.matmul, x, w),
    }


def measure() -> dict[str, dict]:
    """Per path: the relative distances of its product to the round-to-nearest (``d_rn``), truncation (``d_rz``)
    and exact (``d_ex``) float64 models, the scale bias against the exact product, and the ``verdict`` (``round to
    nearest``, ``truncation``, ``exact f32``, ``unclear``); ``{"error": ...}`` for a path this machine cannot run."""
    out = {}
    for name, (run, model, a, b) in _paths().items():
        try:
            y = np.asarray(run(), np.float64)
        except Exception as e:  # noqa: BLE001 - a path this machine cannot run
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
            continue
        with jax.default_matmul_precision("highest"):
            y_rn, y_rz = model(_rn(a), _rn(b)), model(_rz(a), _rz(b))
            y_ex = model(a.astype(np.float64), b.astype(np.float64))
        scale = np.linalg.norm(y_ex)
        d_rn, d_rz, d_ex = (float(np.linalg.norm(y - ref) / scale) for ref in (y_rn, y_rz, y_ex))
        bias = float(np.vdot(y - y_ex, y_ex) / np.vdot(y_ex, y_ex))
        verdict = ("round to nearest" if d_rn < d_rz / 10 else "truncation" if d_rz < d_rn / 10 else
                   "exact f32" if d_ex < min(d_rn, d_rz) / 10 else "unclear")
        out[name] = {"d_rn": d_rn, "d_rz": d_rz, "d_ex": d_ex, "bias": bias, "verdict": verdict}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(prog="python -m jaxgrad.bench tf32_rounding",
                            description=__doc__.split("\n")[0]).parse_args(argv)
    env = environment()
    print(f"# device: {env['device_kind']} ({env['platform']}); jax {env['jax']}; commit {env['commit']} "
          f"(uncommitted changes: {env['dirty']}); command: {env['command']}")
    for name, r in measure().items():
        if "error" in r:
            print(f"{name}: not run ({r['error']})")
            continue
        print(f"{name}: |y - RN model| {r['d_rn']:.2e}, |y - RZ model| {r['d_rz']:.2e}, |y - exact| "
              f"{r['d_ex']:.2e}, scale bias {r['bias']:+.2e} -> {r['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
