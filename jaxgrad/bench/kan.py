"""The ``kan`` suite: one KAN layer forward + backward, our Pallas kernels and XLA custom VJP against ``jax.grad``
of the reference and, on a GPU with torch, PyTorch autograd of efficient-kan's ``KANLinear``
(:func:`jaxgrad.bench.peers.efficient_kan`), timed one after the other in one process.

At the default precision with float32 arrays the XLA custom VJP is also timed with ``precision="fp16_scaled"``
(row ``xla custom_vjp fp16_scaled``: float16 operands scaled by powers of two, float32 sums,
:mod:`jaxgrad.kan.fp16_scaled`), beside the TF32 rows of the same layer. On a Hopper GPU the layer is also timed on
``backend="mosaic"`` (the forward, the input gradient and the weight gradients in the Mosaic kernels of
:mod:`jaxgrad.kan.forward_mgpu`, :mod:`jaxgrad.kan.dx_mgpu` and :mod:`jaxgrad.kan.dcoef_mgpu`); the forward alone
(rows sized ``part=forward``: FLOPs a third of the layer's) on the Mosaic kernel against XLA's (and the kernel with
128-output tiles: each basis tile computed once per 128 outputs instead of the default's 256; two probes of where
its time goes, the products without the Cox-de Boor sweep and the sweep without most products; and the kernel with
the plain sweep instead of the affine one), the input gradient alone (``part=dx``) and the weight gradients alone
(``part=dC``: :mod:`jaxgrad.kan.dcoef_mgpu` with the batch split until the tiles fill the SMs, in one chunk, and in
groups of 5 accumulators; :mod:`jaxgrad.kan.dcoef_wide_mgpu`, the bases as the right operand) on the Mosaic
kernels against XLA's scaled products. With float32 arrays the bases alone are timed too (``part=bases``):
efficient-kan's recursion against the per-output form the XLA path uses, written as float16.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrad.bench import harness as bm
from jaxgrad.bench import peers


KAN_CONFIGS = {
    "small": [dict(batch=64, features=32, grid_size=5, spline_order=3)],
    "full": [dict(batch=16384, features=512, grid_size=5, spline_order=3),
             dict(batch=16384, features=512, grid_size=20, spline_order=3),
             dict(batch=16384, features=512, grid_size=5, spline_order=5)],
}


def kan_configs(sizes: str, grids: list[tuple[int, int]] | None = None) -> list[dict]:
    """The layer sizes of ``sizes`` (:data:`KAN_CONFIGS`), only those whose ``(grid_size, spline_order)`` is in
    ``grids`` when given (each pair must name one)."""
    configs = KAN_CONFIGS[sizes]
    if grids is None:
        return configs
    have = [(c["grid_size"], c["spline_order"]) for c in configs]
    missing = [f"{g}:{k}" for g, k in grids if (g, k) not in have]
    if missing:
        raise ValueError(f"--grids {','.join(missing)}: the {sizes!r} sizes have G:k "
                         f"{', '.join(f'{g}:{k}' for g, k in have)}")
    return [c for c in configs if (c["grid_size"], c["spline_order"]) in grids]


def kan_cost(batch: int, features: int, grid_size: int, spline_order: int, itemsize: int) -> tuple[float, float]:
    """(flops, bytes_moved) of one KAN layer fwd+bwd, in -> out = features.

    FLOPs: three dense products of ``[B, in*(G+k+1)] x [in*(G+k+1), out]`` (forward, dC, dx; the +1 is the SiLU
    base branch): ``6 B in out (G+k+1)``; 232 GFLOP at B=16384, 512->512, G=5, k=3. Evaluating only the k+1
    non-zero bases would need gathers the matrix units cannot use, so the dense count is the floor of any
    tensor-core implementation. Bytes: x, y, dy, dx (4 B in) plus parameters, negligible: compute bound.
    """
    nb = grid_size + spline_order + 1
    flops = 6.0 * batch * features * features * nb
    bytes_moved = 4.0 * batch * features * itemsize + 3.0 * features * features * nb * itemsize
    return flops, bytes_moved


def _kan_variants(precision_name: str, dtype=jnp.float32) -> dict[str, Callable]:
    from jaxgrad.kan.layer import kan_linear, kan_linear_reference

    hp = jax.lax.Precision.HIGHEST if precision_name == "highest" else None

    def fwd_bwd(f):
        def loss(params, x):
            return jnp.mean(f(params, x) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))

    def trainable(f):
        return lambda p, x: f({**p, "grid": jax.lax.stop_gradient(p["grid"])}, x)

    extra, scaled = {}, {}
    if precision_name != "highest" and jnp.dtype(dtype) == jnp.float32:  # fp16_scaled takes float32 arrays only
        scaled["xla custom_vjp fp16_scaled"] = fwd_bwd(trainable(
            lambda p, x: kan_linear(p, x, backend="xla", precision="fp16_scaled")))
    if precision_name != "highest" and _on_hopper():  # the same scaled products in the three Mosaic kernels
        scaled["mosaic"] = fwd_bwd(trainable(
            lambda p, x: kan_linear(p, x, backend="mosaic")))
    if precision_name == "highest":  # f32-accurate on tensor cores: three TF32 products (split hi/lo operands)
        x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        extra["pallas 3xTF32"] = fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="pallas", precision=x3)))
    return {
        **extra,
        "pallas": fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="pallas", precision=hp))),
        "xla custom_vjp": fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="xla", precision=hp))),
        **scaled,
        "jax.grad(reference)": fwd_bwd(trainable(lambda p, x: kan_linear_reference(p, x, precision=hp))),
    }


def _on_hopper() -> bool:
    from jaxgrad.kan.forward_mgpu import on_hopper

    return on_hopper()


def _narrower_tiles_fit(nb: int, k: int, tile_n: int) -> bool:
    """Whether ``tile_n``-wide forward tiles fit and are narrower than the default's (a row of their own)."""
    from jaxgrad.kan.forward_mgpu import ForwardTiles

    try:
        ForwardTiles.for_layer(nb, k, tile_n)
    except ValueError:
        return False
    return ForwardTiles.for_layer(nb, k).tile_n > tile_n


def _forward_variants(dtype, nb: int, k: int) -> dict[str, Callable]:
    """The layer's forward alone, on the scaled float16 products: the Mosaic kernel against XLA's."""
    from jaxgrad.kan.layer import kan_linear

    def fwd(backend, precision=None):
        return jax.jit(lambda p, x: kan_linear(p, x, backend=backend, precision=precision))

    def mosaic_tiles(tile_n, probe=""):
        import dataclasses

        from jaxgrad.kan.forward_mgpu import ForwardTiles, kan_forward_mgpu

        def f(p, x):
            nb = p["spline_weight"].shape[-1]
            k = p["grid"].shape[-1] - nb - 1
            coef = (p["spline_weight"] * p["spline_scaler"][..., None]).astype(jnp.float32)
            tiles = dataclasses.replace(ForwardTiles.for_layer(nb, k, tile_n), probe=probe)
            return kan_forward_mgpu(x.astype(jnp.float32), p["grid"].astype(jnp.float32), coef,
                                    p["base_weight"].astype(jnp.float32), k, config=tiles)
        return jax.jit(f)

    out = {"mosaic forward": fwd("mosaic")}
    if _narrower_tiles_fit(nb, k, 128):  # against the default's 256 (the suite's layers have 512 outputs)
        out["mosaic forward tile_n=128"] = mosaic_tiles(128)
    # where the kernel's time goes (results not the layer's): the products without the sweep, the sweep without NB
    # of the products
    out["mosaic forward probe: products only"] = mosaic_tiles(None, probe="products")
    if _narrower_tiles_fit(nb, k, 128):  # its K steps twice as deep (bk 32: a 64-byte swizzle, not 32)
        out["mosaic forward probe: products only at tile_n=128"] = mosaic_tiles(128, probe="products")
    out["mosaic forward probe: bases only"] = mosaic_tiles(None, probe="bases")
    out["mosaic forward, plain sweep"] = mosaic_tiles(None, probe="plain")
    if jnp.dtype(dtype) == jnp.float32:
        out["xla forward fp16_scaled"] = fwd("xla", "fp16_scaled")
    out["xla forward"] = fwd("xla")
    return out


def _dx_variants() -> dict[str, Callable]:
    """The input gradient alone, ``dx = (g W^b) * silu'(x) + sum_m (g C)[.., m] B'_m(x)``, on the scaled float16
    products: the Mosaic kernel against the XLA custom VJP's."""
    from jaxgrad.kan.layer import _backward_math

    def dx(backend):
        def f(p, x, g):
            k = p["grid"].shape[-1] - p["spline_weight"].shape[-1] - 1
            p32 = {n: v.astype(jnp.float32) for n, v in p.items()}
            return _backward_math(p32, x.astype(jnp.float32), g.astype(jnp.float32), k, backend,
                                  "fp16_scaled", False)[1]
        return jax.jit(f)

    return {"mosaic dx": dx("mosaic"), "xla dx fp16_scaled": dx("xla")}


def _basis_variants() -> dict[str, Callable]:
    """The bases alone, written as float16 (what the scaled products consume): efficient-kan's recursion (each level
    sliced: ``bspline_basis``) against the recursion written per output basis (``bspline_basis_elementwise``, the XLA
    path's), and the bases with their derivatives (the backward's ``bspline_basis_and_derivative``)."""
    from jaxgrad.kan.spline import (bspline_basis, bspline_basis_and_derivative, bspline_basis_derivative,
                                    bspline_basis_elementwise)

    def order(p):
        return p["grid"].shape[-1] - p["spline_weight"].shape[-1] - 1

    def f16(basis):
        return lambda p, x: basis(x.astype(jnp.float32), p["grid"].astype(jnp.float32), order(p)).astype(jnp.float16)

    def pair(fn):
        def f(p, x):
            b, d = fn(x.astype(jnp.float32), p["grid"].astype(jnp.float32), order(p))
            return b.astype(jnp.float16), d.astype(jnp.float16)
        return f

    def separate(x, grid, k):
        return bspline_basis(x, grid, k), bspline_basis_derivative(x, grid, k)

    return {"bases, efficient-kan recursion": jax.jit(f16(bspline_basis)),
            "bases, elementwise": jax.jit(f16(bspline_basis_elementwise)),
            "bases + derivatives, efficient-kan recursion": jax.jit(pair(separate)),
            "bases + derivatives, elementwise": jax.jit(pair(bspline_basis_and_derivative))}


def _dcoef_variants(nb: int | None = None) -> dict[str, Callable]:
    """The weight gradients alone, ``dC[o,i,m] = sum_b g[b,o] B_m(x[b,i])`` and ``dW^b = g^T silu(x)``, on the scaled
    float16 products: the Mosaic kernels (:mod:`jaxgrad.kan.dcoef_wide_mgpu`, the layer's, and
    :mod:`jaxgrad.kan.dcoef_mgpu`) against XLA's."""
    import dataclasses

    from jaxgrad.kan import fp16_scaled
    from jaxgrad.kan.basis_maxima import bspline_basis_maxima
    from jaxgrad.kan.dcoef_mgpu import DcoefTiles, kan_dcoef_mgpu, left_maxima, weight_cotangents
    from jaxgrad.kan.dcoef_wide_mgpu import WideTiles, kan_dcoef_wide_mgpu, kan_weight_cotangents
    from jaxgrad.kan.spline import bspline_basis_elementwise

    def order(p):
        return p["grid"].shape[-1] - p["spline_weight"].shape[-1] - 1

    def on_f32(fn, with_g=True, **kw):  # fn(x, grid, [g,] k, **kw) on the float32 operands the kernels take
        return lambda p, x, g: fn(x.astype(jnp.float32), p["grid"].astype(jnp.float32), *((g,) if with_g else ()),
                                  order(p), **kw)

    def tiled(kernel, tiles_cls, **tiles):  # a kernel's V̄ at tiles other than its defaults, as (dC, dW^b)
        v = on_f32(kernel, config=dataclasses.replace(tiles_cls(), **tiles))
        return lambda p, x, g: weight_cotangents(v(p, x, g))

    def xla(p, x, g):
        x = x.astype(jnp.float32)
        phi = bspline_basis_elementwise(x, p["grid"].astype(jnp.float32), order(p))
        dcoef = fp16_scaled.matmul(g.T, phi.reshape(x.shape[0], -1)).reshape(g.shape[1], x.shape[1], -1)
        return dcoef, fp16_scaled.matmul(g.T, x * jax.nn.sigmoid(x))

    # "mosaic dC" is the layer's (dcoef_wide_mgpu); beside it the kernel with the bases in registers as the left
    # operand (dcoef_mgpu: 64 outputs and 3 bases a CTA), and the wide kernel's tiles: one row block of 64 outputs a
    # warpgroup (half the accumulator registers, twice the sweeps) where the default has two, and the batch unsplit
    out = {"mosaic dC": jax.jit(on_f32(kan_weight_cotangents)),
           "mosaic dC, bases in registers (dcoef_mgpu)": jax.jit(tiled(kan_dcoef_mgpu, DcoefTiles))}
    if nb is None or WideTiles().resolved(nb, 16384, 512, 512, 132).rb == 2:
        out["mosaic dC, bases as the right operand, 128 outputs a CTA"] = jax.jit(
            tiled(kan_dcoef_wide_mgpu, WideTiles, rb=1))
    out["mosaic dC, bases as the right operand, one batch chunk"] = jax.jit(
        tiled(kan_dcoef_wide_mgpu, WideTiles, splits=1))
    # the default splits each step's sweep between the two compute warpgroups (each makes half of the bases);
    # here each makes all of them for its own products
    out["mosaic dC, each warpgroup sweeping every basis"] = jax.jit(
        tiled(kan_dcoef_wide_mgpu, WideTiles, shared_sweep=False))
    # the row maxima alone, which the Mosaic kernels' scales come from
    out["dC row maxima, xla (chunks of 2048 rows)"] = jax.jit(on_f32(left_maxima, with_g=False))
    out["dC row maxima, sweep kernel"] = jax.jit(on_f32(bspline_basis_maxima, with_g=False))
    out["xla dC fp16_scaled"] = jax.jit(xla)
    return out


def suite_kan(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants: list[str] | None = None,
              budget_s: float | None = None, grids: list[tuple[int, int]] | None = None) -> list[bm.Row]:
    """One KAN layer fwd+bwd (``value_and_grad`` of ``mean(y^2)`` w.r.t. all trained params and x), and its parts.

    ``variants``: substrings (``=name``: exactly that name); only the variants they select run. ``budget_s``: a
    group of variants (one size, dtype and part) is not started once the suite has run that long; its rows say so. ``grids``: only
    the sizes with these ``(grid_size, spline_order)`` pairs (:func:`kan_configs`)."""
    from jaxgrad.kan.layer import KANConfig, init

    rows: list[bm.Row] = []
    t_start = time.perf_counter()

    def run_variants(fns, args, sizes, **kw):
        chosen = {n: f for n, f in fns.items() if not variants or bm.selects(variants, n)}
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            return [bm.Row("kan", n, dict(sizes), bm.dtype_name(args), kw.get("precision") or "",
                           notes=f"error: not run: the suite's time budget ({budget_s:.0f} s) is spent")
                    for n in chosen]
        return bm.run_variants("kan", chosen, args, sizes, **kw) if chosen else []

    dtypes = (jnp.float32,) if sizes == "small" or precision == "highest" else (jnp.float32, jnp.bfloat16)
    for cfg in kan_configs(sizes, grids):
        for dtype in dtypes:
            if dtype == jnp.bfloat16 and cfg["grid_size"] != 5:
                continue
            kc = KANConfig(cfg["features"], cfg["features"], grid_size=cfg["grid_size"],
                           spline_order=cfg["spline_order"])
            params = jax.tree.map(lambda a: a.astype(dtype), init(jax.random.key(0), kc))
            x = jax.random.uniform(jax.random.key(1), (cfg["batch"], cfg["features"]), jnp.float32, -1, 1)
            flops, bytes_moved = kan_cost(cfg["batch"], cfg["features"], cfg["grid_size"], cfg["spline_order"],
                                          jnp.dtype(dtype).itemsize)
            rows += run_variants(_kan_variants(precision, dtype), (params, x.astype(dtype)), sizes=dict(cfg),
                                 flops=flops, bytes_moved=bytes_moved, precision=precision,
                                 floor_precision="highest" if precision == "highest" else "tf32",
                                 warmup=warmup, repeats=repeats)
            if dtype == jnp.float32:  # the bases alone: read x, write [B, in, NB] float16
                nb = cfg["grid_size"] + cfg["spline_order"]
                rows += run_variants(_basis_variants(), (params, x), sizes=dict(cfg, part="bases"), flops=None,
                                     bytes_moved=cfg["batch"] * cfg["features"] * (4 + 2 * nb), precision=precision,
                                     floor_precision="elementwise", warmup=warmup, repeats=repeats)
            if precision != "highest" and _on_hopper():
                forward = _forward_variants(dtype, cfg["grid_size"] + cfg["spline_order"], cfg["spline_order"])
                rows += run_variants(forward, (params, x.astype(dtype)), sizes=dict(cfg, part="forward"),
                                     flops=flops / 3, bytes_moved=bytes_moved / 2, precision=precision,
                                     floor_precision="tf32", warmup=warmup, repeats=repeats)
                if dtype == jnp.float32:
                    g = jax.random.normal(jax.random.key(2), (cfg["batch"], cfg["features"]), jnp.float32)
                    rows += run_variants(_dx_variants(), (params, x, g), sizes=dict(cfg, part="dx"),
                                         flops=flops / 3, bytes_moved=bytes_moved / 2, precision=precision,
                                         floor_precision="tf32", warmup=warmup, repeats=repeats)
                    dcoef = _dcoef_variants(cfg["grid_size"] + cfg["spline_order"])
                    rows += run_variants(dcoef, (params, x, g), sizes=dict(cfg, part="dC"),
                                         flops=flops / 3, bytes_moved=bytes_moved / 2, precision=precision,
                                         floor_precision="tf32", warmup=warmup, repeats=repeats)
            if (sizes == "full" and cfg["grid_size"] == 5 and cfg["spline_order"] == 3
                    and (not variants or any(v in "torch efficient-kan autograd" for v in variants))
                    and (budget_s is None or time.perf_counter() - t_start <= budget_s)):
                row = peers.efficient_kan(cfg, "bf16" if dtype == jnp.bfloat16 else "f32",
                                          tf32=precision != "highest", repeats=repeats, warmup=warmup,
                                          flops=flops, bytes_moved=bytes_moved)
                if row is not None:
                    rows.append(row)
    return rows
