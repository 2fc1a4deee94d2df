"""The KAN fit on the engine: L-BFGS through optax's value-and-grad interface, grid refinement that retraces the
step exactly once per new grid (chex.assert_max_traces), and bit-exact resume after a
real ``kill -9`` in the middle of the second grid."""

import os
import pathlib
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from jaxgrad.kan.task import KANFit, make_task
from jaxgrad.train import Checkpointer, TrainConfig, fit
from jaxgrad.train.loop import abstract_state, build

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIT = dict(grids=(3, 5), refine_every=4, n_train=64, n_test=32, dtype="float64")
CFG = dict(steps=10, optimizer="lbfgs", checkpoint_every=3, keep=2, log_every=1, seed=2)

_CHILD = r"""
import os, signal, sys
import jax
jax.config.update("jax_enable_x64", True)
from jaxgrad.kan.task import KANFit, make_task
from jaxgrad.train import TrainConfig, fit
fit_kw, cfg_kw, out, kill_at = eval(sys.argv[1]), eval(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cb = lambda step, loss: step == kill_at and os.kill(os.getpid(), signal.SIGKILL)
fit(make_task(KANFit(**fit_kw), cfg_kw["steps"]), TrainConfig(**cfg_kw), out, step_callback=cb)
"""


def _latest_state(out, task, cfg):
    _, steps = build(task, cfg)
    ck = Checkpointer(out / "checkpoints", cfg.keep, create=False)
    try:
        step = max(ck.steps())
        return ck.restore(step, abstract_state(task, cfg, steps, step))
    finally:
        ck.close()


@pytest.fixture(scope="module")
def reference(x64, tmp_path_factory):
    out = tmp_path_factory.mktemp("kanref") / "run"
    chex.clear_trace_counter()
    task = make_task(KANFit(**FIT), CFG["steps"])
    res = fit(task, TrainConfig(**CFG), out, max_traces=2)  # grid 3, then grid 5: two traces, never three
    return out, res


def test_grid_refinement_retraces_exactly_once_and_lbfgs_learns(reference):
    out, res = reference
    assert res.traces["train_step"] == 2
    assert res.eval["grid_size"] == 5
    assert res.step == 10 and res.final_loss < 1.0
    # room for a single trace fails at the refinement (the shapes changed); Adam: a cheaper compile than L-BFGS
    chex.clear_trace_counter()
    task = make_task(KANFit(**FIT), CFG["steps"])
    with pytest.raises(AssertionError, match="traced > 1 times"):
        fit(task, TrainConfig(**dict(CFG, optimizer="adam")), out.parent / "one-trace", max_traces=1)


@pytest.mark.slow
def test_resume_after_kill_9_is_bit_exact(reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # same XLA flags as this process: the same compiled programs
    proc = subprocess.run([sys.executable, "-c", _CHILD, repr(FIT), repr(CFG), str(out), "8"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
    task = make_task(KANFit(**FIT), CFG["steps"])
    res = fit(task, TrainConfig(**CFG), out, resuming=True)  # from step 6: grid 5 (replayed refinement), L-BFGS memory
    cfg = TrainConfig(**CFG)
    (s_ref, m_ref), (s_new, m_new) = _latest_state(ref_out, task, cfg), _latest_state(out, task, cfg)
    assert m_ref["step"] == m_new["step"] == 10
    assert jax.tree.structure(s_ref) == jax.tree.structure(s_new)
    for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_new)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert res.step == 10
