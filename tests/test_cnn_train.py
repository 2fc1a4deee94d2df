"""`jaxgrad train cnn`: Noise2Noise training runs end to end (synthetic and MRC pairs), learns, checkpoints with
orbax, resumes bit-exactly after a crash, a ``kill -9`` or a SIGTERM, never destroys user files, and rejects bad
inputs with messages naming the key or file."""

import functools
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxgrad.cli import main
from jaxgrad.cnn.data import write_stack
from jaxgrad.cnn.synthetic import make_particles
from jaxgrad.cnn.task import load_checkpoint
from jaxgrad.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One network / optimiser / image size for every run (the engine caches its jitted step per configuration).
BASE = ["--set", "model.channels=[1,4,1]", "--set", "data.batch_size=8", "--set", "train.lr=3e-3",
        "--set", "train.log_every=1", "--set", "data.n_eval=16", "--no-progress"]
SIZE = 24


def train(*args):
    return main(["train", "cnn", *args])


def train_calling_back(step_callback, *args):
    """``jaxgrad train cnn`` with ``step_callback(step, loss)`` run by the engine after every step."""
    fit = loop.fit
    loop.fit = functools.partial(fit, step_callback=step_callback)
    try:
        return train(*args)
    finally:
        loop.fit = fit


def _lines(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _step_lines(path):
    return [r for r in _lines(path) if "event" not in r]


def _ckpt_steps(out):
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _is_png(path):
    return pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """Two aligned half-set stacks per side: a1/b1 with 32 particles, a2/b2 with 16 (24 x 24)."""
    d = tmp_path_factory.mktemp("pairs")
    p = make_particles(48, SIZE, snr=0.5, seed=3)
    files = {"a1": p["noisy_a"][:32], "a2": p["noisy_a"][32:], "b1": p["noisy_b"][:32], "b2": p["noisy_b"][32:]}
    return {k: write_stack(d / f"{k}.mrc", v) for k, v in files.items()}


def _pairs_args(pf, a=("a1", "a2"), b=("b1", "b2")):
    return ["--set", "data.kind=pairs", "--set", f"data.inputs={json.dumps([str(pf[k]) for k in a])}",
            "--set", f"data.targets={json.dumps([str(pf[k]) for k in b])}"]


# 48 particles, batch 8: 6 batches per epoch; 15 steps cross two epoch boundaries.
RESUME_ARGS = ["--set", "train.steps=15", "--set", "train.checkpoint_every=4", "--set", "train.keep=3",
               "--set", "train.seed=5", "--set", "data.seed=5"]


@pytest.fixture(scope="module")
def reference_run(pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert train(*_pairs_args(pair_files), *BASE, *RESUME_ARGS, "--out", str(out)) == 0
    return out


def test_synthetic_run_writes_everything_and_learns(tmp_path):
    out = tmp_path / "run"
    assert train("--set", "data.n=64", "--set", f"data.size={SIZE}", "--set", "data.snr=0.5",
                 "--set", "data.synthetic_chunk=16", "--set", "train.steps=48", "--set", "train.checkpoint_every=10",
                 "--set", "train.keep=2", "--set", "train.eval_every=24", "--set", "data.eval_images=true",
                 "--set", "data.n_examples=3", "--out", str(out), *BASE) == 0
    expected = ["run.json", "config.toml", "metrics.jsonl", "metrics.csv", "summary.json", "loss.png", "examples.png",
                "checkpoints", "images", "inputs.json", "synthetic"]
    if importlib.util.find_spec("tensorboardX") is not None:  # the engine mirrors scalars to TensorBoard then
        expected.append("tensorboard")
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for name in ("clean", "noisy_a", "noisy_b", "density"):
        assert (out / "synthetic" / "train" / f"{name}.mrc").is_file()
        assert (out / "synthetic" / "heldout" / f"{name}.mrc").is_file()
    # checkpoints: every 10 steps and at the end, the last 2 kept
    assert _ckpt_steps(out) == [40, 48]
    params, opt_state, meta = load_checkpoint(out)
    assert meta["step"] == 48 and meta["batches_per_epoch"] == 8
    assert (meta["epoch"], meta["batch_in_epoch"]) == (6, 0)
    assert [layer["w"].shape for layer in params] == [(3, 3, 1, 4), (3, 3, 4, 1)]
    assert int(opt_state[0].count) == 48
    # metrics: start event, one line per step, evaluations, end event
    recs = _lines(out / "metrics.jsonl")
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "end"
    assert [r["step"] for r in recs if r.get("event") == "eval"] == [24, 48]
    steps = _step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 49))
    assert {"step", "epoch", "loss", "time"} <= set(steps[0])
    assert steps[-1]["epoch"] == 5
    # images: one per evaluation, named by its step, and the final examples
    assert sorted(p.name for p in (out / "images").iterdir()) == ["step_0000024.png", "step_0000048.png"]
    for png in (out / "examples.png", out / "images" / "step_0000024.png", out / "images" / "step_0000048.png"):
        assert _is_png(png), png
    import matplotlib.image
    img = matplotlib.image.imread(out / "examples.png")
    assert img.shape[0] > img.shape[1] * 0.8  # 3 rows of 3 panels
    # summary: learning happened, on training batches and on the held-out set
    saved = json.loads((out / "summary.json").read_text())
    assert saved["step"] == 48 and saved["batches_per_epoch"] == 8 and saved["epoch"] == 6
    ev = saved["eval"]
    first = np.mean([r["loss"] for r in steps[:5]])
    last = np.mean([r["loss"] for r in steps[-8:]])
    assert last < 0.9 * first
    assert saved["final_loss"] == pytest.approx(steps[-1]["loss"])
    assert ev["n"] == 16 and "held-out" in ev["source"]
    assert ev["n2n_loss_final"] < 0.9 * ev["n2n_loss_initial"]
    assert ev["mse_vs_clean_final"] < ev["mse_vs_clean_initial"]
    assert ev["psnr_denoised_db"] > ev["psnr_noisy_db"] + 3


def test_resume_after_crash_is_bit_exact(pair_files, reference_run, tmp_path):
    out = tmp_path / "run"

    class Crash(RuntimeError):
        pass

    def crash_at_11(step, loss):
        if step == 11:
            raise Crash

    with pytest.raises(Crash):
        train_calling_back(crash_at_11, *_pairs_args(pair_files), *BASE, *RESUME_ARGS, "--out", str(out))
    assert _ckpt_steps(out) == [4, 8]  # nothing saved at the crash
    assert len(_step_lines(out / "metrics.jsonl")) == 11
    before = (out / "metrics.jsonl").read_text()
    # a save killed half-way leaves an orbax temporary directory: ignored (and removed) on resume
    junk = out / "checkpoints" / "12.orbax-checkpoint-tmp-1700000000"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "partial").write_bytes(b"\0" * 10)
    _, _, meta8 = load_checkpoint(out)
    assert (meta8["step"], meta8["epoch"], meta8["batch_in_epoch"]) == (8, 1, 2)  # mid-epoch

    assert train("--out", str(out), "--resume", "--no-progress") == 0  # everything else from run.json
    assert not junk.exists()
    assert _ckpt_steps(out) == [8, 12, 15]
    ref_params, ref_opt, ref_meta = load_checkpoint(reference_run)
    params, opt_state, meta = load_checkpoint(out)
    assert meta["step"] == ref_meta["step"] == 15
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)
    # the earlier checkpoint survived the crash intact
    _assert_trees_equal(load_checkpoint(out, 8)[0], load_checkpoint(reference_run, 8)[0])
    # metrics appended, never truncated; the re-trained steps reproduce the reference's losses
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(before)
    recs = _lines(out / "metrics.jsonl")
    (resume,) = [r for r in recs if r.get("event") == "resume"]
    assert resume["step"] == 8
    after = [r for r in recs[recs.index(resume):] if "event" not in r]
    ref_losses = {r["step"]: r["loss"] for r in _step_lines(reference_run / "metrics.jsonl")}
    assert [r["step"] for r in after] == list(range(9, 16))
    assert [r["loss"] for r in after] == [ref_losses[s] for s in range(9, 16)]


_KILLER = """
import functools, os, signal, sys
from jaxgrad.cli import main
from jaxgrad.train import loop
kill_at = int(sys.argv[1])
loop.fit = functools.partial(loop.fit, step_callback=lambda step, loss: step == kill_at
                             and os.kill(os.getpid(), signal.SIGKILL))
sys.exit(main(["train", "cnn"] + sys.argv[2:]))
"""


def test_resume_after_sigkill_is_bit_exact(pair_files, reference_run, tmp_path):
    """A real ``kill -9`` (no finally blocks, no flush) after step 11: resume from checkpoint 8."""
    out = tmp_path / "run"
    args = _pairs_args(pair_files) + BASE + RESUME_ARGS + ["--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _KILLER, "11"] + args, capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert _ckpt_steps(out) == [4, 8]
    assert [r["step"] for r in _step_lines(out / "metrics.jsonl")] == list(range(1, 12))
    assert train("--out", str(out), "--resume", "--no-progress") == 0
    params, opt_state, _ = load_checkpoint(out)
    ref_params, ref_opt, _ = load_checkpoint(reference_run)
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)


def test_sigterm_checkpoints_then_resume_is_bit_exact(pair_files, reference_run, tmp_path):
    out = tmp_path / "run"
    old = signal.getsignal(signal.SIGTERM)

    def term_at_6(step, loss):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as exc:
        train_calling_back(term_at_6, *_pairs_args(pair_files), *BASE, *RESUME_ARGS, "--out", str(out))
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is old  # handlers restored
    assert _ckpt_steps(out) == [4, 6]  # the step-6 state was saved on the way out
    assert _lines(out / "metrics.jsonl")[-1]["event"] == "stopped"
    assert train("--out", str(out), "--resume", "--no-progress", "--set", "train.steps=15") == 0
    params, opt_state, _ = load_checkpoint(out)
    ref_params, ref_opt, _ = load_checkpoint(reference_run)
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)
    # resuming a finished run trains nothing more and rewrites the summary
    assert train("--out", str(out), "--resume", "--no-progress") == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 15 and _ckpt_steps(out)[-1] == 15


def test_pairs_run_with_progress_bar(pair_files, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # exercise the rich progress bar
    base = [a for a in BASE if a != "--no-progress"]
    assert train(*_pairs_args(pair_files), *base, "--set", "train.steps=6", "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batches_per_epoch"] == 6 and summary["step"] == 6  # 32 + 16 particles, batch 8
    ev = summary["eval"]
    assert "training data" in ev["source"] and "psnr_denoised_db" not in ev and ev["n"] == 16
    assert _is_png(out / "examples.png")
    assert _ckpt_steps(out) == [6]
    assert "train" in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["data"]["inputs"] == [str(pair_files["a1"]), str(pair_files["a2"])]
    inputs = json.loads((out / "inputs.json").read_text())
    assert [f["name"] for f in inputs] == ["a1.mrc", "a2.mrc", "b1.mrc", "b2.mrc"]
    assert [f["shape"] for f in inputs] == [[32, SIZE, SIZE], [16, SIZE, SIZE]] * 2


def test_resume_refuses_input_stacks_that_changed(pair_files, tmp_path, capsys):
    d = tmp_path / "stacks"
    d.mkdir()
    p = make_particles(16, SIZE, snr=0.5, seed=4)
    a, b = write_stack(d / "a.mrc", p["noisy_a"]), write_stack(d / "b.mrc", p["noisy_b"])
    out = tmp_path / "run"
    pairs = ["--set", "data.kind=pairs", "--set", f'data.inputs=["{a}"]', "--set", f'data.targets=["{b}"]']
    assert train(*pairs, *BASE, "--set", "train.steps=1", "--out", str(out)) == 0
    q = make_particles(24, SIZE, snr=0.5, seed=5)  # other stacks under the same names
    write_stack(d / "a.mrc", q["noisy_a"], overwrite=True)
    write_stack(d / "b.mrc", q["noisy_b"], overwrite=True)
    capsys.readouterr()
    assert train("--out", str(out), "--resume", "--no-progress", "--set", "train.steps=2") == 2
    assert "input stacks changed" in capsys.readouterr().err
    assert _ckpt_steps(out) == [1]


def test_refuses_non_empty_out_dir_and_overwrite_keeps_user_files(pair_files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = [*_pairs_args(pair_files), *BASE, "--set", "train.steps=2"]
    assert train(*args, "--out", str(out)) == 2
    assert "is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert train(*args, "--out", str(out), "--resume") == 2  # not a run of `jaxgrad train cnn`
    assert "nothing to resume" in capsys.readouterr().err

    assert train(*args, "--out", str(out), "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine" and _ckpt_steps(out) == [2]
    assert train(*args, "--out", str(out)) == 2  # a finished run is not overwritten silently either
    assert "is not empty" in capsys.readouterr().err
    assert train(*args, "--set", "train.steps=1", "--out", str(out), "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert _ckpt_steps(out) == [1]  # the old run's files were replaced
    assert [r["event"] for r in _lines(out / "metrics.jsonl") if "event" in r] == ["start", "end"]

    # --overwrite never deletes a file of a name the run owns unless DIR is one of its runs
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("precious\n")
    assert train(*args, "--out", str(other), "--overwrite") == 2
    assert "refusing to delete" in capsys.readouterr().err
    assert (other / "metrics.jsonl").read_text() == "precious\n"


def test_input_errors_name_the_key_or_file(pair_files, tmp_path, capsys):
    d = tmp_path / "stacks"
    d.mkdir()
    small = write_stack(d / "small.mrc", np.zeros((32, 16, 16), np.float32) + np.arange(16, dtype=np.float32))
    short = write_stack(d / "short.mrc", make_particles(20, SIZE, snr=1.0, seed=1)["noisy_b"])
    pf = dict(pair_files, small=small, short=short, missing=d / "missing.mrc", this=pathlib.Path(__file__))
    out = tmp_path / "out"

    def err(*argv):
        assert train(*argv, "--out", str(out)) == 2
        assert not out.exists()  # nothing was created for a run that did not start
        return capsys.readouterr().err

    assert str(small) in err(*_pairs_args(pf, ("a1", "small"), ("b1", "small")), *BASE)
    msg = err(*_pairs_args(pf, ("a1",), ("short",)), *BASE)
    assert str(short) in msg and "32" in msg and "20" in msg
    pairs = _pairs_args(pf, ("a1",), ("b1",))
    assert "first and last widths must be 1" in err(*pairs, "--set", "model.channels=[2,4,1]")
    assert "model.channels" in err(*pairs, "--set", "model.channels=[1,x,1]")
    assert "model.channels" in err(*pairs, "--set", "model.channels=[1]")
    assert "missing.mrc" in err(*_pairs_args(pf, ("a1",), ("missing",)))
    assert "data.inputs" in err(*_pairs_args(pf, ("a1", "a1"), ("b1",)))
    assert "data.batch_size' (64)" in err(*pairs, "--set", "data.batch_size=64")
    assert "buffer_size" in err(*pairs, "--set", "data.batch_size=8", "--set", "data.buffer_size=4")
    assert "data.synthetic_chunk" in err("--set", "data.synthetic_chunk=0")
    assert str(pathlib.Path(__file__)) in err(*_pairs_args(pf, ("a1",), ("this",)))  # not an MRC file

    # on --resume, keys that define the network or the batch sequence cannot change
    run = tmp_path / "run"
    assert train(*pairs, *BASE, "--set", "train.steps=1", "--out", str(run)) == 0
    assert train("--out", str(run), "--resume", "--set", "model.channels=[1,8,1]") == 2
    assert "model.channels" in capsys.readouterr().err
