#!/usr/bin/env python
"""Run one jaxgrad benchmark suite, print its table and write it to ``runs/bench`` (or ``--out DIR``).

    python scripts/bench.py SUITE [--sizes small|full] [--out runs/bench] [--repeats N]
                                  [--precision default|highest] [--variants SUBSTR,...] [--budget-s S]

Results go to ``runs/bench/`` under the current directory by default (``/runs/`` is git-ignored in a checkout), so
running a benchmark never changes the repository: the README's tables are generated from the committed
``benchmarks/results/``, and a result joins them only when asked for, with ``--out benchmarks/results``.

All variants of a suite are timed one after the other in this process (the GPU machines are shared and noisy, so
only side-by-side numbers are compared). The ``lora`` suite (:mod:`jaxgrad.bench.lora_block`) runs each variant in a
fresh process instead, one after the other, so that each one's peak device memory is its own; ``--variants`` and
``--budget-s`` apply to it. So does the ``lora_model`` suite (:mod:`jaxgrad.bench.lora_model`: one whole training
step of a small Llama with LoRA, tokens/s and peak memory, against transformers + PEFT). Off-GPU the Pallas kernels run in interpret mode, which is slow, so ``--sizes``
defaults to ``small`` there and to ``full`` on a GPU.

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

from jaxgrad.bench import harness as bm  # noqa: E402


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


# ---------------------------------------------------------------------------------------------------------------
# KAN layer
# ---------------------------------------------------------------------------------------------------------------
KAN_CONFIGS = {
    "small": [dict(batch=64, features=32, grid_size=5, spline_order=3)],
    "full": [dict(batch=16384, features=512, grid_size=5, spline_order=3),
             dict(batch=16384, features=512, grid_size=20, spline_order=3),
             dict(batch=16384, features=512, grid_size=5, spline_order=5)],
}


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


def _kan_variants(precision_name: str) -> dict[str, Callable]:
    from jaxgrad.kan.layer import kan_linear, kan_linear_reference

    hp = jax.lax.Precision.HIGHEST if precision_name == "highest" else None

    def fwd_bwd(f):
        def loss(params, x):
            return jnp.mean(f(params, x) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))

    def trainable(f):
        return lambda p, x: f({**p, "grid": jax.lax.stop_gradient(p["grid"])}, x)

    extra = {}
    if precision_name == "highest":  # f32-accurate on tensor cores: three TF32 products (split hi/lo operands)
        x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        extra["pallas 3xTF32"] = fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="pallas", precision=x3)))
    return {
        **extra,
        "pallas": fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="pallas", precision=hp))),
        "xla custom_vjp": fwd_bwd(trainable(lambda p, x: kan_linear(p, x, backend="xla", precision=hp))),
        "jax.grad(reference)": fwd_bwd(trainable(lambda p, x: kan_linear_reference(p, x, precision=hp))),
    }


def _torch_efficient_kan(cfg: dict, dtype_name: str, tf32: bool, repeats: int, warmup: int) -> bm.Row | None:
    """PyTorch autograd of efficient-kan's KANLinear math (b_splines + two F.linear), same sizes, in this run."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import time

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dev, tdt = "cuda", {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    B, F_, G, k = cfg["batch"], cfg["features"], cfg["grid_size"], cfg["spline_order"]
    h = 2.0 / G
    grid = (torch.arange(-k, G + k + 1, device=dev) * h - 1.0).expand(F_, -1).contiguous().to(tdt)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.rand(B, F_, device=dev, generator=gen) * 2 - 1).to(tdt).requires_grad_()
    base_w = (torch.randn(F_, F_, device=dev, generator=gen) / F_ ** 0.5).to(tdt).requires_grad_()
    spline_w = (0.1 * torch.randn(F_, F_, G + k, device=dev, generator=gen)).to(tdt).requires_grad_()
    scaler = (torch.randn(F_, F_, device=dev, generator=gen) / F_ ** 0.5).to(tdt).requires_grad_()

    def b_splines(x):  # efficient-kan KANLinear.b_splines
        xe = x.unsqueeze(-1)
        bases = ((xe >= grid[:, :-1]) & (xe < grid[:, 1:])).to(x.dtype)
        for p in range(1, k + 1):
            bases = ((xe - grid[:, : -(p + 1)]) / (grid[:, p:-1] - grid[:, : -(p + 1)]) * bases[:, :, :-1]) + (
                (grid[:, p + 1:] - xe) / (grid[:, p + 1:] - grid[:, 1:(-p)]) * bases[:, :, 1:])
        return bases

    def step():
        y = F.linear(F.silu(x), base_w) + F.linear(
            b_splines(x).view(B, -1), (spline_w * scaler.unsqueeze(-1)).view(F_, -1))
        loss = (y.float() ** 2).mean()
        grads = torch.autograd.grad(loss, (x, base_w, spline_w, scaler))
        return loss, grads

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    flops, bytes_moved = kan_cost(B, F_, G, k, 2 if dtype_name == "bf16" else 4)
    return bm.Row(suite="kan", variant="torch efficient-kan autograd", sizes=dict(cfg), dtype=dtype_name,
                  precision="tf32" if tf32 else "highest", median_ms=times[len(times) // 2],
                  p10_ms=times[len(times) // 10], p90_ms=times[(9 * len(times)) // 10], min_ms=times[0],
                  repeats=repeats, peak_bytes=int(torch.cuda.max_memory_allocated()), flops=flops,
                  bytes_moved=bytes_moved, notes=f"torch {torch.__version__}, allow_tf32={tf32}")


def suite_kan(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """One KAN layer fwd+bwd (``value_and_grad`` of ``mean(y^2)`` w.r.t. all trained params and x)."""
    from jaxgrad.kan.layer import KANConfig, init

    variants = _kan_variants(precision)
    rows: list[bm.Row] = []
    dtypes = (jnp.float32,) if sizes == "small" or precision == "highest" else (jnp.float32, jnp.bfloat16)
    for cfg in KAN_CONFIGS[sizes]:
        for dtype in dtypes:
            if dtype == jnp.bfloat16 and cfg["grid_size"] != 5:
                continue
            kc = KANConfig(cfg["features"], cfg["features"], grid_size=cfg["grid_size"],
                           spline_order=cfg["spline_order"])
            params = jax.tree.map(lambda a: a.astype(dtype), init(jax.random.key(0), kc))
            x = jax.random.uniform(jax.random.key(1), (cfg["batch"], cfg["features"]), jnp.float32, -1, 1)
            flops, bytes_moved = kan_cost(cfg["batch"], cfg["features"], cfg["grid_size"], cfg["spline_order"],
                                          jnp.dtype(dtype).itemsize)
            rows += bm.run_variants("kan", variants, (params, x.astype(dtype)), sizes=dict(cfg), flops=flops,
                                    bytes_moved=bytes_moved, precision=precision,
                                    floor_precision="highest" if precision == "highest" else "tf32",
                                    warmup=warmup, repeats=repeats)
            if sizes == "full" and cfg["grid_size"] == 5 and cfg["spline_order"] == 3:
                row = _torch_efficient_kan(cfg, "bf16" if dtype == jnp.bfloat16 else "f32",
                                           tf32=precision != "highest", repeats=repeats, warmup=warmup)
                if row is not None:
                    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# CNN: the cryo-EM seed denoiser (1 -> 16 -> 16 -> 1, 3x3, ReLU, MSE)
# ---------------------------------------------------------------------------------------------------------------
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


def _torch_denoiser(cfg: dict, dtype_name: str, tf32: bool, repeats: int, warmup: int) -> bm.Row | None:
    """PyTorch cuDNN autograd of the same network (NCHW, channels_last off), in this run."""
    try:
        import torch
        from torch import nn
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import time

    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    layers = []
    for i, (cin, cout) in enumerate(zip(CNN_CHANNELS[:-1], CNN_CHANNELS[1:])):
        layers += [nn.Conv2d(cin, cout, 3, padding=1)] + ([nn.ReLU()] if i < len(CNN_CHANNELS) - 2 else [])
    net = nn.Sequential(*layers).to("cuda", tdt)
    shape = (cfg["batch"], 1, cfg["size"], cfg["size"])
    x = torch.randn(shape, device="cuda", dtype=tdt)
    t = torch.randn(shape, device="cuda", dtype=tdt)

    def step():
        net.zero_grad(set_to_none=True)
        loss = torch.mean((net(x).float() - t.float()) ** 2)
        loss.backward()
        return loss

    for _ in range(warmup + 2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    flops, bytes_moved = cnn_cost(cfg["batch"], cfg["size"], 2 if dtype_name == "bf16" else 4)
    return bm.Row(suite="cnn", variant="torch cuDNN autograd", sizes=dict(cfg), dtype=dtype_name,
                  precision="tf32" if tf32 else "highest", median_ms=times[len(times) // 2],
                  p10_ms=times[len(times) // 10], p90_ms=times[(9 * len(times)) // 10], min_ms=times[0],
                  repeats=repeats, peak_bytes=int(torch.cuda.max_memory_allocated()), flops=flops,
                  bytes_moved=bytes_moved,
                  notes=f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, allow_tf32={tf32}, "
                        f"cudnn.benchmark=True")


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
                row = _torch_denoiser(cfg, "bf16" if dtype == jnp.bfloat16 else "f32",
                                      tf32=precision != "highest", repeats=repeats, warmup=warmup)
                if row is not None:
                    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# LoRA block (jaxgrad/lora/bench.py): each variant in a fresh process
# ---------------------------------------------------------------------------------------------------------------
SUITE_NOTES: dict[str, list[str]] = {}  # extra lines a suite prints with its table and writes into its results


def suite_lora(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants=None,
               budget_s=None) -> list[bm.Row]:
    """One Llama block with LoRA on all 7 projections, fwd+bwd (LoRA grads + dx), bf16: our custom VJP (cuDNN /
    XLA attention, NF4 base), jax.grad of the plain block (cuDNN / XLA attention), transformers + PEFT."""
    from jaxgrad.bench.lora_block import suite_lora as run

    rows, notes = run(sizes, precision, repeats=repeats, warmup=warmup, variants=variants, budget_s=budget_s)
    SUITE_NOTES["lora"] = notes
    return rows


def suite_lora_model(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants=None,
                     budget_s=None) -> list[bm.Row]:
    """One whole training step (embedding, blocks, head, loss, LoRA grads, AdamW) of a small Llama with LoRA, bf16:
    tokens/s and peak memory of our custom VJP (cuDNN attention; Mosaic GPU projections), jax.grad of the plain
    model, transformers + PEFT; each variant in a fresh process (:mod:`jaxgrad.bench.lora_model`)."""
    from jaxgrad.bench.lora_model import suite_lora_model as run

    rows, notes = run(sizes, precision, repeats=repeats, warmup=warmup, variants=variants, budget_s=budget_s)
    SUITE_NOTES["lora_model"] = notes
    return rows


# ---------------------------------------------------------------------------------------------------------------
# One LoRA projection's forward (issue #13): the Mosaic GPU kernel against XLA, the block's four projection shapes
# ---------------------------------------------------------------------------------------------------------------
# (M, K, N): q/o, k/v, gate/up, down of the block at batch 4 x seq 2048, hidden 2048, intermediate 5632; r = 16
LORA_PROJ_SHAPES = {"small": [(512, 256, 128)],
                    "full": [(8192, 2048, 2048), (8192, 2048, 1024), (8192, 2048, 5632), (8192, 5632, 2048)]}
LORA_PROJ_RANK = 16


def lora_proj_cost(m: int, k: int, n: int, r: int) -> tuple[float, float]:
    """(flops, bytes) of ``Y = X W^T + s (X A^T) B^T``: ``2 M K N`` base, ``2 M K r + 2 M r N`` LoRA; bytes: X, W,
    A, B read and Y written once (bf16)."""
    return 2.0 * m * k * (n + r) + 2.0 * m * r * n, 2.0 * (m * k + n * k + r * k + n * r + m * n)


def _lora_proj_variants(on_gpu: bool) -> dict[str, Callable]:
    from jaxgrad.ops.lora_linear import lora_linear_fwd
    from jaxgrad.ops.lora_linear_mgpu import lora_linear_fwd_mgpu

    s = 2.0
    v = {"xla fold-b (block default)": lambda x, w, a, b: lora_linear_fwd(x, w, a, b, s, fold_b=True),
         "xla unfolded": lambda x, w, a, b: lora_linear_fwd(x, w, a, b, s),
         "x W^T alone (cuBLAS, no LoRA)": lambda x, w, a, b: lora_linear_fwd(x, w, None, None, s)}
    if on_gpu:
        from jaxgrad.ops.lora_linear_mgpu import TileConfig

        fly, rk = TileConfig(wgmma_in_flight=1), TileConfig(rank_from_xla=False)
        v = {"mosaic-gpu (sU from XLA, default)": lambda x, w, a, b: lora_linear_fwd_mgpu(x, w, a, b, s),
             "mosaic-gpu, wgmma in flight": lambda x, w, a, b: lora_linear_fwd_mgpu(x, w, a, b, s, fly),
             "mosaic-gpu fused (U in the K loop)": lambda x, w, a, b: lora_linear_fwd_mgpu(x, w, a, b, s, rk), **v}
    return v


def _lora_proj_dx_variants(on_gpu: bool) -> dict[str, Callable]:
    from jaxgrad.ops.lora_linear import lora_linear_bwd
    from jaxgrad.ops.lora_linear_mgpu import lora_linear_dx_mgpu

    s, f32 = 2.0, jnp.float32

    def xla_dx(dy, w, a, b):  # the block's XLA dX: dY W in fp32 + s (G A), G = dY B kept in fp32
        x = jnp.zeros((dy.shape[0], w.shape[1]), dy.dtype)  # dX does not read x; dA / dB are dead code here
        return lora_linear_bwd(x, w, a, b, s, None, dy, f32)[0]

    v = {"xla dX (block default)": xla_dx,
         "dY W alone (cuBLAS, no LoRA)": lambda dy, w, a, b: jnp.matmul(dy, w, preferred_element_type=f32)}
    if on_gpu:
        from jaxgrad.ops.lora_linear_mgpu import TileConfig

        fly, rk, bf16 = TileConfig(wgmma_in_flight=1), TileConfig(rank_from_xla=False), jnp.bfloat16
        v = {"mosaic-gpu dX, fp32 out": lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s),
             "mosaic-gpu dX, bf16 out (sG from XLA; mosaic block default)":
                 lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s, out_dtype=bf16),
             "mosaic-gpu dX, bf16 out, wgmma in flight":
                 lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s, out_dtype=bf16, config=fly),
             "mosaic-gpu fused dX, bf16 out (G in the K loop)":
                 lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s, out_dtype=bf16, config=rk),
             **_mosaic_example_variants(), **v}
    return v


def _mosaic_example_variants() -> dict[str, Callable]:
    """``dY W`` alone (no LoRA, bf16 out) by JAX's own Hopper matmul example (``hopper_matmul_mgpu``): the same
    warp-specialised pipeline as our kernel without its rank-r work, at our CTA tile (2 x 128 rows x 128 columns,
    k 64) with 3 and 4 stages, and at 128 rows x 2 x 128 columns -- what the LoRA terms cost our kernel, and what
    a plain Mosaic GPU GEMM reaches against cuBLAS at these shapes."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    def cfg(stages, wg_dim):
        return hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=stages, epi_tile_m=64,
                               epi_tile_n=64, grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                               wg_dimension=wg_dim)

    m_, n_ = hm.MatmulDimension.M, hm.MatmulDimension.N
    return {f"jax example mosaic dY W (no LoRA), {name}": (lambda c: lambda dy, w, a, b: hm.matmul(dy, w, None, c))(c)
            for name, c in (("CTA 256x128, 3 stages", cfg(3, m_)), ("CTA 256x128, 4 stages", cfg(4, m_)),
                            ("CTA 128x256, 4 stages", cfg(4, n_)))}


def suite_lora_proj(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """One LoRA projection's forward ``X W^T + s (X A^T) B^T`` (bf16, r = 16) at the block's four shapes: the Mosaic
    GPU kernel (:mod:`jaxgrad.ops.lora_linear_mgpu`; GPU only), XLA's fold-b and unfolded forms, and the base GEMM
    alone (what cuBLAS does without the LoRA terms); then (suite name ``lora_proj_dx``) its backward's
    ``dX = dY W + (s dY B) A`` in fp32: the Mosaic GPU kernel, the block's XLA form and ``dY W`` alone."""
    variants = _lora_proj_variants(jax.default_backend() == "gpu")
    dx_variants = _lora_proj_dx_variants(jax.default_backend() == "gpu")
    rows: list[bm.Row] = []
    for m, k, n in LORA_PROJ_SHAPES[sizes]:
        r = LORA_PROJ_RANK
        keys = jax.random.split(jax.random.key(m + k + n), 4)
        x, w, a, b = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) * sd
                      for kk, shape, sd in zip(keys, [(m, k), (n, k), (r, k), (n, r)],
                                               [1.0, k ** -0.5, k ** -0.5, r ** -0.5]))
        flops, bytes_moved = lora_proj_cost(m, k, n, r)
        rows += bm.run_variants("lora_proj", variants, (x, w, a, b), sizes={"M": m, "K": k, "N": n, "r": r},
                                flops=flops, bytes_moved=bytes_moved, precision=precision, floor_precision="tf32",
                                warmup=warmup, repeats=repeats)
        # the backward's dX = dY W + (s dY B) A of the same projection (fp32 out, as the block keeps it)
        dy = jax.random.normal(jax.random.fold_in(keys[0], 1), (m, n), jnp.float32).astype(jnp.bfloat16)
        flops, bytes_moved = lora_proj_cost(m, n, k, r)
        bytes_moved += 2.0 * m * k  # dX written in fp32
        rows += bm.run_variants("lora_proj_dx", dx_variants, (dy, w, a, b), sizes={"M": m, "K": k, "N": n, "r": r},
                                flops=flops, bytes_moved=bytes_moved, precision=precision, floor_precision="tf32",
                                warmup=warmup, repeats=repeats)
    return rows


def suite_attention(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """The block's causal GQA attention fwd+bwd, bf16: cuDNN, our Pallas flash kernels, our XLA VJP, jax.grad
    (:mod:`jaxgrad.bench.attention`)."""
    from jaxgrad.bench.attention import suite_attention as run

    return run(sizes, precision, repeats=repeats, warmup=warmup)


SUITES: dict[str, Callable[..., list[bm.Row]]] = {"swiglu": suite_swiglu, "kan": suite_kan, "cnn": suite_cnn,
                                                  "lora": suite_lora, "lora_model": suite_lora_model,
                                                  "lora_proj": suite_lora_proj, "attention": suite_attention}
FRESH_PROCESS_SUITES = ("lora", "lora_model")  # each variant in a child process: --variants, --budget-s
DEFAULT_OUT = bm.DEFAULT_RESULTS_DIR  # runs/bench: git-ignored; --out benchmarks/results to commit a result


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--sizes", choices=["small", "full", "long"], default=None,
                   help="problem sizes (default: full on a GPU, small elsewhere; long: lora / attention at seq 8192)")
    p.add_argument("--out", default=DEFAULT_OUT, help="results directory (default: %(default)s, git-ignored; "
                                                      "--out benchmarks/results adds a result to the committed "
                                                      "ones the README's tables are made from)")
    p.add_argument("--repeats", type=_int_at_least(1), default=20,
                   help="timed calls per variant (default: %(default)s)")
    p.add_argument("--warmup", type=_int_at_least(0), default=3,
                   help="untimed calls per variant (default: %(default)s)")
    p.add_argument("--precision", choices=["default", "highest"], default="default",
                   help="jax default matmul precision for the whole run (default: %(default)s)")
    p.add_argument("--variants", default=None,
                   help="comma-separated substrings: run only the variants whose name contains one (lora, "
                        "lora_model suites)")
    p.add_argument("--budget-s", type=_positive_float, default=None,
                   help="wall-clock budget of the whole suite in seconds (lora, lora_model suites: variants that "
                        "do not fit are not started)")
    return p


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    for parent in (out, *out.parents):  # checked now, not after the suite has run
        if parent.exists() and not parent.is_dir():
            parser.error(f"--out {args.out}: {parent} exists and is not a directory")
    if args.sizes == "long" and args.suite not in ("lora", "attention"):
        parser.error(f"--sizes long is only defined for the lora and attention suites (seq 8192), not {args.suite!r}")
    if (args.variants or args.budget_s is not None) and args.suite not in FRESH_PROCESS_SUITES:
        parser.error(f"--variants and --budget-s are only implemented for the {' and '.join(FRESH_PROCESS_SUITES)} "
                     f"suites, not {args.suite!r}")
    if args.suite in FRESH_PROCESS_SUITES:  # variants in child processes: this one must not preallocate the GPU
        from jaxgrad.bench.lora_block import parent_setup

        parent_setup()
    sizes = args.sizes or ("full" if jax.default_backend() == "gpu" else "small")
    ctx = jax.default_matmul_precision("highest") if args.precision == "highest" else contextlib.nullcontext()
    extra = {}
    if args.variants:
        extra["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.budget_s is not None:
        extra["budget_s"] = args.budget_s
    with ctx:
        env = bm.environment()
        rows = SUITES[args.suite](sizes, args.precision, repeats=args.repeats, warmup=args.warmup, **extra)
    notes = SUITE_NOTES.get(args.suite, [])
    if notes:
        env["suite_notes"] = notes
    table = bm.format_table(rows, env) + "".join(f"# {line}\n" for line in notes)
    print(table, end="")
    path = bm.write_results(rows, args.suite, args.out, env=env)
    if notes:
        path.with_suffix(".txt").write_text(table)
    print(f"wrote {path.resolve()} and {path.with_suffix('.txt').name}")
    skipped = [r.variant for r in rows if r.median_ms is None and r.notes.startswith("skipped")]
    if skipped:
        print(f"note: {len(skipped)} variant(s) skipped: {skipped}")
    failed = [r.variant for r in rows if r.median_ms is None and not r.notes.startswith("skipped")]
    if failed:
        print(f"error: {len(failed)} variant run(s) failed: {sorted(set(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
