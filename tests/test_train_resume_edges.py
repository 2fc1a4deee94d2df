"""`jaxgrad train` and the engine never lose a user's state or silently change a setting:

* ``--resume`` with a config file is the saved run <- the file <- ``--set``, and a key an earlier command set with
  ``--set`` keeps its value against the file;
* a resume of a finished run keeps the summary's loss; a directory whose checkpoints were all moved aside is refused
  (never a silent restart from step 0); a run refused before it starts leaves no files; ``metrics.csv`` has one
  header across resumes;
* ``nan_policy = "skip"`` stops after ``max_consecutive_skips`` skipped steps in a row (or when none was applied)
  and the summary counts skipped steps across resumes;
* only configuration and data errors become one-line errors; anything else keeps its traceback;
* settings an optimizer or schedule would not use are refused by name; a changed ``steps`` on resume says that the
  schedule's horizon moved;
* ``data.files`` takes absolute paths, ``target_modules`` a PEFT regex string;
* language models report tokens/s.
"""

import csv
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cli import main
from jaxgrad.train import NoGoodCheckpointError, Task, TrainConfig, TrainingDiverged, fit, train_in_memory
from jaxgrad.train.metrics import CSV_FILE, METRICS_FILE

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A KAN fit that trains in a second: Adam on 32 points, one grid.
KAN_TOML = """\
[train]
optimizer = "adam"
lr = 0.01
lbfgs_warmup_steps = 0
steps = 4
log_every = 2
checkpoint_every = 2

[model]
dtype = "float32"
grids = [3]

[data]
n_train = 32
n_test = 16
"""


def _kan(tmp_path, *args):
    cfg = tmp_path / "kan.toml"
    if not cfg.exists():
        cfg.write_text(KAN_TOML)
    return main(["train", "kan", str(cfg), *args, "--no-progress"])


def _lines(out):
    return [json.loads(s) for s in (pathlib.Path(out) / METRICS_FILE).read_text().splitlines()]


def _run_config(out):
    return json.loads((pathlib.Path(out) / "run.json").read_text())["config"]


# ------------------------------------------------------------------------------------------------------------
# --resume with a config file
# ------------------------------------------------------------------------------------------------------------

def test_resume_with_the_config_file_keeps_what_earlier_set_options_gave(tmp_path, capsys):
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out), "--set", "train.steps=3", "--set", "train.log_every=1",
                "--set", "train.seed=5", "--set", "data.seed=2") == 0
    capsys.readouterr()
    # the same file again, training longer: seed and data.seed (fixed) and log_every keep their --set values
    assert _kan(tmp_path, "--out", str(out), "--resume", "--set", "train.steps=5") == 0
    text = capsys.readouterr().out
    cfg = _run_config(out)
    assert (cfg["train"]["steps"], cfg["train"]["seed"], cfg["train"]["log_every"], cfg["data"]["seed"]) == \
        (5, 5, 1, 2)
    assert "resuming with changes: train.steps: 3 -> 5" in text
    assert [r["step"] for r in _lines(out) if "loss" in r and "event" not in r] == [1, 2, 3, 4, 5]
    # the file passed again with nothing else: steps stays 5 (an earlier --set outranks the file), said in a note
    assert _kan(tmp_path, "--out", str(out), "--resume") == 0
    text = capsys.readouterr().out
    assert _run_config(out)["train"]["steps"] == 5
    assert "has train.steps = 4, but the run was given --set train.steps=5, which is kept" in text


def test_resume_takes_the_files_values_over_the_saved_ones(tmp_path, capsys):
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out)) == 0
    edited = tmp_path / "edited.toml"
    edited.write_text(KAN_TOML.replace("lr = 0.01", "lr = 0.02").replace("steps = 4", "steps = 6"))
    assert main(["train", "kan", str(edited), "--out", str(out), "--resume", "--no-progress"]) == 0
    cfg = _run_config(out)
    assert cfg["train"]["lr"] == 0.02 and cfg["train"]["steps"] == 6
    assert json.loads((out / "summary.json").read_text())["step"] == 6
    # a fixed key the file changes is the user's change: refused, naming it
    edited.write_text(KAN_TOML.replace("n_train = 32", "n_train = 64"))
    capsys.readouterr()
    assert main(["train", "kan", str(edited), "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "data.n_train: 32 -> 64" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# resume edge cases
# ------------------------------------------------------------------------------------------------------------

def test_resume_of_a_finished_run_keeps_the_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out)) == 0
    first = json.loads((out / "summary.json").read_text())
    assert isinstance(first["final_loss"], float)
    assert _kan(tmp_path, "--out", str(out), "--resume") == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["step"] == 4 and again["final_loss"] == first["final_loss"]
    assert [r["final_loss"] for r in _lines(out) if r.get("event") == "end"] == [first["final_loss"]] * 2
    assert first["items_per_s"] > 0 and again["items_per_s"] == first["items_per_s"]  # nothing trained: kept


def test_metrics_csv_has_one_header_across_resumes(tmp_path):
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out), "--set", "train.steps=2") == 0
    assert _kan(tmp_path, "--out", str(out), "--resume", "--set", "train.steps=4") == 0
    rows = list(csv.reader(open(out / CSV_FILE)))
    assert [r[0] for r in rows] == ["step", "2", "4"]


def test_a_run_refused_before_it_starts_leaves_nothing_behind(tmp_path, capsys):
    out = tmp_path / "run"
    # the engine refuses L-BFGS on mini-batches: no run.json / config.toml / checkpoints, the directory is not made
    settings = ["train", "kan", "--set", "data.n_train=20", "--set", "model.grids=[3]", "--set", "model.dtype=float32",
                "--set", "train.steps=2", "--no-progress"]
    assert main(settings + ["--set", "data.batch_size=10", "--out", str(out)]) == 2
    assert "'lbfgs' needs the whole objective in one batch" in capsys.readouterr().err
    assert not out.exists()
    # in a directory holding a file of the user's (--overwrite): only the user's file is left
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(settings + ["--set", "data.batch_size=10", "--out", str(out), "--overwrite"]) == 2
    assert "'lbfgs' needs the whole objective in one batch" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # the corrected command needs nothing more
    assert main(settings + ["--set", "data.batch_size=20", "--out", str(tmp_path / "run2")]) == 0


def test_a_data_error_leaves_nothing_behind(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "lora", "--set", "data.files=no_such_dir/*.py", "--set", "train.steps=1", "--out", str(out),
            "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'files' pattern 'no_such_dir/*.py' matches no file" in err and err.count("\n") == 1
    assert not out.exists()


def test_cnn_refuses_a_batch_larger_than_the_data_before_writing_particles(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "cnn", "--set", "data.n=8", "--set", "data.batch_size=16", "--out", str(out),
                 "--no-progress"]) == 2
    assert "'data.batch_size' (16) is larger than the number of particles" in capsys.readouterr().err
    assert not out.exists()


W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


def toy_task(n=24, batch=4, poison=lambda epoch, k: False, **kw):
    """y = x w + b; ``poison(epoch, k)``: that batch has a NaN input."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ W_TRUE + 0.3).astype(np.float32)[:, None]

    def batches(epoch):
        for k in range(n // batch):
            xb = x[k * batch:(k + 1) * batch].copy()
            if poison(epoch, k):
                xb[0, 0] = np.nan
            yield xb, y[k * batch:(k + 1) * batch]

    return Task("toy", init=lambda key: {"w": jax.random.normal(key, (3, 1)) * 0.1, "b": jnp.zeros((1,))},
                loss=lambda p, b: (jnp.sum(jnp.square(b[0] @ p["w"] + p["b"] - b[1])), b[0].shape[0]),
                batches=batches, batches_per_epoch=n // batch, **kw)


CFG = TrainConfig(steps=8, optimizer="adam", lr=0.05, log_every=1, checkpoint_every=4, keep=3, seed=1)


def test_a_directory_whose_checkpoints_were_all_moved_aside_is_refused_every_time(tmp_path, capsys):
    out = tmp_path / "run"
    fit(toy_task(), CFG, out)
    for step in (4, 8):
        (out / "checkpoints" / str(step) / "jaxgrad-checksums.json").unlink()  # neither verifies
    with pytest.raises(NoGoodCheckpointError, match="no checkpoint passes verification"):
        fit(toy_task(), CFG, out, resuming=True)
    aside = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert [a.split(".")[0] for a in aside] == ["4", "8"] and all(".corrupt-" in a for a in aside)
    # a second resume must not start again from step 0: it names the checkpoints that were moved aside
    with pytest.raises(NoGoodCheckpointError, match=r"4\.corrupt-.*8\.corrupt-.*start again from step 0"):
        fit(toy_task(), CFG, out, resuming=True)
    assert not any(r.get("event") == "resume" for r in _lines(out))  # nothing was trained or logged


# ------------------------------------------------------------------------------------------------------------
# nan_policy = "skip"
# ------------------------------------------------------------------------------------------------------------

def test_skip_policy_stops_after_max_consecutive_skips(tmp_path):
    always = toy_task(poison=lambda e, k: True)
    cfg = CFG.replace(nan_policy="skip", max_consecutive_skips=3, steps=12, checkpoint_every=100)
    with pytest.raises(TrainingDiverged, match=r"steps 1\.\.3: 3 consecutive steps had a non-finite loss .*"
                                               r"max_consecutive_skips=3"):
        fit(always, cfg, tmp_path / "a")
    # fewer steps than the limit, none applied: still an error, never a run that "succeeds" with loss nan
    with pytest.raises(TrainingDiverged, match="none of the 2 steps up to step 2 was applied"):
        fit(always, cfg.replace(steps=2), tmp_path / "b")
    with pytest.raises(TrainingDiverged, match="3 consecutive steps"):
        train_in_memory(always, cfg)
    # isolated bad batches are skipped and counted; the run goes on
    sometimes = toy_task(poison=lambda e, k: k in (1, 3))  # every other step, never 2 in a row
    r = fit(sometimes, cfg.replace(max_consecutive_skips=2), tmp_path / "c")
    assert r.skipped == 4 and np.isfinite(r.final_loss)  # batches 1 and 3 of both epochs
    with pytest.raises(ValueError, match="'max_consecutive_skips' must be an int >= 1"):
        TrainConfig(max_consecutive_skips=0)


class Crash(RuntimeError):
    pass


def test_skipped_steps_are_counted_across_resumes(tmp_path):
    task = toy_task(poison=lambda e, k: (e, k) == (0, 1))  # step 2 is skipped
    cfg = CFG.replace(nan_policy="skip")

    def crash(step, loss):
        if step == 6:
            raise Crash

    with pytest.raises(Crash):
        fit(task, cfg, tmp_path / "run", step_callback=crash)  # checkpoint 4 holds the count
    r = fit(task, cfg, tmp_path / "run", resuming=True)
    assert r.step == 8 and r.skipped == 1


def test_cli_run_whose_steps_are_all_skipped_fails(tmp_path, capsys):
    # KAN's shipped configuration uses nan_policy = "skip"; a learning rate that overflows float32 makes every step
    # after the first non-finite
    out = tmp_path / "run"
    rc = main(["train", "kan", str(ROOT / "configs" / "kan.toml"), "--set", "model.dtype=float32",
               "--set", "model.grids=[3]", "--set", "train.optimizer=adam", "--set", "train.lr=1e30",
               "--set", "train.lbfgs_warmup_steps=0",
               "--set", "train.steps=12", "--set", "train.max_consecutive_skips=4", "--set", "data.n_train=32",
               "--set", "data.n_test=16",
               "--out", str(out), "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "4 consecutive steps had a non-finite loss or gradient and were skipped" in err and err.count("\n") == 1
    assert not (out / "summary.json").exists()


def test_summary_says_how_many_steps_were_skipped(tmp_path):
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out), "--set", "train.nan_policy=skip") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["config"]["train"]["max_consecutive_skips"] == 10


# ------------------------------------------------------------------------------------------------------------
# which errors are one line
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [ValueError("Incompatible shapes for broadcasting: (3,) and (4,)"),
                                   KeyError("params")])
def test_errors_from_inside_training_keep_their_traceback(tmp_path, monkeypatch, error):
    import jaxgrad.train.loop as loop

    def broken(*a, **k):
        raise error

    monkeypatch.setattr(loop, "fit", broken)
    with pytest.raises(type(error)):
        _kan(tmp_path, "--out", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # and the run that never started left nothing


def test_config_and_data_errors_are_the_packages_own_types():
    from jaxgrad.kan.task import KANFit
    from jaxgrad.lora.task import LoraFit, make_task
    from jaxgrad.train import ConfigError
    from jaxgrad.train.errors import DataError

    with pytest.raises(ConfigError, match="'widths'"):
        KANFit(widths=(3, 1))
    with pytest.raises(ConfigError, match="'hidden_size'"):
        LoraFit(hidden_size=0)
    with pytest.raises(DataError, match="'n_bytes'"):
        make_task(LoraFit(files="json/__init__.py", n_bytes=10_000_000))


# ------------------------------------------------------------------------------------------------------------
# settings that would be ignored
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, needle", [
    (dict(optimizer="adam", weight_decay=0.01), "'weight_decay' = 0.01 is not used by optimizer 'adam'"),
    (dict(optimizer="sgd", weight_decay=0.01), "'weight_decay' = 0.01 is not used by optimizer 'sgd'"),
    (dict(optimizer="adam", momentum=0.9), "'momentum' = 0.9 is not used by optimizer 'adam'"),
    (dict(optimizer="adamw", momentum=0.9), "'momentum' = 0.9 is not used by optimizer 'adamw'"),
    (dict(optimizer="lbfgs", lr=0.1), "'lr' = 0.1 is not used by optimizer 'lbfgs'"),
    (dict(optimizer="lbfgs", schedule="cosine"), "'schedule' = 'cosine' is not used by optimizer 'lbfgs'"),
    (dict(optimizer="lbfgs", warmup_steps=5), "'warmup_steps' = 5 is not used by optimizer 'lbfgs'"),
    (dict(schedule="cosine", warmup_steps=5), "'warmup_steps' = 5 is not used by schedule 'cosine'"),
    (dict(schedule="warmup_cosine", warmup_steps=100, steps=100), "'warmup_steps' must be < steps = 100"),
])
def test_settings_the_optimizer_would_ignore_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        TrainConfig(**kw)


def test_settings_that_are_used_are_accepted():
    assert TrainConfig(optimizer="adamw", weight_decay=0.01).weight_decay == 0.01
    assert TrainConfig(optimizer="sgd", momentum=0.9).momentum == 0.9
    assert TrainConfig(optimizer="lbfgs").lr is None
    assert TrainConfig(optimizer="adam").lr == 1e-3  # the first-order default
    assert TrainConfig(schedule="warmup_cosine", warmup_steps=5, steps=10).warmup_steps == 5


def test_linear_schedule_warms_up_then_decays_to_zero_at_the_last_step():
    from jaxgrad.train.optim import make_schedule

    sched = make_schedule("linear", 1.0, 100, warmup_steps=10)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5) and float(sched(10)) == 1.0
    assert float(sched(55)) == pytest.approx(0.5) and float(sched(100)) == pytest.approx(0.0, abs=1e-7)


def test_cli_refuses_a_learning_rate_for_lbfgs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "kan", str(ROOT / "configs" / "kan.toml"), "--set", "train.lr=0.1", "--set", "train.steps=2",
                 "--set", "model.grids=[3]", "--set", "data.n_train=32", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'train.lr' = 0.1 is not used by optimizer 'lbfgs'" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_changed_steps_on_resume_says_the_schedule_horizon_moved(tmp_path, capsys):
    cfg = CFG.replace(schedule="cosine")
    fit(toy_task(), cfg, tmp_path / "run")
    capsys.readouterr()
    fit(toy_task(), cfg.replace(steps=12), tmp_path / "run", resuming=True)
    text = capsys.readouterr().out
    assert "train.steps changed from 8 to 12: the 'cosine' schedule decays over the run's total steps" in text
    assert "the learning rate at step 8 is 0.0125 (it was 0 with the old horizon)" in text
    ev = [r for r in _lines(tmp_path / "run") if r.get("event") == "resume"][0]
    assert ev["schedule_horizon"]["from"] == 8 and ev["schedule_horizon"]["to"] == 12


def test_accumulation_of_a_keyed_loss_needs_the_rng():
    from jaxgrad.train import accumulate_window, build, shard_batch

    base = toy_task()
    keyed = dataclasses.replace(base, loss=lambda p, b, key=None: base.loss(p, b), loss_takes_key=True)
    mesh, steps = build(keyed, CFG)
    params = keyed.init(jax.random.key(0))
    mbs = [shard_batch(next(keyed.batches(0)), mesh)]
    with pytest.raises(ValueError, match="the task's loss takes a key"):
        accumulate_window(steps, params, mbs)
    accumulate_window(steps, params, mbs, jax.random.key_data(jax.random.key(1)))


# ------------------------------------------------------------------------------------------------------------
# LoRA: data.files, target_modules, tokens/s
# ------------------------------------------------------------------------------------------------------------

def test_lora_files_may_be_an_absolute_path_or_glob(tmp_path):
    from jaxgrad.lora.task import LoraFit, make_task, stdlib_files
    from jaxgrad.train.errors import DataError

    for i in range(3):
        (tmp_path / f"part{i}.txt").write_bytes(bytes(range(256)) * 8)
    files = stdlib_files(str(tmp_path / "*.txt"))
    assert [f.name for f in files] == ["part0.txt", "part1.txt", "part2.txt"]
    assert stdlib_files(str(tmp_path / "part1.txt")) == [tmp_path / "part1.txt"]
    task = make_task(LoraFit(files=str(tmp_path / "*.txt"), n_bytes=4096, batch_size=2, seq_len=16))
    assert next(task.batches(0))["input_ids"].shape == (2, 16)
    with pytest.raises(DataError, match="'pattern' .*matches no file"):
        stdlib_files(str(tmp_path / "*.md"))


def test_lora_target_modules_as_a_peft_regex_string_in_toml(tmp_path):
    from jaxgrad.lora import task as lora_task
    from jaxgrad.lora.config import LoraConfig
    from jaxgrad.lora.peft import resolve_target_modules
    from jaxgrad.train import toml_config
    from jaxgrad.train.cli_train import schema_of

    toml = tmp_path / "lora.toml"
    toml.write_text('[model]\nmode = "lora"\ntarget_modules = \'model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj\'\n')
    cfg = toml_config.resolve(schema_of(lora_task), toml, [])
    fit = lora_task.fit_from_config(cfg)
    assert fit.lora_config().targets == (("self_attn", "q_proj"), ("self_attn", "v_proj"))
    for regex in (r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.(q|v)_proj"):  # PEFT's matching
        assert [n for _, n in LoraConfig(target_modules=regex).targets] == list(resolve_target_modules(regex, 2)[0])
    with pytest.raises(ValueError, match="selects different projections in different layers"):
        LoraConfig(target_modules=r".*layers\.0\..*q_proj|.*v_proj")
    with pytest.raises(ValueError, match="give a regex as one string, not inside a list"):
        LoraConfig(target_modules=[r".*\.q_proj"])


def test_lora_throughput_is_in_tokens(tmp_path, capsys):
    from jaxgrad.lora.task import LoraFit, make_task

    task = make_task(LoraFit(n_bytes=4096, batch_size=2, seq_len=16, num_hidden_layers=1))
    assert task.throughput_unit == "tokens" and task.count(next(task.batches(0))) == 2 * 16
    # accumulation: tokens of every micro-batch, not the loss's item count
    r = fit(task, TrainConfig(steps=2, accumulate=2, log_every=1, checkpoint_every=10), tmp_path / "acc")
    assert r.throughput["tokens_this_process"] == 2 * 2 * 2 * 16 and r.throughput["tokens_per_s"] > 0
    out = tmp_path / "run"
    assert main(["train", "lora", "--set", "train.steps=2", "--set", "train.log_every=1",
                 "--set", "train.print_every=1", "--set", "model.num_hidden_layers=1", "--set", "data.n_bytes=4096",
                 "--set", "data.batch_size=2", "--out", str(out), "--no-progress"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    steps = [r for r in _lines(out) if "event" not in r]
    assert all("tokens_per_s" in r and "items_per_s" not in r for r in steps)
    assert next(csv.reader(open(out / CSV_FILE)))[7] == "tokens_per_s"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["tokens_this_process"] == 2 * 2 * 32


def test_a_kan_run_saved_before_the_grid_schedule_keys_resumes_with_its_own_schedule(tmp_path, capsys):
    # a run file of a version without model.grid_update_at / input_overhang_grids, which updated its grids every
    # grid_update_every steps: it resumes (the new defaults would schedule updates twice and move the input knots)
    out = tmp_path / "run"
    assert _kan(tmp_path, "--out", str(out)) == 0
    run = json.loads((out / "run.json").read_text())
    model = run["config"]["model"]
    del model["grid_update_at"], model["input_overhang_grids"]
    model.update(grid_update_every=2, stop_grid_update_step=3)
    (out / "run.json").write_text(json.dumps(run))
    capsys.readouterr()
    assert _kan(tmp_path, "--out", str(out), "--resume", "--set", "train.steps=6") == 0, capsys.readouterr().err
    saved = _run_config(out)["model"]
    assert saved["grid_update_at"] == [] and saved["input_overhang_grids"] == []
    assert saved["grid_update_every"] == 2
