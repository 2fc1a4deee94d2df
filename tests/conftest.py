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
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bash scripts/gpu_check.sh tests on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def exact_f32_tests_run_on_the_cpu(request):
    """On a GPU machine, a test written for exact f32 (interpret-mode kernels, backend agreement to 1e-5) still runs
    on that machine's CPU: on the GPU, XLA's default f32 dot precision is TF32, which those tolerances do not allow.
    ``gpu`` tests run on the GPU. Use with ``pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")``.
    """
    if "gpu" in request.keywords or jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def x64_as_it_was():
    """Every test leaves ``jax_enable_x64`` as it found it. An in-process ``jaxgrad train`` of a float64 run turns it
    on process-wide (as the CLI must); left on, a later test in the same worker gets float64 arrays where it made
    float32 ones (a float64 cotangent for a float32 output, int64 indices beside int32 ones)."""
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="module")
def x64():
    """float64 for a whole module's tests (the float64 fits), restored after the module."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)
