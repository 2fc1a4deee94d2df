r"""Shared benchmark harness: timing, compiled memory, roofline floors, result tables and files.

Every jaxgrad benchmark (SwiGLU, KAN, conv, LoRA) goes through :func:`run_variants`, which compiles, measures and
times each variant of one computation **inside one process, one after the other**: the GPU machines are shared and
noisy, so only numbers taken side by side in the same run are compared.

Floors
------
A *floor* is a lower bound on the run time of a computation on a given device, from the roofline model:

.. math::

    t_\text{compute} = \frac{\text{FLOPs}}{P_\text{peak}}, \qquad
    t_\text{memory}  = \frac{\text{bytes moved}}{B_\text{HBM}}, \qquad
    t_\text{floor}   = \max(t_\text{compute},\, t_\text{memory}).

No kernel can finish before it has done its arithmetic at the unit's peak rate, nor before it has moved its bytes
through HBM at peak bandwidth, hence the max. The *achieved fraction* is :math:`t_\text{floor} / t_\text{median}`
(1.0 = at the roofline; elementwise kernels usually top out near 0.8-0.9 of the HBM peak). A fraction above 1 means
the ``bytes_moved``/``flops`` model given for the computation is not a bound for that variant (e.g. XLA fused away
a round trip through memory), not that the hardware went faster than its data sheet.

Peak numbers (:data:`PEAKS`) are NVIDIA data-sheet figures, *dense* (no 2:4 sparsity):

============  =============  ============  ============  ====================
device        HBM B/s        TF32 FLOP/s   BF16 FLOP/s   FP32 (no TC) FLOP/s
============  =============  ============  ============  ====================
H100 SXM      3.35e12 HBM3   494.7e12      989e12        66.9e12
H200          4.8e12  HBM3e  494.7e12      989e12        66.9e12
============  =============  ============  ============  ====================

Which compute peak applies is the ``precision`` argument of :func:`floor_ms`: ``"tf32"``/``"default"`` (f32
dots and convs on tensor cores, XLA's default on NVIDIA GPUs), ``"highest"`` (true f32 matmuls, FP32 units), or
``"elementwise"`` (non-matmul math on the FP32 vector units, whatever the storage dtype). bf16/f16 operands with a
tensor-core precision use the BF16 peak. On CPU or an unknown device every floor is ``None``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import pathlib
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxgrad.bench.environment import (device_slug, dtype_name, environment, precision_slug, provenance,  # noqa: F401
                                       result_stem)
from jaxgrad.bench.roofline import PEAKS, DevicePeaks, floor_ms, lookup_peaks  # noqa: F401

__all__ = [
    "DEFAULT_RESULTS_DIR",
    "PEAKS",
    "DevicePeaks",
    "Row",
    "Terminated",
    "compile_fn",
    "compiled_memory",
    "device_peak_bytes",
    "device_slug",
    "dtype_name",
    "environment",
    "floor_ms",
    "format_table",
    "lookup_peaks",
    "memory_of",
    "precision_slug",
    "provenance",
    "result_stem",
    "run_variants",
    "selects",
    "stops_on_sigterm",
    "time_fn",
    "write_results",
]


# ---------------------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------------------
_IN_FLIGHT = 2  # calls dispatched ahead of the one loop_ms waits for: a training loop's overlap, bounded memory


def time_fn(fn: Callable[..., Any], *args: Any, warmup: int = 3, repeats: int = 20) -> dict[str, float | int]:
    """Wall-clock time of ``fn(*args)`` in milliseconds, waiting for every output (``jax.block_until_ready``).

    ``fn`` should be jitted (or a ``Compiled``); the first ``warmup`` calls (compilation, autotuning, caches) are
    not timed. Each of the ``repeats`` timed calls includes the host's work to launch it (Python dispatch and the
    executable's launches, which the GPU waits for: the latency of one call). ``loop_ms`` is the mean time of a
    call when ``repeats`` calls are dispatched back to back, as a training loop that does not wait for each step
    runs them: each call's host work overlaps the GPU work of the calls before it. At most ``_IN_FLIGHT`` calls run
    ahead of the oldest one not yet waited for, so that as few outputs are alive at once as in such a loop.

    Returns:
      ``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``loop_ms`` and ``repeats``.
    """
    if repeats < 1:
        raise ValueError(f"time_fn: repeats must be >= 1, got {repeats}")
    for _ in range(max(0, warmup)):
        jax.block_until_ready(fn(*args))
    times = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[i] = time.perf_counter() - t0
    ms = times * 1e3
    # back to back, at most _IN_FLIGHT calls ahead of the one waited for (their outputs are alive together)
    t0 = time.perf_counter()
    pending: collections.deque = collections.deque()
    for _ in range(repeats):
        pending.append(fn(*args))
        if len(pending) > _IN_FLIGHT:
            jax.block_until_ready(pending.popleft())
    jax.block_until_ready(list(pending))
    loop_ms = (time.perf_counter() - t0) * 1e3 / repeats
    del pending
    return {
        "median_ms": float(np.median(ms)),
        "p10_ms": float(np.percentile(ms, 10)),
        "p90_ms": float(np.percentile(ms, 90)),
        "min_ms": float(ms.min()),
        "loop_ms": float(loop_ms),
        "repeats": int(repeats),
    }


def compile_fn(fn: Callable[..., Any], *args: Any) -> jax.stages.Compiled:
    """``jax.jit(fn).lower(*args).compile()``: one executable, used for both memory analysis and timing."""
    return jax.jit(fn).lower(*args).compile()


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None)
    return None if value is None else int(value)


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int | None]:
    """Buffer sizes XLA assigned to one executable (``compiled.memory_analysis()``), in bytes.

    ``total_bytes = argument_bytes + output_bytes + temp_bytes`` (the missing ones counted as 0; ``None`` if the
    backend reports nothing). This is a per-executable figure, unlike the device high-water mark. Output buffers
    aliased to donated arguments (``alias_bytes``) are counted in both arguments and outputs.
    """
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        ma = None
    out: dict[str, int | None] = {
        "argument_bytes": _int_attr(ma, "argument_size_in_bytes"),
        "output_bytes": _int_attr(ma, "output_size_in_bytes"),
        "temp_bytes": _int_attr(ma, "temp_size_in_bytes"),
        "alias_bytes": _int_attr(ma, "alias_size_in_bytes"),
    }
    parts = [out[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")]
    out["total_bytes"] = None if all(p is None for p in parts) else sum(p or 0 for p in parts)
    return out


def device_peak_bytes(device: jax.Device | None = None) -> int | None:
    """``peak_bytes_in_use`` from the device allocator, or ``None`` where unavailable (CPU).

    This is a **process-wide high-water mark** since start-up (it includes every earlier variant, input and
    leftover buffer), so it only bounds a variant's footprint from above; the per-variant figure is
    :func:`compiled_memory`'s ``total_bytes``.
    """
    dev = jax.devices()[0] if device is None else device
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001
        stats = None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def memory_of(fn: Callable[..., Any], *args: Any) -> dict[str, int | None]:
    """Memory of ``fn(*args)``: :func:`compiled_memory` of its executable plus ``device_peak_bytes``.

    ``device_peak_bytes`` is the allocator's process-wide high-water mark (GPU only, else ``None``); compare
    variants with the compiled ``total_bytes``, which is per variant.
    """
    mem = compiled_memory(compile_fn(fn, *args))
    mem["device_peak_bytes"] = device_peak_bytes()
    return mem



# ---------------------------------------------------------------------------------------------------------------
# Rows and runs
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One measured variant. Times in ms, memory in bytes; ``None`` where not measured/available."""

    suite: str
    variant: str
    sizes: dict[str, Any]
    dtype: str
    precision: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    min_ms: float | None = None
    loop_ms: float | None = None  # per call, dispatched back to back (time_fn)
    repeats: int = 0
    compile_ms: float | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    compiled_bytes: int | None = None  # argument + output + temp of this variant's executable
    peak_bytes: int | None = None  # device allocator high-water mark (process-wide), GPU only
    flops: float | None = None
    bytes_moved: float | None = None
    floor_ms: float | None = None
    floor_bound: str | None = None
    floor_table_row: str | None = None
    achieved_fraction: float | None = None  # floor_ms / median_ms
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _current_precision() -> str:
    value = jax.config.jax_default_matmul_precision
    return "default" if value is None else str(value)


class Terminated(BaseException):
    """The process got SIGTERM (``timeout``'s signal) inside :func:`stops_on_sigterm`. Not an ``Exception``, so
    that no variant's error handling records it as that variant's failure."""


_MEASURED: list[list] = []  # the row lists of the active stops_on_sigterm blocks (innermost last)


@contextlib.contextmanager
def stops_on_sigterm():
    """Inside the block SIGTERM raises :class:`Terminated` (between two Python operations: a compilation or a run
    in progress finishes first), and every row :func:`run_variants` measures is appended to the yielded list, so
    that a suite stopped by ``timeout`` still writes the rows it measured."""
    measured: list = []

    def stop(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    _MEASURED.append(measured)
    try:
        yield measured
    finally:
        _MEASURED.pop()
        signal.signal(signal.SIGTERM, previous)


def selects(variants, name: str) -> bool:
    """Whether ``variants`` (``--variants``: substrings; ``=name`` exact) select the variant ``name``."""
    return any(name == v[1:] if v.startswith("=") else v in name for v in variants)


def run_variants(
    suite: str,
    variants: Mapping[str, Callable[..., Any]],
    args: Sequence[Any],
    sizes: Mapping[str, Any],
    flops: float | None = None,
    bytes_moved: float | None = None,
    *,
    dtype: Any = None,
    precision: str | None = None,
    floor_precision: str | None = None,
    warmup: int = 3,
    repeats: int = 20,
    notes: str = "",
    raise_errors: bool = False,
) -> list[Row]:
    """Compile, measure and time every variant on the same ``args``, one after the other in this process.

    Each variant is compiled once (``jax.jit(fn).lower(*args).compile()``); that executable gives the memory
    figures and is the one timed. ``flops``/``bytes_moved`` describe the computation (the same for all variants)
    and feed :func:`floor_ms`.

    Args:
      suite: suite name recorded in each row.
      variants: ``{name: fn}``; each ``fn(*args)`` computes the same thing.
      args: positional arguments shared by all variants.
      sizes: problem sizes recorded in each row.
      flops, bytes_moved: the computation's model for the floor (``None``: no such floor).
      dtype: recorded dtype (default: that of the first array in ``args``).
      precision: recorded matmul precision (default: the ``jax_default_matmul_precision`` in force, which is
        what applies when the variants are traced here).
      floor_precision: the ``precision`` passed to :func:`floor_ms` (default: ``"highest"`` if ``precision`` is
        ``"highest"``, else ``"tf32"``; use ``"elementwise"`` for non-matmul work).
      warmup, repeats: see :func:`time_fn`.
      notes: free text copied into every row.
      raise_errors: re-raise a variant's exception instead of recording it in that row's ``notes``.
    """
    args = tuple(args)
    dtype_str = dtype_name(args if dtype is None else dtype)
    precision = _current_precision() if precision is None else precision
    if floor_precision is None:
        floor_precision = "highest" if precision == "highest" else "tf32"
    floor = floor_ms(flops, bytes_moved, dtype=dtype_str, precision=floor_precision)
    rows = []
    for name, fn in variants.items():
        row = Row(
            suite=suite,
            variant=name,
            sizes=dict(sizes),
            dtype=dtype_str,
            precision=precision,
            flops=flops,
            bytes_moved=bytes_moved,
            floor_ms=floor["floor_ms"],
            floor_bound=floor["bound"],
            floor_table_row=floor["table_row"],
            notes=notes,
        )
        try:
            t0 = time.perf_counter()
            compiled = compile_fn(fn, *args)
            row.compile_ms = (time.perf_counter() - t0) * 1e3
            mem = compiled_memory(compiled)
            row.argument_bytes = mem["argument_bytes"]
            row.output_bytes = mem["output_bytes"]
            row.temp_bytes = mem["temp_bytes"]
            row.compiled_bytes = mem["total_bytes"]
            timing = time_fn(compiled, *args, warmup=warmup, repeats=repeats)
            row.median_ms, row.p10_ms, row.p90_ms = timing["median_ms"], timing["p10_ms"], timing["p90_ms"]
            row.min_ms, row.loop_ms, row.repeats = timing["min_ms"], timing["loop_ms"], timing["repeats"]
            row.peak_bytes = device_peak_bytes()
            if row.floor_ms is not None and row.median_ms:
                row.achieved_fraction = row.floor_ms / row.median_ms
            del compiled
        except Exception as e:  # noqa: BLE001 - one failing variant (e.g. OOM) must not lose the others
            if raise_errors:
                raise
            msg = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            row.notes = f"{notes}; {msg}" if notes else msg
        rows.append(row)
        if _MEASURED:
            _MEASURED[-1].append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _fmt_sizes(sizes: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in sizes.items())


def format_table(rows: Sequence[Row], env: Mapping[str, Any] | None = None) -> str:
    """Plain-text table of ``rows`` (aligned columns) under ``#`` header lines describing the environment."""
    env = environment() if env is None else env
    header = [
        f"# device: {env.get('device_kind')} x{env.get('device_count')} ({env.get('platform')}), "
        f"host {env.get('hostname')}, {env.get('datetime_utc')}",
        f"# jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuda plugin {env.get('cuda_plugin')}, "
        f"python {env.get('python')}",
        f"# matmul precision: {env.get('matmul_precision')}; pallas: {env.get('pallas')}"
        + (f"; XLA_FLAGS: {env['xla_flags']}" if env.get("xla_flags") else ""),
        f"# commit {env.get('commit')} (uncommitted changes: {env.get('dirty')}); command: {env.get('command')}",
        "# loop_ms = a call's time when the calls are dispatched back to back (a training loop that does not wait "
        "for each step); floor = max(flops / peak FLOP/s, bytes_moved / HBM B/s); frac = floor / median; "
        "memory in MiB (compiled = arg+out+temp of the variant; peak = process-wide high-water mark)",
    ]
    cols = ["suite", "variant", "sizes", "dtype", "prec", "median_ms", "p10_ms", "p90_ms", "loop_ms", "floor_ms",
            "frac", "compiled_MiB", "temp_MiB", "peak_MiB", "notes"]
    body = [
        [r.suite, r.variant, _fmt_sizes(r.sizes), r.dtype, r.precision, _fmt(r.median_ms), _fmt(r.p10_ms),
         _fmt(r.p90_ms), _fmt(r.loop_ms), _fmt(r.floor_ms), _fmt(r.achieved_fraction, ".2f"),
         _mib(r.compiled_bytes), _mib(r.temp_bytes), _mib(r.peak_bytes), r.notes]
        for r in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in body)) if body else len(c) for i, c in enumerate(cols)]
    numeric = set(range(5, 14))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    table = [line(cols), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(header + [t.rstrip() for t in table]) + "\n"


def _jsonable(x: Any) -> Any:
    """Strict-JSON form: NaN/inf -> None, tuples -> lists, numpy scalars -> Python numbers."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


#: Where results go unless asked otherwise: relative to the current directory and git-ignored in a checkout
#: (``/runs/``), so a benchmark run never edits the committed ``benchmarks/results/`` the README's tables are
#: generated from; adding a result there is an explicit ``out_dir="benchmarks/results"``.
DEFAULT_RESULTS_DIR = "runs/bench"


def write_results(
    rows: Sequence[Row],
    name: str,
    out_dir: str | pathlib.Path = DEFAULT_RESULTS_DIR,
    env: Mapping[str, Any] | None = None,
    precision: str | None = None,
) -> pathlib.Path:
    """Write ``<out_dir>/<name>-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.json`` (UTC) and a sibling ``.txt`` table.

    ``precision`` names the run in the file name (:func:`jaxgrad.bench.environment.precision_slug`; default: from
    the rows' matmul precision and dtypes). ``out_dir`` defaults to :data:`DEFAULT_RESULTS_DIR` (``runs/bench``,
    git-ignored); the committed results the README's tables come from are ``benchmarks/results``, written only
    when passed explicitly.

    The JSON holds ``{"environment": ..., "rows": [...]}``; the ``.txt`` is :func:`format_table`. The directory is
    created if needed, and an existing file of the same name is never overwritten. Returns the JSON path.
    """
    env = environment() if env is None else dict(env)
    if precision is None:
        flags = {r.precision for r in rows}
        precision = precision_slug("highest" if flags == {"highest"} else None, (r.dtype for r in rows),
                                   env.get("platform"))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(name, env, precision)
    path, k = out / f"{stem}.json", 1
    while path.exists() or path.with_suffix(".txt").exists():
        path, k = out / f"{stem}-{k}.json", k + 1
    payload = {"environment": env, "rows": [r.to_dict() for r in rows]}
    path.write_text(json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n")
    path.with_suffix(".txt").write_text(format_table(rows, env))
    return path
