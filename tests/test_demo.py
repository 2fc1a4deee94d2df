"""``jaxgrad demo``: the report folder, its numbers and the console summary, as the issue specifies them.

One ``jaxgrad demo --quick`` run (module fixture, in-process through ``jaxgrad.cli.main``) is inspected by every
test; the refusals of the report folder are checked before any work starts, so they cost nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import numpy as np
import pytest

from jaxgrad.cli import main
from jaxgrad.demo import outdir


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``(report folder, exit status, console output)`` of one quick demo."""
    report = tmp_path_factory.mktemp("demo") / "report"
    status, out, _ = _run_cli(["demo", "--quick", "--out", str(report)])
    return report, status, out


@pytest.fixture(scope="module")
def metrics(demo):
    return json.loads((demo[0] / outdir.METRICS).read_text())


def _finite_numbers(tree, path="metrics"):
    """Every number in a JSON tree, with its path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _finite_numbers(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _finite_numbers(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


def test_exit_status_zero_and_every_audit_verdict_passes(demo, metrics):
    _, status, _ = demo
    assert status == 0
    audit = metrics["audit"]
    assert audit["passed"] is True and audit["n_failed"] == 0 and audit["n_ops"] == len(audit["ops"]) >= 2
    for op in audit["ops"]:
        assert op["passed"] is True, op
        assert 0 <= op["worst_fraction_of_bound"] < 1, op


def test_report_folder_has_the_stated_files(demo):
    report = demo[0]
    for name in outdir.OWNED:
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    for png in report.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not [p.name for p in report.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_index_html_shows_every_png_with_relative_links(demo):
    report = demo[0]
    html = (report / outdir.INDEX).read_text()
    shown = set(re.findall(r'<img src="([^"]+)"', html))
    linked = set(re.findall(r'href="([^"]+)"', html))
    assert shown == {p.name for p in report.glob("*.png")}
    for ref in shown | linked:
        assert "/" not in ref and ":" not in ref, f"not a relative link into the folder: {ref}"
        assert (report / ref).is_file(), ref
    assert outdir.VERDICTS in linked and outdir.METRICS in linked
    for words in ("Are the hand-written gradients right?", "A KAN learns a formula", "A denoiser learns"):
        assert words in html


def test_metrics_json_has_the_stated_keys_with_finite_numbers(metrics):
    assert metrics["report"] == outdir.REPORT_MARK and metrics["complete"] is True and metrics["plan"] == "quick"
    assert metrics["device"]["platform"] in ("cpu", "gpu")
    for stage in ("audit", "kan", "denoiser", "report", "total"):
        assert metrics["seconds"][stage] > 0 and metrics["cpu_seconds"][stage] > 0
    for key in ("rmse_before_refinement", "rmse_after_refinement", "refinement_gain", "final_train_mse"):
        assert key in metrics["kan"]
    assert [g["grid"] for g in metrics["kan"]["per_grid"]] == metrics["kan"]["grids"]
    for key in ("psnr_noisy_db", "psnr_denoised_db", "psnr_gain_db", "mse_noisy_vs_clean", "mse_vs_clean_final",
                "n2n_loss_initial", "n2n_loss_final", "final_train_loss"):
        assert key in metrics["denoiser"]
    numbers = dict(_finite_numbers(metrics))
    assert len(numbers) > 30
    assert all(math.isfinite(v) for v in numbers.values()), [k for k, v in numbers.items() if not math.isfinite(v)]


def test_kan_refinement_lowers_the_error(metrics):
    kan = metrics["kan"]
    before, after = kan["rmse_before_refinement"], kan["rmse_after_refinement"]
    # the untrained KAN is off by ~2 (RMSE of the target around its mean); the quick run reaches ~7e-2 on grid 3
    # and ~2e-2 after refining to 5 (a KAN that did not train, or a refinement that lost the fit, fails both)
    assert before < 0.2
    assert after < 0.6 * before
    assert kan["per_grid"][-1]["train_rmse"] < 0.6 * kan["per_grid"][0]["train_rmse"]


def test_denoiser_beats_the_noisy_input(metrics):
    d = metrics["denoiser"]
    # the quick run: 4 dB noisy -> ~22 dB denoised; MSE vs clean 0.9 -> 0.015
    assert d["psnr_denoised_db"] > d["psnr_noisy_db"] + 10
    assert d["mse_vs_clean_final"] < 0.1 * d["mse_noisy_vs_clean"]
    assert d["n2n_loss_final"] < d["n2n_loss_initial"]


def test_verdicts_txt_holds_every_full_table(demo, metrics):
    text = (demo[0] / outdir.VERDICTS).read_text()
    for op in metrics["audit"]["ops"]:
        assert f"audit: {op['name']}" in text
    assert text.count("VERDICT: PASS") == metrics["audit"]["n_ops"]


def test_console_is_one_screen_and_names_the_report(demo, metrics):
    report, _, out = demo
    lines = out.rstrip("\n").splitlines()
    assert len(lines) < 40, out
    assert max(len(line) for line in lines if str(report) not in line) <= 120, out
    assert str((report / outdir.INDEX).resolve()) in out
    assert "device: CPU" in out or "device: GPU" in out
    for op in metrics["audit"]["ops"]:
        assert f"PASS  {op['name'][:46]}" in out
    assert "test RMSE" in out and "PSNR" in out


def test_a_second_run_into_the_report_is_refused_without_overwrite(demo):
    report = demo[0]
    before = {p.name: p.stat().st_mtime_ns for p in report.iterdir()}
    status, out, err = _run_cli(["demo", "--quick", "--out", str(report)])
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "--out" in err and "previous demo report" in err and "--overwrite" in err
    assert {p.name: p.stat().st_mtime_ns for p in report.iterdir()} == before


def test_a_foreign_folder_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    status, out, err = _run_cli(["demo", "--quick", "--out", str(tmp_path)])
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "not a demo report" in err and "notes.txt" in err
    # --overwrite would replace a file of the user's that has a report file's name: refused too
    (tmp_path / "index.html").write_text("my page")
    status, _, err = _run_cli(["demo", "--quick", "--overwrite", "--out", str(tmp_path)])
    assert status == 2 and len(err.strip().splitlines()) == 1 and "index.html" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html", "notes.txt"]
    assert (tmp_path / "index.html").read_text() == "my page"
    status, _, err = _run_cli(["demo", "--quick", "--out", str(tmp_path / "notes.txt")])
    assert status == 2 and "not a directory" in err


def test_overwrite_replaces_only_a_previous_reports_files(tmp_path):
    outdir.prepare_out_dir(tmp_path / "r", overwrite=False)
    for name in outdir.OWNED[1:]:
        (tmp_path / "r" / name).write_text("old")
    (tmp_path / "r" / "notes.txt").write_text("mine")
    outdir.prepare_out_dir(tmp_path / "r", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["metrics.json", "notes.txt"]
    assert outdir.is_demo_report(tmp_path / "r")


def test_a_failing_verdict_gives_a_nonzero_exit_status(tmp_path, monkeypatch):
    """Stages replaced by fakes (one failing op): the exit status, the console and a report without the examples
    PNG (index.html shows the PNGs that exist)."""
    import jax

    from jaxgrad.demo import run as demo_run
    from jaxgrad.demo.audit_stage import AuditResult, OpVerdict
    from jaxgrad.demo.denoiser_stage import EVAL_KEYS, DenoiserResult
    from jaxgrad.demo.kan_stage import GridFit, KANResult
    from jaxgrad.kan.network import kan_init

    verdicts = (OpVerdict("good_op", True, 0.1, [(3,)], 0.1, "audit: good_op\n  VERDICT: PASS"),
                OpVerdict("bad_op", False, 7.5, [(3,)], 0.1, "audit: bad_op\n  VERDICT: FAIL"))
    params = jax.tree.map(np.asarray, kan_init(jax.random.key(0), (2, 1, 1), grid_size=3, spline_order=3))
    kan = KANResult(per_grid=(GridFit(3, 0.1, 0.1, 5), GridFit(5, 0.05, 0.05, 10)), losses=np.linspace(1, 0.1, 10),
                    phases=((0, "Adam, G=3"), (5, "L-BFGS, G=5")), params=params, n_train=10, n_test=10, seconds=0.1)
    den = DenoiserResult(evaluation={k: 1.0 for k in EVAL_KEYS}, losses=np.linspace(1, 0.5, 10), particles=8,
                         size=8, snr=0.1, n_eval=2, steps=10, batch=2, seconds=0.1)
    def fake_audit(plan, on_verdict):
        for i, v in enumerate(verdicts):
            on_verdict(v, i, len(verdicts))
        return AuditResult(verdicts, 0.2)

    monkeypatch.setattr(demo_run, "run_audit", fake_audit)
    monkeypatch.setattr(demo_run, "run_kan", lambda plan: kan)
    monkeypatch.setattr(demo_run, "run_denoiser", lambda plan, png: den)
    status, out, _ = _run_cli(["demo", "--quick", "--out", str(tmp_path / "r")])
    assert status == 1
    assert "FAIL  bad_op" in out and "1 of 2 gradient checks FAIL" in out
    metrics = json.loads((tmp_path / "r" / outdir.METRICS).read_text())
    assert metrics["audit"]["passed"] is False and metrics["audit"]["n_failed"] == 1
    html = (tmp_path / "r" / outdir.INDEX).read_text()
    assert set(re.findall(r'<img src="([^"]+)"', html)) == {p.name for p in (tmp_path / "r").glob("*.png")}
    assert outdir.DENOISED_EXAMPLES_PNG not in html
