"""What a measurement was taken on, and the name of the file it goes to.

:func:`environment` is the header of every result file (device, software versions, matmul precision, host, UTC
time, commit, uncommitted changes, command line); :func:`result_stem` names the file
``<suite>-<device>-<precision>-<YYYYmmdd>-<HHMMSS>`` (UTC), e.g. ``lora-nvidia-h100-80gb-hbm3-bf16-20261126-151502``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import pathlib
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["device_slug", "dtype_name", "environment", "precision_slug", "provenance", "result_stem"]

_GPU_DEFAULT_PRECISION = "default (TF32 for f32 dots/convs on NVIDIA GPUs)"
_CUDA_PLUGIN_DISTS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_plugin_versions() -> dict[str, str]:
    """Installed CUDA plugin distributions (``jax-cuda13-plugin`` and friends) and their versions."""
    found = {name: v for name in _CUDA_PLUGIN_DISTS if (v := _dist_version(name)) is not None}
    if not found:  # an unpackaged build: fall back on the module's own version attribute
        try:
            import jax_cuda13_plugin  # type: ignore[import-not-found]

            found["jax_cuda13_plugin"] = str(getattr(jax_cuda13_plugin, "__version__", "unknown"))
        except ImportError:
            pass
    return found


def _matmul_precision_label(platform_name: str) -> str:
    value = jax.config.jax_default_matmul_precision
    if value is None:
        return _GPU_DEFAULT_PRECISION if platform_name == "gpu" else "default"
    return str(value)


def provenance() -> dict[str, Any]:
    """The commit measured, whether the tree had uncommitted changes, and the command line.

    From ``JAXGRAD_COMMIT`` / ``JAXGRAD_DIRTY`` when the launcher sets them (a GPU machine gets a copy of the tree
    whose ``.git``, if any, is not the launcher's), else from ``git``."""
    commit, dirty = os.environ.get("JAXGRAD_COMMIT"), os.environ.get("JAXGRAD_DIRTY")
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        if commit:  # the launcher knows better than a copied tree's (possibly stale) .git
            raise OSError
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True, timeout=10).stdout
        dirty = "yes" if status.strip() else "no"
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": commit or "unknown", "dirty": dirty or "unknown", "command": _command_line()}


def _command_line() -> str:
    """The command line as typed: ``python -m jaxgrad.bench lora ...`` for a module run (whose ``argv[0]`` is its
    ``__main__.py``), else the script's name and its arguments."""
    if not sys.argv:
        return ""
    if sys.argv[0].endswith("__main__.py") and "-m" in getattr(sys, "orig_argv", [])[1:]:
        orig = sys.orig_argv
        return " ".join([pathlib.Path(orig[0]).name, *orig[1:]])
    return " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """What the numbers were measured on: device, software versions, matmul precision, host, UTC time, and the
    commit and command line (:func:`provenance`)."""
    dev = jax.devices()[0]
    env: dict[str, Any] = {
        "device_kind": dev.device_kind,
        "device": str(dev),
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": _dist_version("jaxlib") or getattr(jax.lib, "__version__", None),
        "cuda_plugin": _cuda_plugin_versions() or None,
        "python": sys.version.split()[0],
        "datetime_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "matmul_precision": _matmul_precision_label(dev.platform),
        "hostname": socket.gethostname(),
        "machine": platform.machine(),
        "xla_flags": os.environ.get("XLA_FLAGS") or None,
        **provenance(),
    }
    try:  # which Pallas backend the kernels compile to (interpret mode off-GPU)
        from jaxgrad import pallas_backend

        env["pallas"] = pallas_backend.describe()
    except Exception:  # noqa: BLE001 - the harness must not depend on the kernel shim importing
        env["pallas"] = None
    return env


def device_slug(device_kind: str | None = None) -> str:
    """File-name-safe device name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def dtype_name(x: Any) -> str:
    """Short dtype name (``f32``, ``bf16``, ...) of a dtype, an array, or the first array leaf of a pytree."""
    if isinstance(x, str):
        dt = jnp.dtype(_DTYPE_ALIASES.get(x, x))
    elif isinstance(x, (np.dtype, type)):
        dt = jnp.dtype(x)
    elif hasattr(x, "dtype"):
        dt = jnp.dtype(x.dtype)
    else:
        leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if hasattr(leaf, "dtype")]
        if not leaves:
            return "none"
        dt = jnp.dtype(leaves[0].dtype)
    return _SHORT_DTYPE.get(dt.name, dt.name)


_SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_DTYPE_ALIASES = {v: k for k, v in _SHORT_DTYPE.items()}


def precision_slug(precision: str | None, dtypes: Iterable[str] = (), platform_name: str | None = None) -> str:
    """The precision a result file is named by: ``highest`` when the run set f32-exact products; else the arrays'
    one low-precision dtype (``bf16``, ``f16``) when every row has it; else ``tf32`` on an NVIDIA GPU (f32 dots and
    convs on tensor cores, XLA's default there); else ``default``. A sweep over several precisions (the verifier's
    calibration suites) passes its own word (``emulated``, ``mixed``, ``hardware``) as ``precision``."""
    if precision not in (None, "default"):
        return re.sub(r"[^a-z0-9]+", "-", str(precision).lower()).strip("-") or "default"
    kinds = set(dtypes)
    if len(kinds) == 1 and kinds <= {"bf16", "f16"}:
        return kinds.pop()
    plat = jax.devices()[0].platform if platform_name is None else platform_name
    return "tf32" if plat == "gpu" else "default"


def result_stem(suite: str, env: dict[str, Any], precision: str, when: _dt.datetime | None = None) -> str:
    """``<suite>-<device>-<precision>-<YYYYmmdd>-<HHMMSS>`` (UTC, now unless ``when``): the name of a result file
    without its suffix; ``device`` is :func:`device_slug` of ``env["device_kind"]``, ``precision`` a
    :func:`precision_slug`."""
    if not suite or re.search(r"[^A-Za-z0-9_.-]", suite):
        raise ValueError(f"result_stem: suite must be a non-empty file-name-safe word, got {suite!r}")
    stamp = (when or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return f"{suite}-{device_slug(env.get('device_kind'))}-{precision}-{stamp}"
