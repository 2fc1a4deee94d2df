"""On 2 or more GPUs: the engine's data-parallel step for the KAN and the CNN (their custom VJPs and Pallas kernels,
each on its device's rows) gives one GPU's loss, gradients and optimizer step. Float32 with the dots at
``HIGHEST`` precision, so that the runs differ only in the order of the cross-device sum: the bound is float32
rounding of a sum over the batch, ``4 u sqrt(N)`` relative to the largest entry with ``u = 2^-24`` (N = 512
samples), about 1e-5; a gradient off by one device's share (1/N_dev) or left unreduced is off by >= 25 %.

Run on a machine with 2 or 4 GPUs: ``NCCL_NVLS_ENABLE=0 bash scripts/gpu_check.sh tests
tests/test_train_data_parallel_gpu.py``; every GPU of the machine is used."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

N_SAMPLES = 512
TOL = 4 * 2.0**-24 * np.sqrt(N_SAMPLES)


def _gpus() -> int:
    return sum(d.platform == "gpu" for d in jax.devices())


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _one_and_all(task, batch):
    from jaxgrad.train import TrainConfig, build, data_mesh, init_state, shard_batch

    cfg = TrainConfig(steps=1, optimizer="sgd", lr=0.1, seed=3)
    out = {}
    for d in (1, _gpus()):
        mesh, steps = build(task, cfg, mesh=data_mesh(d))
        state = init_state(task, cfg, steps, mesh)
        s, n, g = steps.grad_sums(state["params"], shard_batch(batch, mesh))
        state, _, _ = steps.train_step(state, shard_batch(batch, mesh))
        out[d] = (s, n, g, state["params"])
    return out[1], out[_gpus()]


def _assert_equal(one, many):
    (s1, n1, g1, p1), (s, n, g, p) = one, many
    assert float(n) == float(n1)
    assert _rel(s, s1) <= TOL
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1), strict=True):
        assert float(np.max(np.abs(np.asarray(b)))) > 0
        assert _rel(a, b) <= 10 * TOL, _rel(a, b)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p1), strict=True):
        assert _rel(a, b) <= 10 * TOL


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_kan_data_parallel_step_equals_one_gpu(backend):
    from jaxgrad.kan.task import KANFit, make_task

    with jax.default_matmul_precision("highest"):
        task = make_task(KANFit(widths=(2, 16, 1), grids=(5,), n_train=N_SAMPLES, n_test=8, dtype="float32",
                                backend=backend), 1)
        _assert_equal(*_one_and_all(task, next(task.batches(0))))


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_cnn_data_parallel_step_equals_one_gpu(backend):
    from jaxgrad.cnn.synthetic import SyntheticPairs
    from jaxgrad.cnn.task import make_task

    with jax.default_matmul_precision("highest"):
        stream = SyntheticPairs(8, 32, snr=0.5, seed=1, batches_per_epoch=1)
        task = make_task(stream, channels=(1, 4, 1), backend=backend, precision="highest", dtype=jnp.float32)
        _assert_equal(*_one_and_all(task, next(task.batches(0))))
