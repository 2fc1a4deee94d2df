"""The ``jaxgrad`` command: ``audit`` (the command the README shows), its help texts, ``train`` and ``bench``."""

import json

import pytest

from jaxgrad.cli import main


def test_audit_of_the_packages_ops_passes_and_writes_json(capsys, tmp_path):
    out = tmp_path / "audit.json"
    assert main(["audit", "--op", "swiglu[xla]", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "audit: swiglu[xla]" in text and "VERDICT: PASS" in text and "error vs size" in text
    data = json.loads(out.read_text())
    assert data[0]["passed"] is True and len(data[0]["reports"]) == 3


def test_planted_catalogue_is_classified(capsys):
    assert main(["audit", "--planted", "--op", "linear/"]) == 0
    text = capsys.readouterr().out
    assert "linear/bias-grad-mean" in text and "3/3 classified correctly" in text


def test_unknown_op_is_an_error(capsys):
    assert main(["audit", "--op", "no-such-op"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxgrad audit: error: no op matches 'no-such-op'") and err.count("\n") == 1, err
    assert "swiglu[xla]" in err and "kan_linear[xla]" in err  # the names --op can match


def test_audit_json_path_is_checked_before_the_audit_runs(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main(["audit", "--op", "swiglu[xla]", "--json", str(notes / "a.json")]) == 2
    out, err = capsys.readouterr()
    assert f"--json {notes / 'a.json'}: {notes} exists and is not a directory" in err and err.count("\n") == 1, err
    assert "audit: swiglu" not in out  # refused before any op was audited
    assert notes.read_text() == "my notes\n"
    assert main(["audit", "--op", "swiglu[xla]", "--json", str(tmp_path / "new" / "dir" / "a.json")]) == 0
    assert json.loads((tmp_path / "new/dir/a.json").read_text())[0]["name"] == "swiglu[xla]"  # folders created


@pytest.mark.parametrize("argv, says", [
    ([], ["jaxgrad audit --list", "Mosaic GPU and cuDNN on a GPU only", "the LoRA block included", "train cnn"]),
    (["audit"], ["interpret mode", "not run", "--list", "check_vjp", "grow faster than rounding"]),
    (["demo"], ["--quick", "--out DIR", "--overwrite"]),
    (["train"], ["{kan,cnn,lora}", "--resume", "the family's defaults"]),
    (["bench"], ["SUITE", "--sizes"]),
])
def test_every_help_text_prints_and_says_what_the_command_does(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(" ".join(s.split()) in text for s in says), text
    assert "optimizer step" not in text and "every op of the package" not in text  # no claim beyond the checks


# ------------------------------------------------------------------------------------------------------------
# jaxgrad train / bench
# ------------------------------------------------------------------------------------------------------------

import pathlib  # noqa: E402

from jaxgrad.kan import task as kan_task  # noqa: E402
from jaxgrad.train import toml_config  # noqa: E402
from jaxgrad.train.cli_train import schema_of  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_CNN = ["--set", "data.n=32", "--set", "data.size=16", "--set", "data.n_eval=8", "--set", "data.batch_size=8",
            "--set", "model.channels=[1,2,1]", "--set", "train.steps=4", "--set", "train.checkpoint_every=2",
            "--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "data.n_examples=2"]


@pytest.mark.parametrize("family", ["kan", "cnn", "lora"])
def test_example_configs_resolve(family):
    from jaxgrad.train.families import family_module

    cfg = toml_config.resolve(schema_of(family_module(family)), ROOT / "configs" / f"{family}.toml", [])
    toml_config.train_config(cfg)  # valid engine settings
    if family == "kan":
        import jax

        with jax.enable_x64(True):
            kan_task.fit_from_config(cfg)  # valid model/data (float64)


@pytest.mark.parametrize("args, needle", [
    (["configs/missing.toml"], "configs/missing.toml: no such config file"),
    (["--set", "train.lr=abc"], "'train.lr' must be a number (or none), got 'abc'"),
    (["--set", "model.widht=3"], "unknown key 'model.widht'"),
    (["--set", "lr"], "expected key=value"),
    (["--set", "seed=3"], "'seed' is in [train], [data]; write train.seed"),
    (["--set", "train.optimizer=rmsprop"], "'train.optimizer' must be one of"),
    (["--set", "train.steps=0"], "'train.steps' must be an int >= 1"),
    (["--set", "model.backend=cuda"], "'model.backend' must be one of ['xla', 'pallas', 'reference']"),
])
def test_train_errors_are_one_line_and_exit_2(args, needle, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "kan", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()  # nothing was created for a run that did not start


@pytest.mark.parametrize("below", ["run", "a/b/run"])
def test_train_out_below_a_file_is_one_line_naming_out(below, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    out = notes / below
    assert main(["train", "kan", "--set", "train.steps=1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {notes} exists and is not a directory" in err and err.count("\n") == 1, err
    assert notes.read_text() == "my notes\n"


def test_train_rejects_bad_toml(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    for text, needle in (('[model]\nwidths = "2,1"\n', "'model.widths' must be a list of integers"),
                         ("[modle]\n", "unknown section [modle]"), ("[model\n", "not valid TOML"),
                         ("[train]\nsteps = 1.5\n", "'train.steps' must be an integer")):
        bad.write_text(text)
        assert main(["train", "kan", str(bad), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and needle in err and err.count("\n") == 1, err
    bad.write_bytes(b"[train]\n# caf\xe9 (Latin-1)\nsteps = 3\n")  # TOML is UTF-8
    assert main(["train", "kan", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: not valid TOML (not UTF-8: byte 0xe9 on line 2" in err and err.count("\n") == 1, err
    assert main(["train", "kan", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: is a directory; expected a TOML config file" in err and err.count("\n") == 1, err


def test_train_cnn_runs_saves_its_config_resumes_and_refuses_changes(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "cnn", "configs/cnn.toml", *TINY_CNN, "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "[model]\nchannels = [1, 2, 1]" in text  # the resolved configuration is printed
    run = json.loads((out / "run.json").read_text())
    assert run["script"] == "jaxgrad train cnn" and run["config"]["train"]["steps"] == 4
    assert (out / "config.toml").read_text().startswith("[train]")
    for name in ("summary.json", "metrics.jsonl", "metrics.csv", "examples.png", "checkpoints", "synthetic"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 4 and summary["eval"]["n"] == 8

    # no overwrite without --overwrite; --resume refuses model/data changes and names the keys
    assert main(["train", "cnn", "configs/cnn.toml", *TINY_CNN, "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["train", "cnn", "--out", str(out), "--resume", "--set", "model.channels=[1,3,1]",
                 "--set", "data.batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "model.channels: [1, 2, 1] -> [1, 3, 1]" in err and "data.batch_size: 8 -> 4" in err
    # a run of another family is not touched
    assert main(["train", "kan", "--out", str(out), "--resume"]) == 2
    assert "not written by `jaxgrad train kan`" in capsys.readouterr().err
    # train longer: steps may change
    assert main(["train", "cnn", "--out", str(out), "--resume", "--set", "train.steps=6", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 6
    events = [json.loads(s).get("event") for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e] == ["start", "end", "resume", "end"]


def test_bench_delegates_to_the_bench_script(tmp_path, capsys):
    rc = main(["bench", "swiglu", "--sizes", "small", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "swiglu" in text and "wrote" in text
    assert list(tmp_path.glob("swiglu-*.txt"))


def test_train_refusal_by_the_engine_is_one_line(tmp_path, capsys):
    # L-BFGS needs the whole objective in one batch: a mini-batch KAN fit is refused before training
    out = tmp_path / "run"
    args = ["train", "kan", "--set", "data.batch_size=10", "--set", "data.n_train=20", "--set", "model.grids=[3]",
            "--set", "model.dtype=float32", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'lbfgs' needs the whole objective in one batch" in err and err.count("\n") == 1, err


def test_train_kan_runs_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    args = ["train", "kan", "configs/kan.toml", "--set", "model.dtype=float32", "--set", "model.grids=[3]",
            "--set", "train.optimizer=adam", "--set", "train.lr=0.01", "--set", "train.lbfgs_warmup_steps=0",
            "--set", "train.steps=3",
            "--set", "data.n_train=32", "--set", "data.n_test=16", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["eval"]["grid_size"] == 3 and summary["eval"]["test_rmse"] > 0
    assert (out / "activations.png").read_bytes()[:4] == b"\x89PNG"
    assert "done: step 3" in capsys.readouterr().out
