"""The verifier's calibration suites at toy size: ``verify_detection_limits`` (a row per op, precision and size, with
the Cramer-Rao floor), ``verify_detection_timing`` (one trial's time by part) and ``verify_false_alarms`` (the
false-alarm sweep), as ``python -m jaxgrad.bench <suite>`` runs them."""

import json

import pytest


@pytest.fixture(scope="module")
def suites():
    from jaxgrad.bench import verify_detection_limits, verify_detection_timing, verify_false_alarms

    return verify_detection_limits, verify_detection_timing, verify_false_alarms


def test_a_detection_row_carries_its_limit_and_the_floor_under_it(suites, tmp_path):
    limits, _, _ = suites
    assert limits.main(["--ops", "dense", "--precisions", "bf16", "--sizes", "64", "--trials", "2",
                        "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("verify-detection-cpu-emulated-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["op"] == "dense" and row["precision"] == "bf16" and row["trials"] == 2 and row["false_alarms"] == 0
    # no scale test at this false-alarm rate beats the kernel's own Cramer-Rao floor; the weighted test comes close
    assert 0 < row["ideal_limit"] <= row["smallest_scale_caught_in_all"] <= 10 * row["ideal_limit"]
    assert 0 < row["sigma_cramer_rao_median"] <= row["sigma_beta_median"]
    assert path.with_suffix(".txt").read_text().startswith("# device: ")
    assert not (tmp_path / "verify-detection.partial.jsonl").exists()  # a finished sweep leaves only its results


def test_the_cpu_attention_cap_is_a_flag(suites, capsys):
    limits, _, _ = suites
    args = ["--ops", "attention", "--precisions", "f32", "--sizes", "64", "--trials", "1", "--no-write"]
    assert limits.main(args + ["--cpu-max-attention", "32"]) == 0  # above the cap on the CPU: not run
    assert "entries:" not in capsys.readouterr().out
    assert limits.main(args) == 0
    assert "attention  f32         64 entries:" in capsys.readouterr().out


def test_timing_prints_one_line_per_trial(suites, capsys):
    _, timing, _ = suites
    assert timing.main(["--op", "dense", "--size", "64", "--trials", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# device: ") and out[1].startswith("# commit ")
    assert [line.split(", trial ")[1].split(":")[0] for line in out[2:]] == ["0", "1"]


def test_a_false_alarm_sweep_cut_by_its_budget_writes_what_finished(suites, tmp_path):
    fa = suites[2]
    assert fa.main(["--mode", "cpu", "--n", "1", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    txt = next(tmp_path.glob("verify-false-alarms-cpu-emulated-*.txt")).read_text()
    assert "0 correct low-precision VJPs (of 1 asked)" in txt and "# total: 0 false alarms in 0 runs" in txt


def test_a_false_alarm_sweep_replays_chosen_runs_of_its_seed(suites, monkeypatch, tmp_path):
    # --indices: the runs of --seed's draws named, and only those (a false alarm replayed after its fix)
    fa = suites[2]
    ran = []
    monkeypatch.setattr(fa, "_worker", lambda args: ran.append(args[0]) or dict(args[0], passed=True,
                                                                                 judged_as="tf32", seconds=0.0))
    assert fa.main(["--mode", "cpu", "--seed", "18", "--indices", "31", "5", "--out", str(tmp_path)]) == 0
    assert [c["i"] for c in ran] == [31, 5] and ran[0] == fa.draw(31, 18, "cpu")
    assert "2 correct low-precision VJPs (of 2 asked)" in next(tmp_path.glob("*.txt")).read_text()


def test_a_mixed_precision_sweep_counts_false_alarms_and_planted_catches_apart(suites, tmp_path):
    # seed 0's first three draws: a 1% planted conv (bf16 > f16), a correct conv (f32 > TF32), a 1% planted dense
    fa = suites[2]
    assert [(d["op"], d["precision"], d["planted"]) for d in (fa.draw(i, 0, "mixed") for i in range(3))] == [
        ("conv", "bf16>f16", 0.01), ("conv", "f32>tf32", 0.0), ("dense", "bf16>f16", 0.01)]
    assert fa.main(["--mode", "mixed", "--n", "3", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("verify-false-alarms-cpu-mixed-*.json")).read_text())
    assert data["summary"]["false_alarms"] == 0 and data["summary"]["runs"] == 1
    assert data["summary"]["planted_caught"] == 2
    # each gradient judged at its backward's precision (or the forward's where that is coarser), never finer
    assert [r["leaf_runs"] for r in data["runs"]] == [["bf16", "bf16"], ["tf32", "tf32"], ["bf16", "bf16"]]
