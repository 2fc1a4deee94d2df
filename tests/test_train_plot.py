"""The loss-curve plot (jaxgrad.train.plot): a run's metrics.jsonl read as the engine writes it -- a resume undoes
the records past its checkpoint, a step logged twice keeps the later record, NaN windows and skipped steps are
kept apart from the curve, a line cut by a crash is counted -- and drawn to a valid PNG beside it; a real
`jaxgrad train lora` run with a resume plots; bad input is named."""

import json
import math

import pytest

from jaxgrad.train.plot import LOSS_PLOT, loss_history, plot_loss_curve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _step(step, loss, **extra):
    return {"step": step, "epoch": 0, "batch": step - 1, "loss": loss, "n_steps": 1, **extra}


def synthetic_run(tmp_path):
    """Steps 1..30 with a NaN window at 12 (both steps skipped) and an eval at 10 and 20; a crash after step 30
    (last line cut short); a resume from the checkpoint at 20 that reruns 21..26 with other losses; the end."""
    first = [{"event": "start", "step": 0}]
    first += [_step(s, 5.0 / s, skipped=0) for s in range(1, 31) if s != 12]
    first.insert(12, _step(12, float("nan"), skipped=2))
    first += [{"event": "eval", "step": 10, "heldout_loss": 0.9, "heldout_perplexity": 2.5},
              {"event": "eval", "step": 20, "heldout_loss": 0.5, "heldout_perplexity": 1.6}]
    resumed = [{"event": "resume", "step": 20}] + [_step(s, 1.0 / s, skipped=0) for s in range(21, 27)]
    resumed += [{"event": "end", "step": 26, "final_loss": 1 / 26, "eval": {"heldout_loss": 0.4}}]
    (tmp_path / "run.json").write_text(json.dumps({"script": "jaxgrad train lora", "config": {}}))
    path = _write(tmp_path / "metrics.jsonl", first)
    with open(path, "a") as f:
        f.write('{"step": 31, "loss": 0.1')  # cut by the crash: the resumed run's MetricsLog adds the newline
        f.write("\n" + "".join(json.dumps(r) + "\n" for r in resumed))
    return path


def test_history_after_a_crash_and_a_resume(tmp_path):
    hist = loss_history(synthetic_run(tmp_path))
    assert list(hist.train) == list(range(1, 27))  # 27..30 of the first attempt were undone by the resume
    assert hist.train[25] == 1.0 / 25 and hist.train[20] == 5.0 / 20
    assert math.isnan(hist.train[12]) and hist.skipped == {12: 2}
    assert hist.heldout == {"heldout_loss": {10: 0.9, 20: 0.5, 26: 0.4}}  # perplexity is not a loss
    assert hist.restarts == [20] and hist.bad_lines == 1


def test_a_step_logged_twice_keeps_the_later_record(tmp_path):
    path = _write(tmp_path / "metrics.jsonl", [_step(1, 3.0), _step(2, 2.0), _step(2, 1.5, skipped=1),
                                               _step(2, 1.25)])
    hist = loss_history(path)
    assert hist.train == {1: 3.0, 2: 1.25} and hist.skipped == {}


def _is_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01  # something is drawn on it


def test_the_plot_is_a_png_beside_the_metrics(tmp_path):
    path = synthetic_run(tmp_path)
    out = plot_loss_curve(path)
    assert out == tmp_path / LOSS_PLOT
    _is_png(out)
    other = plot_loss_curve(tmp_path, tmp_path / "figs" / "curve.png")  # a run directory works too
    assert other == tmp_path / "figs" / "curve.png"
    _is_png(other)


def test_negative_losses_plot_on_a_linear_axis(tmp_path):
    path = _write(tmp_path / "metrics.jsonl", [_step(1, -1.0), _step(2, -2.0)])
    _is_png(plot_loss_curve(path))


def test_a_real_tiny_lora_run_with_a_resume_plots(tmp_path):
    from jaxgrad.cli import main

    out = tmp_path / "run"
    tiny = ["--set", "train.log_every=2", "--set", "train.checkpoint_every=4", "--set", "train.eval_every=4",
            "--set", "data.n_bytes=8192", "--set", "data.batch_size=4", "--no-progress", "--out", str(out)]
    assert main(["train", "lora", "configs/lora.toml", "--set", "train.steps=8", *tiny]) == 0
    assert main(["train", "lora", "configs/lora.toml", "--set", "train.steps=12", "--resume", *tiny]) == 0
    hist = loss_history(out / "metrics.jsonl")
    assert list(hist.train) == [2, 4, 6, 8, 10, 12] and hist.restarts == [8]
    assert list(hist.heldout["heldout_loss"]) == [4, 8, 12]
    _is_png(plot_loss_curve(out / "metrics.jsonl"))


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="'metrics_path'"):
        plot_loss_curve(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="'metrics_path'.*run directory"):
        plot_loss_curve(tmp_path)  # a directory without metrics.jsonl
    only_events = _write(tmp_path / "metrics.jsonl", [{"event": "start", "step": 0},
                                                       _step(1, float("nan"), skipped=1)], tail="{not json\n")
    with pytest.raises(ValueError, match="'metrics_path'.*no finite training loss.*1 non-finite, 1 lines not JSON"):
        plot_loss_curve(only_events)
    good = _write(tmp_path / "good.jsonl", [_step(1, 1.0)])
    with pytest.raises(ValueError, match="'out_png'"):
        plot_loss_curve(good, tmp_path / "curve.svg")
    with pytest.raises(TypeError, match="'metrics_path'"):
        plot_loss_curve(3.5)
