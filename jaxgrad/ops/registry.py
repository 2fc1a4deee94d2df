"""What ``jaxgrad audit`` checks: every custom VJP of the package, on every backend it has.

Each op's module contributes ``audit_cases()``, a tuple of :class:`OpAudit`: the op on one backend (its name reads
``op[backend]``), its plain-JAX reference, white-noise inputs at a few increasing sizes. Nothing is registered at
import time: :data:`AUDIT_MODULES` lists the modules, and ``tests/test_audit_registry.py`` fails when a
``jax.custom_vjp`` of the package is reached by no case (and is not exempted there with its reason).

Backends and where they run (:func:`run_mode`):

* ``"xla"``: the hand-written VJP in ``jnp``; runs anywhere, compiled.
* ``"pallas"``: Pallas kernels, compiled by Triton on a GPU; elsewhere in Pallas interpret mode, at the case's
  ``interpret_sizes`` (the interpreter runs every grid step as XLA ops: slow) or, where even that is too slow,
  not at all (``interpret_sizes=()``: "GPU only").
* ``"mosaic"``: Mosaic GPU kernels (Hopper ``wgmma``); Mosaic GPU has no interpreter, so GPU only.
* ``"cudnn"``: cuDNN's attention through ``jax.nn.dot_product_attention``; GPU only.

A case that does not run on the platform is reported as not run, with the reason (:func:`not_run_here`), never
dropped silently.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The modules with ``audit_cases()``, in the order ``jaxgrad audit`` runs them.
AUDIT_MODULES = ("jaxgrad.ops.swiglu", "jaxgrad.ops.rmsnorm", "jaxgrad.ops.rope", "jaxgrad.ops.attention",
                 "jaxgrad.ops.flash_attention", "jaxgrad.ops.lora_linear", "jaxgrad.ops.nf4_matmul",
                 "jaxgrad.ops.lm_head_loss",
                 "jaxgrad.kan.layer", "jaxgrad.cnn.conv", "jaxgrad.lora.audit")

BACKENDS = {
    "xla": "the custom VJP in jnp",
    "pallas": "Pallas kernels (Triton on a GPU, interpret mode elsewhere)",
    "mosaic": "Mosaic GPU kernels (Hopper)",
    "cudnn": "cuDNN attention",
}
GPU_ONLY_BACKENDS = {"mosaic": "Mosaic GPU has no interpreter: needs a Hopper GPU",
                     "cudnn": "cuDNN runs on a GPU only"}


@dataclasses.dataclass(frozen=True)
class OpAudit:
    """One op on one backend, as ``jaxgrad audit`` checks it.

    Attributes:
      name: ``op[backend]`` (optionally followed by what else the case fixes, e.g. conv2d's geometry).
      fn, reference: the op under test and its plain-JAX reference, with the same signature (frozen inputs --
        weights without a gradient, masks, NF4 codes -- are closed over).
      make_args: ``(key, size) -> args``: white noise, asymmetric shapes, every leaf floating point.
      sizes: increasing problem sizes (whatever ``make_args`` understands), as run where the backend is compiled.
      arg_names: names of ``fn``'s positional arguments for the report.
      backend: one of :data:`BACKENDS`.
      interpret_sizes: ``"pallas"`` only: the sizes in interpret mode (off a GPU); ``None``: ``sizes``; ``()``:
        not run in interpret mode (too slow there: GPU only).
    """

    name: str
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    make_args: Callable[[Any, Any], tuple]
    sizes: Sequence[Any]
    arg_names: tuple[str, ...] | None = None
    backend: str = "xla"
    interpret_sizes: Sequence[Any] | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"OpAudit {self.name!r}: 'backend' must be one of {sorted(BACKENDS)}, got "
                             f"{self.backend!r}")
        if not self.sizes:
            raise ValueError(f"OpAudit {self.name!r}: 'sizes' must name at least one problem size")

    @property
    def op(self) -> str:
        """The op's name without the backend: ``"swiglu"`` for ``"swiglu[pallas]"``."""
        return self.name.split("[", 1)[0]


def run_mode(case: OpAudit, platform: str) -> tuple[str | None, str]:
    """``(mode, why)`` of ``case`` on ``platform`` (``jax.default_backend()``: ``"cpu"``, ``"gpu"``, ...):
    ``mode`` is ``"compiled"``, ``"interpret mode"`` or ``None`` (not run here; ``why`` says why)."""
    if case.backend in GPU_ONLY_BACKENDS:
        return ("compiled", "") if platform == "gpu" else (None, GPU_ONLY_BACKENDS[case.backend])
    if case.backend == "pallas" and platform != "gpu":
        if case.interpret_sizes is not None and not case.interpret_sizes:
            return None, "interpret mode too slow at any useful size: its kernels are audited on a GPU"
        return "interpret mode", ""
    return "compiled", ""


def sizes_on(case: OpAudit, platform: str) -> tuple:
    """The sizes ``case`` runs at on ``platform`` (``()`` where it does not run there)."""
    mode, _ = run_mode(case, platform)
    if mode is None:
        return ()
    if mode == "interpret mode" and case.interpret_sizes is not None:
        return tuple(case.interpret_sizes)
    return tuple(case.sizes)


def every_audit_case() -> tuple[OpAudit, ...]:
    """Every registered case, every backend, wherever it runs (:data:`AUDIT_MODULES` order)."""
    cases = tuple(case for m in AUDIT_MODULES for case in importlib.import_module(m).audit_cases())
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"audit cases with the same name: {dup}")
    return cases


def _platform(platform: str | None) -> str:
    if platform is not None:
        return platform
    import jax

    return jax.default_backend()


def all_audit_cases(platform: str | None = None) -> tuple[OpAudit, ...]:
    """The cases that run on ``platform`` (default: JAX's default backend), each with the sizes it runs at there
    (interpreted Pallas kernels at their ``interpret_sizes``); :func:`not_run_here` lists the others."""
    platform = _platform(platform)
    return tuple(dataclasses.replace(c, sizes=sizes_on(c, platform)) for c in every_audit_case()
                 if run_mode(c, platform)[0] is not None)


def not_run_here(platform: str | None = None) -> tuple[tuple[OpAudit, str], ...]:
    """``(case, why)`` for each case that does not run on ``platform``."""
    platform = _platform(platform)
    return tuple((c, run_mode(c, platform)[1]) for c in every_audit_case() if run_mode(c, platform)[0] is None)


@functools.lru_cache(maxsize=64)
def _frozen_normal(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def frozen_normal(shape: Sequence[int], seed: int, scale: float = 1.0) -> np.ndarray:
    """A fixed float32 white-noise array for a frozen input that an audit case closes over (a weight with no
    gradient): the same values for the same ``(shape, seed)``, host memory only (a constant of every trace)."""
    return _frozen_normal(tuple(int(s) for s in shape), int(seed)) * np.float32(scale)
