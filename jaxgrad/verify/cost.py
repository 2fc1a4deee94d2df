"""What a verdict costs: the wall time per stage of one :func:`jaxgrad.verify.check_vjp`, and how the verifier
compiles its own programs.

**Time per stage** (``VJPReport.timings``, the report's last line). ``check_vjp`` opens :func:`recording` and calls
:func:`lap` at the end of each of its stages: the time since the previous lap goes to that stage. The modules it
calls time their own work with :func:`stage` (the magnitude pass, the emulated replicas, the float64 oracle at the
replicas' points); a lap does not count again what a stage inside it recorded. Times are wall seconds, compilation
included. Outside a recording both cost one ``perf_counter`` call and record nothing.

**The verifier's own programs** (:func:`jit`). A verdict runs each of its programs a few times on small inputs, so
their compilation, not their run, is the cost. The magnitude program (also the float64 oracle), the emulated
replicas, fn's float64 re-run, the finite differences and the adjoint test are compiled with :func:`options`:

* on the CPU, LLVM at optimisation level 0 (the bf16 LoRA block's magnitude program: 9.3 s -> 2.7 s on a loaded
  2-core machine, its run as fast; the block's results are bit-identical: the optimisation level does not change
  XLA's floating-point semantics, no reassociation or contraction at any level), except for a program that
  convolves (``convolves=True``): XLA's CPU backend emits a convolution as loops that level 0 leaves about ten
  times slower, and such a program runs once per replica as the float64 oracle (the 16-channel denoiser's magnitude
  program at 2 x 128 x 128: 0.57 s a run at level 0, 0.054 s at level 1, compiled as fast);
* on a GPU, the products go to cuBLAS with its default algorithm: no Triton GEMM fusions and no autotuning (a Triton
  kernel is compiled for every product and every candidate tiling: the block's magnitude program 7.4 s -> 3.7 s,
  its replicas 3.7 s -> 1.7 s on an H100), and the kernels are compiled on every host core. The products are still
  f32-accumulated GEMMs at the precision the program asks (HIGHEST in the replicas), as a kernel computes them.

The run of ``fn`` as called, whose rounding is under test, is compiled as the user's own code is, with defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["COMPILER_OPTIONS", "CONVOLVING_CPU_LEVEL", "jit", "lap", "options", "recording", "stage"]


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# XLA options of the verifier's own programs, per platform (module doc)
COMPILER_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0},
    "gpu": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
            "xla_gpu_force_compilation_parallelism": _cpus()},
}


# on the CPU, the optimisation level of a program that convolves (module doc)
CONVOLVING_CPU_LEVEL = 1


def options(platform: str | None = None, *, convolves: bool = False) -> dict[str, Any]:
    """The options of :data:`COMPILER_OPTIONS` for ``platform`` (default: JAX's default backend); none elsewhere.
    ``convolves``: the program has a convolution (on the CPU, compiled at :data:`CONVOLVING_CPU_LEVEL`)."""
    platform = platform or jax.default_backend()
    opts = dict(COMPILER_OPTIONS.get(platform, {}))
    if convolves and platform == "cpu":
        opts["xla_backend_optimization_level"] = CONVOLVING_CPU_LEVEL
    return opts


def jit(fun: Callable[..., Any], *, convolves: bool = False, **kwargs: Any) -> Any:
    """``jax.jit`` with :func:`options`: for a program the verifier itself runs (module doc)."""
    return jax.jit(fun, compiler_options=options(convolves=convolves), **kwargs)


class _Recording:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()
        self.inner = 0.0  # seconds recorded by stages since the last lap
        self.depth = 0

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + max(seconds, 0.0)


_ACTIVE: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("jaxgrad_verify_timings", default=None)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the stages and laps inside the block into the yielded dict (seconds per stage name, in the order
    they first occurred)."""
    rec = _Recording()
    token = _ACTIVE.set(rec)
    try:
        yield rec.times
    finally:
        _ACTIVE.reset(token)


def lap(name: str) -> None:
    """Add the time since the previous lap (or the start of the recording), less what stages recorded meanwhile, to
    stage ``name``."""
    rec = _ACTIVE.get()
    if rec is None:
        return
    now = time.perf_counter()
    rec.add(name, now - rec.last - rec.inner)
    rec.last, rec.inner = now, 0.0


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Add the block's wall time to stage ``name`` of the active recording (none: nothing is recorded). A stage inside
    another one is counted in both."""
    rec = _ACTIVE.get()
    t0 = time.perf_counter()
    if rec is not None:
        rec.depth += 1
    try:
        yield
    finally:
        if rec is not None:
            dt = time.perf_counter() - t0
            rec.depth -= 1
            rec.add(name, dt)
            if rec.depth == 0:
                rec.inner += dt
