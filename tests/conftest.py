"""Shared pytest set-up: GPU tests are skipped when JAX sees no GPU."""

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H100/H200 with the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
