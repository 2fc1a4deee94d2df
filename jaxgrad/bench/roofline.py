r"""Roofline floors: a lower bound on the run time of a computation on a given device.

.. math::

    t_\text{compute} = \frac{\text{FLOPs}}{P_\text{peak}}, \qquad
    t_\text{memory}  = \frac{\text{bytes moved}}{B_\text{HBM}}, \qquad
    t_\text{floor}   = \max(t_\text{compute},\, t_\text{memory}).

No kernel can finish before it has done its arithmetic at the unit's peak rate, nor before it has moved its bytes
through HBM at peak bandwidth, hence the max. Peaks (:data:`PEAKS`) are NVIDIA data-sheet figures, dense (no 2:4
sparsity); see :mod:`jaxgrad.bench.harness` for the table and for what an achieved fraction above 1 means.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxgrad.bench.environment import dtype_name

__all__ = ["PEAKS", "DevicePeaks", "floor_ms", "lookup_peaks"]


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """Data-sheet peaks of one device (dense, no sparsity). Bandwidth in B/s, compute in FLOP/s."""

    name: str
    hbm_bytes_per_s: float
    tf32_flops: float
    bf16_flops: float
    fp32_flops: float


PEAKS: dict[str, DevicePeaks] = {
    "H100 SXM": DevicePeaks("H100 SXM", hbm_bytes_per_s=3.35e12, tf32_flops=494.7e12, bf16_flops=989e12,
                            fp32_flops=66.9e12),
    "H200": DevicePeaks("H200", hbm_bytes_per_s=4.8e12, tf32_flops=494.7e12, bf16_flops=989e12,
                        fp32_flops=66.9e12),
}


def lookup_peaks(device_kind: str | None = None) -> DevicePeaks | None:
    """The :data:`PEAKS` row for a ``device_kind`` (default: the first JAX device), ``None`` if not tabulated.

    H100 PCIe/NVL parts have different peaks and are deliberately not matched to the SXM row.
    """
    kind = (jax.devices()[0].device_kind if device_kind is None else device_kind).upper()
    if "H200" in kind:
        return PEAKS["H200"]
    if "H100" in kind and "PCIE" not in kind and "NVL" not in kind:
        return PEAKS["H100 SXM"]
    return None


_TENSOR_PRECISIONS = ("tf32", "default")
_FP32_PRECISIONS = ("highest", "fp32", "float32")


def _compute_peak(peaks: DevicePeaks, dtype: str, precision: str) -> float | None:
    """Peak FLOP/s of the unit that executes ``flops`` of ``dtype`` at ``precision`` (see module docstring)."""
    prec = precision.lower()
    if prec not in (*_TENSOR_PRECISIONS, *_FP32_PRECISIONS, "elementwise"):
        raise ValueError(f"floor_ms: unknown precision {precision!r}")
    if prec == "elementwise":
        return peaks.fp32_flops
    if dtype in ("bf16", "f16"):  # tensor cores whatever the precision flag (it only affects f32 operands)
        return peaks.bf16_flops
    if dtype == "f32":
        # "highest"/"fp32": true f32 matmuls on the FP32 units
        return peaks.tf32_flops if prec in _TENSOR_PRECISIONS else peaks.fp32_flops
    return None  # f64 etc.: not tabulated


def floor_ms(
    flops: float | None = None,
    bytes_moved: float | None = None,
    device_kind: str | None = None,
    dtype: Any = "f32",
    precision: str = "tf32",
) -> dict[str, Any]:
    r"""Roofline lower bound on run time, in milliseconds.

    :math:`t_c = \text{flops} / P`, :math:`t_m = \text{bytes\_moved} / B_\text{HBM}`, :math:`t = \max(t_c, t_m)`
    with :math:`P` the compute peak chosen by ``dtype`` and ``precision`` (``"tf32"``/``"default"``,
    ``"highest"``/``"fp32"``, or ``"elementwise"``) and :math:`B_\text{HBM}` the HBM bandwidth of the
    :data:`PEAKS` row matching ``device_kind`` (default: the first JAX device).

    Returns:
      ``compute_ms``, ``memory_ms``, ``floor_ms`` (max of those present; ``None`` off the table, e.g. on CPU),
      ``bound`` (``"compute"``/``"memory"``/``None``), ``table_row`` (the :data:`PEAKS` key used or ``None``),
      ``peak_flops_per_s`` and ``peak_bytes_per_s``.
    """
    peaks = lookup_peaks(device_kind)
    result: dict[str, Any] = {
        "compute_ms": None,
        "memory_ms": None,
        "floor_ms": None,
        "bound": None,
        "table_row": None if peaks is None else peaks.name,
        "peak_flops_per_s": None,
        "peak_bytes_per_s": None,
    }
    if peaks is None:
        return result
    peak_flops = _compute_peak(peaks, dtype_name(dtype), precision)
    result["peak_flops_per_s"] = peak_flops
    result["peak_bytes_per_s"] = peaks.hbm_bytes_per_s
    if flops is not None and peak_flops is not None:
        result["compute_ms"] = float(flops) / peak_flops * 1e3
    if bytes_moved is not None:
        result["memory_ms"] = float(bytes_moved) / peaks.hbm_bytes_per_s * 1e3
    bounds = {k: result[f"{k}_ms"] for k in ("compute", "memory") if result[f"{k}_ms"] is not None}
    if bounds:
        result["bound"] = max(bounds, key=bounds.__getitem__)
        result["floor_ms"] = bounds[result["bound"]]
    return result

