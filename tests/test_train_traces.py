"""Trace counts of the engine's compiled steps per training phase, for the families not covered elsewhere.

Already covered (not repeated here): the toy task's step traces once over 10 steps and the accumulation pieces once
each (tests/test_train_engine.py); the KAN fit traces once per grid -- a refinement changes the parameter shapes and
retraces exactly once more, and room for one trace fails there (tests/test_train_kan.py); the LoRA task's custom-VJP
and reference steps run under ``max_traces=1`` (tests/test_train_lora.py).

Here: the CNN denoiser through its custom conv VJP (XLA and the Pallas kernels, interpret mode off-GPU) over two
epoch boundaries (a new epoch must not retrace: same batch shapes, same dtypes), under
``chex.assert_max_traces(n=1)``, in the plain step and in the accumulation phase (``grad_sums`` once for every
micro-batch, ``apply_sums`` once for every window)."""

import chex
import jax.numpy as jnp
import pytest

from jaxgrad.cnn.synthetic import SyntheticPairs
from jaxgrad.cnn.task import make_task
from jaxgrad.train import TrainConfig, fit

pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")


def _task(backend):
    stream = SyntheticPairs(8, 4, snr=0.5, seed=1, batches_per_epoch=2)
    return make_task(stream, channels=(1, 3, 1), backend=backend, precision="highest", dtype=jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_cnn_step_traces_once_across_epochs(backend, tmp_path):
    chex.clear_trace_counter()  # chex counts per definition site, across the process
    cfg = TrainConfig(steps=5, optimizer="adam", lr=1e-3, seed=0, checkpoint_every=100)  # epochs 0, 1, 2
    r = fit(_task(backend), cfg, tmp_path / "run", max_traces=1)
    assert r.step == 5 and r.traces == {"train_step": 1, "grad_sums": 0, "apply_sums": 0}


def test_cnn_accumulation_phase_traces_each_piece_once(tmp_path):
    chex.clear_trace_counter()
    cfg = TrainConfig(steps=3, optimizer="sgd", lr=1e-3, seed=0, accumulate=2, checkpoint_every=100)
    r = fit(_task("xla"), cfg, tmp_path / "run", max_traces=1)
    assert r.step == 3 and r.traces == {"train_step": 0, "grad_sums": 1, "apply_sums": 1}
