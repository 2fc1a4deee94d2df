#!/usr/bin/env python
"""Run one jaxgrad benchmark suite, print its table and write it to ``benchmarks/results``.

    python scripts/bench.py SUITE [--sizes small|full] [--out benchmarks/results] [--repeats N]
                                  [--precision default|highest]

All variants of a suite are timed one after the other in this process (the GPU machines are shared and noisy, so
only side-by-side numbers are compared). Off-GPU the Pallas kernels run in interpret mode, which is slow, so
``--sizes`` defaults to ``small`` there and to ``full`` on a GPU.

A suite is a function ``suite_<name>(sizes, precision, *, repeats, warmup) -> list[Row]`` registered in
:data:`SUITES`.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import contextlib  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxgrad import benchmarking as bm  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# swiglu
# ---------------------------------------------------------------------------------------------------------------
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


SUITES: dict[str, Callable[..., list[bm.Row]]] = {"swiglu": suite_swiglu}


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--sizes", choices=["small", "full"], default=None,
                   help="problem sizes (default: full on a GPU, small elsewhere)")
    p.add_argument("--out", default="benchmarks/results", help="results directory (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per variant (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per variant (default: %(default)s)")
    p.add_argument("--precision", choices=["default", "highest"], default="default",
                   help="jax default matmul precision for the whole run (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.sizes or ("full" if jax.default_backend() == "gpu" else "small")
    ctx = jax.default_matmul_precision("highest") if args.precision == "highest" else contextlib.nullcontext()
    with ctx:
        env = bm.environment()
        rows = SUITES[args.suite](sizes, args.precision, repeats=args.repeats, warmup=args.warmup)
    print(bm.format_table(rows, env), end="")
    path = bm.write_results(rows, args.suite, args.out, env=env)
    print(f"wrote {path} and {path.with_suffix('.txt').name}")
    failed = [r.variant for r in rows if r.median_ms is None]
    if failed:
        print(f"error: {len(failed)} variant run(s) failed: {sorted(set(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
