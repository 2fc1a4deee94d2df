"""jaxgrad.train on a tiny least-squares task: accumulation normalisation, NaN/Inf guard, clipping, the grad-path
switch, the precision policy, metrics files, trace counts, checkpoint reliability (checksums, fall-back, failed
saves, no pickle) and bit-exact resume."""

import csv
import errno
import json
import pathlib
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.train import (CheckpointSaveError, Task, TrainConfig, TrainingDiverged, accumulate_window, build, fit,
                           init_state, shard_batch)
from jaxgrad.train import checkpoint as ckpt_mod
from jaxgrad.train.metrics import CSV_FILE, METRICS_FILE

W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x @ W_TRUE + 0.3).astype(np.float32)[:, None]


def toy_task(n=24, batch=4, *, poison=None, reference_scale=1.0):
    """y = x w + b; item loss (x w + b - y)^2. ``poison=(epoch, k)``: that batch has a NaN input."""
    x, y = _data(n, 0)
    nb = n // batch

    def init(key):
        return {"w": jax.random.normal(key, (3, 1)) * 0.1, "b": jnp.zeros((1,))}

    def loss(p, b):
        xb, yb = b
        return jnp.sum(jnp.square(xb @ p["w"] + p["b"] - yb)), xb.shape[0]

    def reference_loss(p, b):
        s, n_ = loss(p, b)
        return s * reference_scale, n_

    def batches(epoch):
        order = np.random.default_rng([7, epoch]).permutation(n)
        for k in range(nb):
            idx = order[k * batch:(k + 1) * batch]
            xb = x[idx].copy()
            if poison == (epoch, k):
                xb[0, 0] = np.nan
            yield xb, y[idx]

    return Task("toy", init=init, loss=loss, reference_loss=reference_loss, batches=batches, batches_per_epoch=nb,
                evaluate=lambda p: {"w_err": float(jnp.max(jnp.abs(p["w"][:, 0] - W_TRUE)))})


def _lines(out):
    return [json.loads(s) for s in (pathlib.Path(out) / METRICS_FILE).read_text().splitlines()]


def _steps_logged(out):
    return [r for r in _lines(out) if "event" not in r]


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


CFG = TrainConfig(steps=12, optimizer="adam", lr=0.05, log_every=1, checkpoint_every=4, keep=3, seed=1)


def test_accumulation_is_sum_over_items_not_mean_of_means():
    task = toy_task()
    mesh, steps = build(task, CFG)
    params = task.init(jax.random.key(0))
    x, y = _data(4, 5)
    # unequal micro-batches: 3 items and 1 item
    s, n, g = accumulate_window(steps, params, [shard_batch((x[:3], y[:3]), mesh),
                                                shard_batch((x[3:], y[3:]), mesh)])
    assert float(n) == 4

    def mean_loss(p, xb, yb):
        return jnp.mean(jnp.square(xb @ p["w"] + p["b"] - yb))

    whole = jax.grad(mean_loss)(params, x, y)
    window = jax.tree.map(lambda a: a / n, g)
    for a, b in zip(jax.tree.leaves(window), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=2e-6)
    mean_of_means = jax.tree.map(lambda a, b: (a + b) / 2, jax.grad(mean_loss)(params, x[:3], y[:3]),
                                 jax.grad(mean_loss)(params, x[3:], y[3:]))
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(mean_of_means), jax.tree.leaves(whole))) > 1e-2  # the data make them differ
    assert float(s / n) == pytest.approx(float(mean_loss(params, x, y)), rel=1e-6)


def test_accumulated_run_equals_big_batch_run(tmp_path):
    """accumulate=2 over batches of 4 == batches of 8 with the same items (same order), for SGD."""
    cfg = CFG.replace(optimizer="sgd", lr=0.1, steps=3, checkpoint_every=100)
    small, big = toy_task(batch=4), toy_task(batch=8)
    x, y = _data(24, 0)

    def ordered(bs):
        def batches(epoch):
            for k in range(24 // bs):
                yield x[k * bs:(k + 1) * bs], y[k * bs:(k + 1) * bs]
        return batches

    import dataclasses
    small = dataclasses.replace(small, batches=ordered(4))
    big = dataclasses.replace(big, batches=ordered(8))
    r1 = fit(small, cfg.replace(accumulate=2), tmp_path / "a")
    r2 = fit(big, cfg, tmp_path / "b")
    for a, b in zip(jax.tree.leaves(r1.state["params"]), jax.tree.leaves(r2.state["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert r1.traces["grad_sums"] == 1 and r1.traces["apply_sums"] == 1
    assert _lines(tmp_path / "a")[0]["event"] == "start"


def test_nan_guard_skip_and_stop(tmp_path):
    task = toy_task(poison=(0, 2))  # step 3 (1-based) sees a NaN
    seen = {}

    def record(step, loss):
        seen[step] = float(loss)

    cfg = CFG.replace(nan_policy="skip", steps=6, checkpoint_every=100)
    params_by_step = {}
    r = fit(task, cfg, tmp_path / "skip", step_callback=record,
            hooks=((1, lambda s, p, _: params_by_step.__setitem__(s, jax.tree.map(np.asarray, p))),))
    assert np.isnan(seen[3]) and r.skipped == 1
    _equal(params_by_step[3], params_by_step[2])  # the poisoned step changed nothing
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(r.state["params"]))
    assert [rec["skipped"] for rec in _steps_logged(tmp_path / "skip")] == [0, 0, 1, 0, 0, 0]

    with pytest.raises(TrainingDiverged, match=r"step 3: the loss or a gradient is not finite"):
        fit(task, cfg.replace(nan_policy="stop"), tmp_path / "stop")


def test_clipping_bounds_the_update(tmp_path):
    task = toy_task()
    cfg = CFG.replace(optimizer="sgd", lr=1.0, clip_norm=0.01, steps=1)
    mesh, steps = build(task, cfg)
    state = init_state(task, cfg, steps, mesh)
    before = jax.tree.map(np.asarray, state["params"])
    state, _, _ = steps.train_step(state, shard_batch(next(task.batches(0)), mesh))
    delta = np.sqrt(sum(np.sum((np.asarray(a) - b) ** 2) for a, b in
                        zip(jax.tree.leaves(state["params"]), jax.tree.leaves(before))))
    assert delta == pytest.approx(0.01, rel=1e-4)


def test_grad_path_switch_uses_the_reference_loss():
    task = toy_task(reference_scale=3.0)  # a "reference" whose gradient is 3x: the switch must show it
    batch = next(task.batches(0))
    grads = {}
    for path in ("custom_vjp", "reference"):
        mesh, steps = build(task, CFG.replace(grad_path=path))
        s, n, g = steps.grad_sums(task.init(jax.random.key(0)), shard_batch(batch, mesh))
        grads[path] = g
    np.testing.assert_allclose(grads["reference"]["w"], 3 * grads["custom_vjp"]["w"], rtol=1e-6)


def test_precision_policy_casts_compute_not_storage():
    task = toy_task()
    cfg = CFG.replace(compute_dtype="bfloat16", output_dtype="float32")
    mesh, steps = build(task, cfg)
    state = init_state(task, cfg, steps, mesh)
    batch = shard_batch(next(task.batches(0)), mesh)
    s, n, g = steps.grad_sums(state["params"], batch)
    assert s.dtype == jnp.float32 and g["w"].dtype == jnp.float32
    s32, _, _ = build(task, CFG)[1].grad_sums(state["params"], batch)
    assert float(s) != float(s32) and float(s) == pytest.approx(float(s32), rel=3e-2)  # computed in bf16
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainConfig(compute_dtype="float8")


def test_no_retrace_between_steps(tmp_path):
    chex.clear_trace_counter()
    r = fit(toy_task(), CFG.replace(steps=10, checkpoint_every=100), tmp_path / "r", max_traces=1)
    assert r.traces["train_step"] == 1
    with pytest.raises(ValueError, match="lbfgs' needs the whole objective in one batch"):
        fit(toy_task(), CFG.replace(optimizer="lbfgs", lr=None), tmp_path / "l")


def test_metrics_jsonl_and_csv(tmp_path):
    r = fit(toy_task(), CFG.replace(log_every=3, eval_every=6), tmp_path / "m")
    steps = _steps_logged(tmp_path / "m")
    assert [s["step"] for s in steps] == [3, 6, 9, 12]
    assert {"loss", "steps_per_s", "items_per_s", "epoch", "batch"} <= set(steps[0])
    rows = list(csv.DictReader(open(tmp_path / "m" / CSV_FILE)))
    assert [int(row["step"]) for row in rows] == [3, 6, 9, 12]
    assert float(rows[-1]["loss"]) == pytest.approx(steps[-1]["loss"])
    evals = [rec for rec in _lines(tmp_path / "m") if rec.get("event") == "eval"]
    assert [e["step"] for e in evals] == [6, 12] and "w_err" in evals[0]
    assert r.eval["w_err"] == pytest.approx(evals[-1]["w_err"])  # the final evaluation is the step-12 one


# ------------------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------------------

def _ckpts(out):
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    return out, fit(toy_task(), CFG, out)


class Crash(RuntimeError):
    pass


def _crash_at(n):
    def cb(step, loss):
        if step == n:
            raise Crash
    return cb


def test_resume_is_bit_exact_and_restores_rng_and_data_position(reference, tmp_path):
    ref_out, ref = reference
    out = tmp_path / "run"
    with pytest.raises(Crash):
        fit(toy_task(), CFG, out, step_callback=_crash_at(10))  # 6 batches per epoch: checkpoint 8 is mid-epoch
    assert _ckpts(out) == [4, 8]
    r = fit(toy_task(), CFG, out, resuming=True)
    _equal(r.state, ref.state)  # params, optimizer state and RNG
    assert _ckpts(out) == [4, 8, 12]


def test_corrupted_or_truncated_checkpoint_falls_back_to_the_previous_good_one(reference, tmp_path, capsys):
    ref_out, ref = reference
    for damage in ("corrupt", "truncate", "no-checksums"):
        out = tmp_path / damage
        with pytest.raises(Crash):
            fit(toy_task(), CFG, out, step_callback=_crash_at(10))
        step8 = out / "checkpoints" / "8"
        victim = max((p for p in step8.rglob("*") if p.is_file() and p.name != ckpt_mod.CHECKSUM_FILE),
                     key=lambda p: p.stat().st_size)
        if damage == "corrupt":
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        elif damage == "truncate":
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        else:
            (step8 / ckpt_mod.CHECKSUM_FILE).unlink()
        capsys.readouterr()
        r = fit(toy_task(), CFG, out, resuming=True)
        msg = capsys.readouterr().out
        assert "checkpoint(s) 8 failed verification" in msg and "step 4" in msg, msg
        _equal(r.state, ref.state)  # resumed from 4, retrained 5..12
        assert _ckpts(out) == [4, 8, 12]
        assert any(p.name.startswith("8.corrupt-") for p in (out / "checkpoints").iterdir())  # kept aside


def test_failed_saves_keep_the_last_good_checkpoint(reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    import orbax.checkpoint as ocp

    orig = ocp.CheckpointManager.save
    fail = {"steps": {8}, "error": OSError(errno.ENOSPC, "No space left on device")}

    def flaky(self, step, *a, **k):
        if step in fail["steps"]:
            raise fail["error"]
        return orig(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", flaky)
    r = fit(toy_task(), CFG, out)  # periodic save at 8 fails: reported, training goes on
    text = capsys.readouterr().out
    assert "checkpoint at step 8 could not be written" in text and "No space left on device" in text
    assert "the last good checkpoint, step 4, is intact" in text
    assert _ckpts(out) == [4, 12]
    assert [rec["step"] for rec in _lines(out) if rec.get("event") == "checkpoint_failed"] == [8]
    _equal(r.state, reference[1].state)

    # a failing final save (permissions) is an error naming the step and the intact checkpoint
    fail.update(steps={12}, error=PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(CheckpointSaveError, match=r"step 12 .*Permission denied.*step 8, is intact"):
        fit(toy_task(), CFG, tmp_path / "perm")
    assert _ckpts(tmp_path / "perm") == [4, 8]
    monkeypatch.setattr(ocp.CheckpointManager, "save", orig)
    r2 = fit(toy_task(), CFG, tmp_path / "perm", resuming=True)
    _equal(r2.state, reference[1].state)


def test_nothing_loaded_from_disk_is_unpickled(reference, tmp_path, monkeypatch):
    ref_out, _ = reference
    for p in ref_out.rglob("*"):
        if p.is_file():
            head = p.read_bytes()[:2]
            assert not (len(head) == 2 and head[0] == 0x80 and head[1] <= 5), f"{p} looks like a pickle"

    def no_pickle(*a, **k):
        raise AssertionError("pickle used to load a file")

    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    out = tmp_path / "run"
    with pytest.raises(Crash):
        fit(toy_task(), CFG, out, step_callback=_crash_at(6))
    fit(toy_task(), CFG, out, resuming=True)


def test_checkpoint_of_another_model_is_refused_and_kept(reference, tmp_path):
    import dataclasses
    import shutil

    from jaxgrad.train import CheckpointMismatchError

    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    wider = dataclasses.replace(toy_task(), init=lambda key: {"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))})
    with pytest.raises(CheckpointMismatchError, match=r"does not fit .*opt_state/0/mu/b has shape \[1\] in the "
                                                      r"checkpoint, \[2\] here"):
        fit(wider, CFG.replace(steps=16), out, resuming=True)
    assert _ckpts(out) == [4, 8, 12]  # verified checkpoints are never moved aside for a mismatch
