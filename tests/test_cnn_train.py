"""scripts/cnn_train.py: Noise2Noise training runs end to end (synthetic and MRC pairs), learns, checkpoints with
orbax, resumes bit-exactly after a crash or a SIGTERM, never destroys user files, and rejects bad inputs with
messages naming the option or file."""

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

from jaxgrad.cnn.data import write_stack
from jaxgrad.cnn.synthetic import make_particles

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cnn_train", ROOT / "scripts" / "cnn_train.py")
cnn_train = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cnn_train", cnn_train)
_spec.loader.exec_module(cnn_train)

# One network / optimiser / image size for every run: the script caches its jitted step per configuration.
BASE = ["--channels", "1,4,1", "--batch-size", "8", "--lr", "3e-3", "--log-every", "1", "--no-progress",
        "--n-eval", "16"]
SIZE = 24


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


def _pairs_args(pf):
    return ["--inputs", str(pf["a1"]), str(pf["a2"]), "--targets", str(pf["b1"]), str(pf["b2"])]


# 48 particles, batch 8: 6 batches per epoch; 15 steps cross two epoch boundaries.
RESUME_ARGS = ["--steps", "15", "--checkpoint-every", "4", "--keep", "3", "--seed", "5"]


@pytest.fixture(scope="module")
def reference_run(pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    cnn_train.main(_pairs_args(pair_files) + BASE + RESUME_ARGS + ["--out", str(out)])
    return out


def test_synthetic_run_writes_everything_and_learns(tmp_path):
    out = tmp_path / "run"
    summary = cnn_train.main(["--synthetic", "64", "--size", str(SIZE), "--snr", "0.5", "--steps", "48",
                              "--checkpoint-every", "10", "--keep", "2", "--image-every", "24", "--n-examples", "3",
                              "--out", str(out)] + BASE)
    # run directory: only the script's entries
    expected = ["run.json", "metrics.jsonl", "metrics.csv", "summary.json", "examples.png", "checkpoints", "images",
                "synthetic"]
    if importlib.util.find_spec("tensorboardX") is not None:  # the engine mirrors scalars to TensorBoard then
        expected.append("tensorboard")
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for name in ("clean", "noisy_a", "noisy_b", "density"):
        assert (out / "synthetic" / "train" / f"{name}.mrc").is_file()
        assert (out / "synthetic" / "heldout" / f"{name}.mrc").is_file()
    # checkpoints: every 10 steps and at the end, the last 2 kept
    assert _ckpt_steps(out) == [40, 48]
    params, opt_state, meta = cnn_train.load_checkpoint(out)
    assert meta["step"] == 48 and meta["batches_per_epoch"] == 8
    assert (meta["epoch"], meta["batch_in_epoch"]) == (6, 0)
    assert [layer["w"].shape for layer in params] == [(3, 3, 1, 4), (3, 3, 4, 1)]
    assert int(opt_state[0].count) == 48
    # metrics: start event, one line per step, end event
    recs = _lines(out / "metrics.jsonl")
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "end"
    steps = _step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 49))
    assert {"step", "epoch", "loss", "time"} <= set(steps[0])
    assert steps[-1]["epoch"] == 5
    # images
    for png in (out / "examples.png", out / "images" / "step_0000024.png", out / "images" / "step_0000048.png"):
        assert _is_png(png), png
    import matplotlib.image
    img = matplotlib.image.imread(out / "examples.png")
    assert img.shape[0] > img.shape[1] * 0.8  # 3 rows of 3 panels
    # summary: learning happened, on training batches and on the held-out set
    saved = json.loads((out / "summary.json").read_text())
    assert saved["step"] == summary["step"] == 48
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
    args = _pairs_args(pair_files) + BASE + RESUME_ARGS + ["--out", str(out)]

    class Crash(RuntimeError):
        pass

    def crash_at_11(step, loss):
        if step == 11:
            raise Crash

    with pytest.raises(Crash):
        cnn_train.main(args, step_callback=crash_at_11)
    assert _ckpt_steps(out) == [4, 8]  # nothing saved at the crash
    assert len(_step_lines(out / "metrics.jsonl")) == 11
    before = (out / "metrics.jsonl").read_text()
    # a save killed half-way leaves an orbax temporary directory: ignored (and removed) on resume
    junk = out / "checkpoints" / "12.orbax-checkpoint-tmp-1700000000"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "partial").write_bytes(b"\0" * 10)
    _, _, meta8 = cnn_train.load_checkpoint(out)
    assert (meta8["step"], meta8["epoch"], meta8["batch_in_epoch"]) == (8, 1, 2)  # mid-epoch

    cnn_train.main(["--out", str(out), "--resume", "--no-progress"])  # everything else from run.json
    assert not junk.exists()
    assert _ckpt_steps(out) == [8, 12, 15]
    ref_params, ref_opt, ref_meta = cnn_train.load_checkpoint(reference_run)
    params, opt_state, meta = cnn_train.load_checkpoint(out)
    assert meta["step"] == ref_meta["step"] == 15
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)
    # the earlier checkpoint survived the crash intact
    p8, _, _ = cnn_train.load_checkpoint(out, 8)
    r8, _, _ = cnn_train.load_checkpoint(reference_run, 8)
    _assert_trees_equal(p8, r8)
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
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("cnn_train", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
kill_at = int(sys.argv[2])
mod.main(sys.argv[3:], step_callback=lambda step, loss: step == kill_at and os.kill(os.getpid(), signal.SIGKILL))
"""


def test_resume_after_sigkill_is_bit_exact(pair_files, reference_run, tmp_path):
    """A real ``kill -9`` (no finally blocks, no flush) after step 11: resume from checkpoint 8."""
    out = tmp_path / "run"
    args = _pairs_args(pair_files) + BASE + RESUME_ARGS + ["--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(ROOT / "scripts" / "cnn_train.py"), "11"] + args,
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert _ckpt_steps(out) == [4, 8]
    assert [r["step"] for r in _step_lines(out / "metrics.jsonl")] == list(range(1, 12))
    cnn_train.main(["--out", str(out), "--resume", "--no-progress"])
    params, opt_state, _ = cnn_train.load_checkpoint(out)
    ref_params, ref_opt, _ = cnn_train.load_checkpoint(reference_run)
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)


def test_sigterm_checkpoints_then_resume_is_bit_exact(pair_files, reference_run, tmp_path):
    out = tmp_path / "run"
    args = _pairs_args(pair_files) + BASE + RESUME_ARGS + ["--out", str(out)]
    old = signal.getsignal(signal.SIGTERM)

    def term_at_6(step, loss):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as exc:
        cnn_train.main(args, step_callback=term_at_6)
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is old  # handlers restored
    assert _ckpt_steps(out) == [4, 6]  # the step-6 state was saved on the way out
    assert _lines(out / "metrics.jsonl")[-1]["event"] == "stopped"
    # resume, training longer than the reference would be fine, but stop at the same total
    cnn_train.main(["--out", str(out), "--resume", "--no-progress", "--steps", "15"])
    params, opt_state, _ = cnn_train.load_checkpoint(out)
    ref_params, ref_opt, _ = cnn_train.load_checkpoint(reference_run)
    _assert_trees_equal(params, ref_params)
    _assert_trees_equal(opt_state, ref_opt)
    # resuming a finished run trains nothing more and rewrites the summary
    summary = cnn_train.main(["--out", str(out), "--resume", "--no-progress"])
    assert summary["step"] == 15 and _ckpt_steps(out)[-1] == 15


def test_pairs_run_with_progress_bar(pair_files, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # exercise the rich progress bar
    args = _pairs_args(pair_files) + [a for a in BASE if a != "--no-progress"]
    summary = cnn_train.main(args + ["--epochs", "1", "--out", str(out)])
    assert summary["batches_per_epoch"] == 6 and summary["step"] == 6  # 32 + 16 particles, batch 8
    ev = summary["eval"]
    assert "training data" in ev["source"] and "psnr_denoised_db" not in ev and ev["n"] == 16
    assert _is_png(out / "examples.png")
    assert _ckpt_steps(out) == [6]
    assert "train" in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["data"]["inputs"] == [str(pair_files["a1"]), str(pair_files["a2"])]
    assert [f["name"] for f in run["fingerprints"]] == ["a1.mrc", "a2.mrc", "b1.mrc", "b2.mrc"]
    assert [f["shape"] for f in run["fingerprints"]] == [[32, SIZE, SIZE], [16, SIZE, SIZE]] * 2


def test_refuses_non_empty_out_dir_and_overwrite_keeps_user_files(pair_files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = _pairs_args(pair_files) + BASE + ["--steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        cnn_train.main(args)
    assert exc.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    with pytest.raises(SystemExit):  # --resume: not a run of this script
        cnn_train.main(args + ["--resume"])
    assert "nothing to resume" in capsys.readouterr().err

    cnn_train.main(args + ["--overwrite"])
    assert (out / "notes.txt").read_text() == "mine" and _ckpt_steps(out) == [2]
    with pytest.raises(SystemExit):  # a finished run is not overwritten silently either
        cnn_train.main(args)
    assert "is not empty" in capsys.readouterr().err
    cnn_train.main(args[:-2] + ["--steps", "1", "--out", str(out), "--overwrite"])
    assert (out / "notes.txt").read_text() == "mine"
    assert _ckpt_steps(out) == [1]  # the old run's files were replaced
    assert [r["event"] for r in _lines(out / "metrics.jsonl") if "event" in r] == ["start", "end"]

    # --overwrite never deletes a file of a name the script owns unless DIR is one of its runs
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(SystemExit):
        cnn_train.main(args[:-2] + ["--out", str(other), "--overwrite"])
    assert "refusing to delete" in capsys.readouterr().err
    assert (other / "metrics.jsonl").read_text() == "precious\n"


def test_input_errors_name_the_option_or_file(pair_files, tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    small = write_stack(d / "small.mrc", np.zeros((32, 16, 16), np.float32) + np.arange(16, dtype=np.float32))
    short = write_stack(d / "short.mrc", make_particles(20, SIZE, snr=1.0, seed=1)["noisy_b"])
    a1, b1 = str(pair_files["a1"]), str(pair_files["b1"])
    out = tmp_path / "out"

    def err(argv):
        with pytest.raises(SystemExit) as exc:
            cnn_train.main(argv + ["--out", str(out)])
        assert exc.value.code == 2
        assert not out.exists()  # nothing was created for a run that did not start
        return capsys.readouterr().err

    assert str(small) in err(["--inputs", a1, str(small), "--targets", b1, str(small)] + BASE)
    msg = err(["--pairs", a1, str(short)] + BASE)
    assert str(short) in msg and "32" in msg and "20" in msg
    assert "first and last widths must be 1" in err(["--pairs", a1, b1, "--channels", "2,4,1"])
    assert "--channels" in err(["--pairs", a1, b1, "--channels", "1,x,1"])
    assert "--channels" in err(["--pairs", a1, b1, "--channels", "1"])
    assert "missing.mrc" in err(["--pairs", a1, str(d / "missing.mrc")])
    assert "--targets has 1" in err(["--inputs", a1, a1, "--targets", b1])
    assert "--batch-size (64)" in err(["--pairs", a1, b1, "--batch-size", "64"])
    assert "--buffer-size (4)" in err(["--pairs", a1, b1, "--batch-size", "8", "--buffer-size", "4"])
    assert "not both" in err(["--pairs", a1, b1, "--synthetic", "10"])
    assert "not both" in err(["--pairs", a1, b1, "--steps", "3", "--epochs", "1"])
    assert "no data" in err(["--channels", "1,4,1"])
    assert str(pathlib.Path(__file__)) in err(["--pairs", a1, str(pathlib.Path(__file__))])  # not an MRC file

    # on --resume, options that define the network or the batch sequence cannot change
    run = tmp_path / "run"
    cnn_train.main(_pairs_args(pair_files) + BASE + ["--steps", "1", "--out", str(run)])
    with pytest.raises(SystemExit):
        cnn_train.main(["--out", str(run), "--resume", "--channels", "1,8,1"])
    assert "channels" in capsys.readouterr().err
