"""The PyTorch side of the suites: what torch needs to run a peer, how it is timed, and the KAN and CNN peers.

Every peer is timed by the harness's clock (:func:`jaxgrad.bench.harness.time_fn`): wall time of each call,
``torch.cuda.synchronize()`` after it, median of ``repeats`` calls after ``warmup``; peak memory is
``torch.cuda.max_memory_allocated()``. The LoRA block's and the LoRA model's peers (transformers + PEFT) share their
suites' inputs and live beside them (:mod:`jaxgrad.bench.lora_block`, :mod:`jaxgrad.bench.lora_model`); they use
:func:`sdpa_llama_config`, :func:`torch_missing` and :func:`time_torch` from here.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from jaxgrad.bench import harness as bm

__all__ = ["cudnn_denoiser", "efficient_kan", "sdpa_llama_config", "time_torch", "torch_missing"]


def sdpa_llama_config(transformers, rope_theta: float, **kw):
    """A transformers ``LlamaConfig`` with SDPA attention (refused if the installed version picks another), its RoPE
    base set to ``rope_theta`` whichever field the version keeps it in."""
    try:
        cfg = transformers.LlamaConfig(**kw, rope_theta=rope_theta, attn_implementation="sdpa")
    except TypeError:
        cfg = transformers.LlamaConfig(**kw, rope_theta=rope_theta)
    cfg._attn_implementation = "sdpa"
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        raise RuntimeError(f"transformers config: attention implementation {cfg._attn_implementation!r}, not sdpa")
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and float(rp.get("rope_theta", rope_theta)) != rope_theta:
        cfg.rope_parameters = {**rp, "rope_theta": rope_theta}
    return cfg


def missing_modules(names) -> str | None:
    """``"skipped: ... not installed"`` naming the modules of ``names`` that are not installed (checked without
    importing them), or None."""
    gone = [m for m in names if importlib.util.find_spec(m) is None]
    return f"skipped: {', '.join(gone)} not installed" if gone else None


def torch_missing() -> str | None:
    """Why the torch variant cannot run here (None if it can, as far as imports go)."""
    return missing_modules(("torch", "transformers", "peft"))


def cuda_unavailable(why_missing: str | None) -> str | None:
    """Why a torch peer cannot run here: ``why_missing`` (its packages) if set, else whether torch sees a CUDA
    device (torch is imported only then); None if it can run."""
    if why_missing:
        return why_missing
    import torch

    return None if torch.cuda.is_available() else "skipped: torch sees no CUDA device"


def time_torch(step, row: bm.Row, *, warmup: int, repeats: int) -> None:
    """Time a CUDA ``step()`` into ``row``: the first call (kernel selection, lazy init) as ``compile_ms``, then
    ``warmup`` untimed calls, then ``repeats`` calls each ended by ``torch.cuda.synchronize()`` (the harness's
    clock: :func:`jaxgrad.bench.harness.time_fn`); ``peak_bytes`` = ``torch.cuda.max_memory_allocated()`` since the
    process started (never reset). The outputs are dropped as they come (none is kept alive across calls)."""
    import torch

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    row.compile_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(max(0, warmup)):
        step()
    torch.cuda.synchronize()
    times = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times[i] = (time.perf_counter() - t0) * 1e3
    row.median_ms, row.p10_ms = float(np.median(times)), float(np.percentile(times, 10))
    row.p90_ms, row.min_ms, row.repeats = float(np.percentile(times, 90)), float(times.min()), repeats
    row.peak_bytes = int(torch.cuda.max_memory_allocated())  # since the process started, never reset


def efficient_kan(cfg: dict, dtype_name: str, tf32: bool, repeats: int, warmup: int, *, flops: float,
                  bytes_moved: float) -> bm.Row | None:
    """PyTorch autograd of efficient-kan's KANLinear math (b_splines + two F.linear), same sizes, in this run
    (``None`` without torch or CUDA). ``flops``, ``bytes_moved``: the suite's model of the computation."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
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
    return bm.Row(suite="kan", variant="torch efficient-kan autograd", sizes=dict(cfg), dtype=dtype_name,
                  precision="tf32" if tf32 else "highest", median_ms=times[len(times) // 2],
                  p10_ms=times[len(times) // 10], p90_ms=times[(9 * len(times)) // 10], min_ms=times[0],
                  repeats=repeats, peak_bytes=int(torch.cuda.max_memory_allocated()), flops=flops,
                  bytes_moved=bytes_moved, notes=f"torch {torch.__version__}, allow_tf32={tf32}")


def cudnn_denoiser(cfg: dict, dtype_name: str, tf32: bool, repeats: int, warmup: int, *, flops: float,
                   bytes_moved: float, channels: tuple[int, ...]) -> bm.Row | None:
    """PyTorch cuDNN autograd of the same network (NCHW, channels_last off), in this run (``None``
    without torch or CUDA). ``channels``: the layers' widths; ``flops``, ``bytes_moved``: the suite's model."""
    try:
        import torch
        from torch import nn
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    layers = []
    for i, (cin, cout) in enumerate(zip(channels[:-1], channels[1:])):
        layers += [nn.Conv2d(cin, cout, 3, padding=1)] + ([nn.ReLU()] if i < len(channels) - 2 else [])
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
    return bm.Row(suite="cnn", variant="torch cuDNN autograd", sizes=dict(cfg), dtype=dtype_name,
                  precision="tf32" if tf32 else "highest", median_ms=times[len(times) // 2],
                  p10_ms=times[len(times) // 10], p90_ms=times[(9 * len(times)) // 10], min_ms=times[0],
                  repeats=repeats, peak_bytes=int(torch.cuda.max_memory_allocated()), flops=flops,
                  bytes_moved=bytes_moved,
                  notes=f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, allow_tf32={tf32}, "
                        f"cudnn.benchmark=True")
