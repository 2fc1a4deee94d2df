"""Fast CPU tests of the benchmark harness (:mod:`jaxgrad.bench.harness`) and its command line
(``python -m jaxgrad.bench``, ``jaxgrad bench``, ``scripts/bench.py``)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxgrad.bench import harness as bm

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    fn = jax.jit(lambda x, y: (jnp.tanh(x) @ y, x.sum()))
    return fn, (jnp.ones((8, 16), jnp.float32), jnp.ones((16, 4), jnp.float32))


def test_time_fn_sane(tiny):
    fn, args = tiny
    t = bm.time_fn(fn, *args, warmup=1, repeats=5)
    assert set(t) == {"median_ms", "p10_ms", "p90_ms", "min_ms", "loop_ms", "repeats"}
    assert t["repeats"] == 5
    assert 0 < t["min_ms"] <= t["p10_ms"] <= t["median_ms"] <= t["p90_ms"] < 1e4
    assert 0 < t["loop_ms"] < 1e4  # back-to-back calls: one wait for all of them
    with pytest.raises(ValueError):
        bm.time_fn(fn, *args, repeats=0)


def test_the_loop_time_overlaps_each_calls_host_work_with_the_calls_before_it():
    # a call whose host work (here a sleep before dispatch) takes longer than nothing: back to back on a CPU the
    # calls still run one after the other, so the loop time is not below the host work; what the loop time leaves
    # out is only the wait for each result, which this checks is counted once
    import time as _time

    waits = []

    def fn(x):
        waits.append(1)
        _time.sleep(0.002)
        return x + 1

    t = bm.time_fn(fn, jnp.ones(4), warmup=0, repeats=4)
    assert len(waits) == 8  # 4 timed one at a time, 4 back to back
    assert t["loop_ms"] >= 2.0


def test_memory_of_ints(tiny):
    fn, args = tiny
    mem = bm.memory_of(fn, *args)
    for k in ("argument_bytes", "output_bytes", "temp_bytes", "total_bytes"):
        assert isinstance(mem[k], int) and mem[k] >= 0, (k, mem)
    assert mem["argument_bytes"] == (8 * 16 + 16 * 4) * 4
    assert mem["output_bytes"] >= (8 * 4 + 1) * 4
    assert mem["total_bytes"] == mem["argument_bytes"] + mem["output_bytes"] + mem["temp_bytes"]
    assert "device_peak_bytes" in mem  # None on CPU, an int on GPU


def test_compiled_memory_handles_missing_analysis():
    class NoAnalysis:
        def memory_analysis(self):
            return None

    mem = bm.compiled_memory(NoAnalysis())
    assert mem["total_bytes"] is None and mem["temp_bytes"] is None


def test_floor_ms_math():
    f = bm.floor_ms(bytes_moved=1e9, device_kind="NVIDIA H200")
    assert f["table_row"] == "H200" and f["bound"] == "memory"
    assert math.isclose(f["memory_ms"], 1e9 / 4.8e12 * 1e3)
    assert f["floor_ms"] == f["memory_ms"] and f["compute_ms"] is None

    # Compute bound on H100 SXM: 1e15 bf16 FLOPs at 989e12 vs 1e9 B at 3.35e12 B/s.
    f = bm.floor_ms(flops=1e15, bytes_moved=1e9, device_kind="NVIDIA H100 80GB HBM3", dtype="bf16")
    assert f["table_row"] == "H100 SXM" and f["bound"] == "compute"
    assert math.isclose(f["compute_ms"], 1e15 / 989e12 * 1e3)
    assert math.isclose(f["memory_ms"], 1e9 / 3.35e12 * 1e3)
    assert f["floor_ms"] == max(f["compute_ms"], f["memory_ms"])

    h = "NVIDIA H100 80GB HBM3"
    assert math.isclose(bm.floor_ms(1e12, device_kind=h, precision="tf32")["compute_ms"], 1e12 / 494.7e12 * 1e3)
    assert math.isclose(bm.floor_ms(1e12, device_kind=h, precision="highest")["compute_ms"], 1e12 / 66.9e12 * 1e3)
    assert math.isclose(
        bm.floor_ms(1e12, device_kind=h, dtype=jnp.bfloat16, precision="elementwise")["compute_ms"],
        1e12 / 66.9e12 * 1e3,
    )
    with pytest.raises(ValueError):
        bm.floor_ms(1e12, device_kind=h, precision="bogus")


def test_floor_ms_off_table():
    for kind in ("cpu", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"):
        f = bm.floor_ms(flops=1e9, bytes_moved=1e9, device_kind=kind)
        assert f["floor_ms"] is None and f["table_row"] is None and f["bound"] is None


def test_environment_keys():
    env = bm.environment()
    for k in ("device_kind", "platform", "device_count", "jax", "jaxlib", "python", "datetime_utc",
              "matmul_precision", "hostname"):
        assert k in env, k
    assert env["jax"] == jax.__version__
    json.dumps(env)


def test_run_variants_and_write_results(tmp_path, tiny):
    _, args = tiny
    variants = {"a": lambda x, y: jnp.tanh(x) @ y, "b": lambda x, y: jnp.dot(jnp.tanh(x), y)}
    rows = bm.run_variants("toy", variants, args, sizes={"m": 8}, flops=2 * 8 * 16 * 4, bytes_moved=1e3,
                           warmup=1, repeats=3)
    assert [r.variant for r in rows] == ["a", "b"]
    assert all(r.median_ms > 0 and r.dtype == "f32" and r.compiled_bytes > 0 for r in rows)

    broken = bm.run_variants("toy", {"bad": lambda x, y: x @ x}, args, sizes={}, repeats=1)
    assert broken[0].median_ms is None and "error" in broken[0].notes
    rows += broken

    path = bm.write_results(rows, "toy", out_dir=tmp_path / "res")
    assert path.parent == tmp_path / "res" and path.suffix == ".json"
    platform_precision = "tf32" if jax.default_backend() == "gpu" else "default"  # f32 rows, default precision
    assert path.name.startswith(f"toy-{bm.device_slug()}-{platform_precision}-")
    assert len(path.stem.rsplit("-", 2)[1]) == 8 and len(path.stem.rsplit("-", 2)[2]) == 6  # YYYYmmdd-HHMMSS
    data = json.loads(path.read_text())
    assert set(data) == {"environment", "rows"}
    assert data["environment"]["device_kind"] == jax.devices()[0].device_kind
    assert data["rows"] == json.loads(json.dumps([r.to_dict() for r in rows]))
    assert [bm.Row(**r) for r in data["rows"]] == rows  # round trip
    txt = path.with_suffix(".txt").read_text()
    assert txt.startswith("# device:") and "median_ms" in txt and "bad" in txt

    again = bm.write_results(rows, "toy", out_dir=tmp_path / "res")  # same second: no overwrite
    assert again != path and again.exists()


def test_write_results_defaults_to_the_git_ignored_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = bm.Row(suite="toy", variant="v", sizes={"n": 1}, dtype="f32", precision="default")
    path = bm.write_results([row], "toy", env={"device_kind": "cpu"})
    assert path.parent == pathlib.Path("runs/bench") and path.exists()
    assert "/runs/" in (REPO / ".gitignore").read_text().split()


@pytest.mark.parametrize("args, needle", [
    (["swiglu", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["swiglu", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["lora", "--budget-s", "0"], "argument --budget-s: expected a number of seconds > 0, got 0"),
    (["kan", "--sizes", "long"], "--sizes long is only defined for the lora and attention suites"),
    (["cnn", "--variants", "xla"], "--variants and --budget-s are only implemented for the lora, lora_model"),
    (["nosuch"], "argument suite: invalid choice: 'nosuch'"),
    (["kan", "--grids", "20"], "argument --grids: expected G:k pairs such as 20:3,5:5, got '20'"),
    (["kan", "--sizes", "full", "--grids", "20:3,7:2"], "--grids 7:2: the 'full' sizes have G:k 5:3, 20:3, 5:5"),
    (["cnn", "--grids", "5:3"], "--grids is an option of the kan suite, not 'cnn'"),
    (["--repeats", "2", "verify_cost"], "verify_cost is a tool with its own options"),
])
def test_bench_script_bad_arguments_exit_2_with_one_error_line(args, needle, capsys):
    from jaxgrad.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err, err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]] and "Traceback" not in err


def test_the_kan_suite_runs_only_the_variants_named_and_stops_starting_groups_past_its_budget():
    from jaxgrad.bench.kan import suite_kan

    rows = suite_kan("small", "default", repeats=1, warmup=0, variants=["xla custom_vjp"])
    assert {r.variant for r in rows} == {"xla custom_vjp", "xla custom_vjp fp16_scaled"}
    rows = suite_kan("small", "default", repeats=1, warmup=0, variants=["=xla custom_vjp"])
    assert [r.variant for r in rows] == ["xla custom_vjp"]
    assert all(r.median_ms is not None for r in rows)
    rows = suite_kan("small", "default", repeats=1, warmup=0, variants=["jax.grad"], budget_s=1e-9)
    assert [r.variant for r in rows] == ["jax.grad(reference)"] and rows[0].median_ms is None
    assert "time budget" in rows[0].notes and rows[0].notes.startswith("error")


def test_bench_script_out_that_is_a_file_is_refused_before_the_suite_runs(tmp_path, capsys):
    from jaxgrad.cli import main

    (tmp_path / "results").write_text("not a directory")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "swiglu", "--out", str(tmp_path / "results" / "sub")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: --out {tmp_path}/results/sub: {tmp_path}/results exists and is not a " \
        "directory" in err
    assert (tmp_path / "results").read_text() == "not a directory"


def test_device_slug():
    assert bm.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bm.device_slug("cpu") == "cpu"


def test_the_header_gives_the_command_line_as_typed(monkeypatch):
    from jaxgrad.bench import environment

    monkeypatch.setattr(sys, "argv", ["/repo/jaxgrad/bench/__main__.py", "lora", "--sizes", "full"])
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "-m", "jaxgrad.bench", "lora", "--sizes", "full"])
    assert environment.provenance()["command"] == "python3 -m jaxgrad.bench lora --sizes full"
    monkeypatch.setattr(sys, "argv", ["/repo/scripts/bench.py", "kan"])
    assert environment.provenance()["command"] == "bench.py kan"


def test_a_result_file_is_named_suite_device_precision_date_time():
    import datetime as dt

    when = dt.datetime(2026, 11, 26, 15, 15, 2, tzinfo=dt.timezone.utc)
    env = {"device_kind": "NVIDIA H100 80GB HBM3"}
    assert bm.result_stem("lora", env, "bf16", when) == "lora-nvidia-h100-80gb-hbm3-bf16-20261126-151502"
    assert bm.result_stem("kan", {"device_kind": "cpu"}, "default", when) == "kan-cpu-default-20261126-151502"
    with pytest.raises(ValueError, match="suite must be a non-empty file-name-safe word"):
        bm.result_stem("a/b", env, "bf16", when)


@pytest.mark.parametrize("precision, dtypes, platform, slug", [
    ("highest", ["f32"], "gpu", "highest"),        # f32-exact products, whatever the device
    (None, ["bf16", "bf16"], "gpu", "bf16"),       # every row in one low precision
    (None, ["f32", "bf16"], "gpu", "tf32"),        # f32 rows at the default precision: TF32 on an NVIDIA GPU
    ("default", ["f32"], "cpu", "default"),
    ("emulated", [], "cpu", "emulated"),           # a sweep over precisions names itself
])
def test_the_precision_a_result_is_named_by(precision, dtypes, platform, slug):
    assert bm.precision_slug(precision, dtypes, platform) == slug


def _committed_results() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (REPO / "benchmarks/results").iterdir()}


def test_bench_script_swiglu_small_writes_outside_the_repository_by_default():
    # the documented command, run from the checkout without --out, must not touch the committed results the
    # README's tables come from: it writes into the git-ignored runs/bench (these files are removed afterwards)
    before, out = _committed_results(), REPO / "runs/bench"
    earlier = set(out.glob("swiglu-*")) if out.exists() else set()
    proc = subprocess.run([sys.executable, "-m", "jaxgrad.bench", "swiglu", "--sizes", "small", "--repeats", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    written = sorted(set(out.glob("swiglu-*")) - earlier) if out.exists() else []
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _committed_results() == before
        assert bm.DEFAULT_RESULTS_DIR == "runs/bench" and f"wrote {out}/swiglu-" in proc.stdout
        assert [p.suffix for p in written] == [".json", ".txt"]
        _check_swiglu_small_result(written[0], proc.stdout)
    finally:
        for p in written:
            p.unlink()


def _check_swiglu_small_result(path: pathlib.Path, stdout: str) -> None:
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert {r["variant"] for r in rows} == {"pallas", "xla", "jax.grad(reference)"}
    assert {r["dtype"] for r in rows} == {"f32", "bf16"}
    assert all(r["median_ms"] > 0 and r["sizes"]["shape"] == [64, 96] for r in rows)
    assert all(r["bytes_moved"] == 8 * 64 * 96 * {"f32": 4, "bf16": 2}[r["dtype"]] for r in rows)
    assert path.with_suffix(".txt").exists() and "jax.grad(reference)" in stdout


def test_bench_script_lora_proj_small(tmp_path):
    # off a GPU the Mosaic GPU kernel is not a variant; the XLA forms and the base GEMM are, with the LoRA FLOPs
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "scripts/bench.py", "lora_proj", "--sizes", "small", "--repeats", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(next(out.glob("lora_proj-*.json")).read_text())["rows"]
    assert [r["variant"] for r in rows] == ["xla fold-b (block default)", "xla unfolded",
                                            "x W^T alone (cuBLAS, no LoRA)", "xla dX (block default)",
                                            "dY W alone (cuBLAS, no LoRA)"]
    assert [r["suite"] for r in rows] == ["lora_proj"] * 3 + ["lora_proj_dx"] * 2
    rows = rows[:3]
    m, k, n, r = 512, 256, 128, 16
    assert all(r_["flops"] == 2 * m * k * (n + r) + 2 * m * r * n and r_["median_ms"] > 0 for r_ in rows)


@pytest.mark.parametrize("script, option", [
    ("lora_profile", "--out"), ("nf4_matmul", "--out"), ("lora_curve_drift", "--out"),
    ("scripts/kan_fit.py", "--out-dir"), ("scripts/cnn_precision.py", "--out"), ("verify_false_alarms", "--out"),
    ("verify_detection_limits", "--out"), ("kan", "--out"),
])
def test_measurement_scripts_write_outside_the_repository_by_default(script, option):
    """Every suite, tool or script that writes results defaults to the git-ignored ``runs/bench``
    (``DEFAULT_RESULTS_DIR``): running it never changes the committed ``benchmarks/results`` the README's tables are
    made from; committing a result is an explicit ``--out benchmarks/results``."""
    cmd = [script] if script.startswith("scripts/") else ["-m", "jaxgrad.bench", script]
    proc = subprocess.run([sys.executable, *cmd, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert bm.DEFAULT_RESULTS_DIR == "runs/bench" and option in text
    assert f"default: {bm.DEFAULT_RESULTS_DIR}, git-ignored" in text or \
        f"default {bm.DEFAULT_RESULTS_DIR}/cnn-precision-" in text, text
    module = "__main__" if script == "kan" else script
    src = (REPO / (script if script.startswith("scripts/") else f"jaxgrad/bench/{module}.py")).read_text()
    assert 'default="benchmarks/results"' not in src and '/ "benchmarks/results"' not in src


def test_a_suite_stopped_by_sigterm_writes_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    import json
    import os
    import signal

    from jaxgrad.bench import __main__ as bench_main

    x = jnp.ones((8, 16), jnp.float32)

    def suite(sizes, precision, *, repeats, warmup):
        rows = bm.run_variants("swiglu", {"first": lambda x: x * 2}, (x,), {"n": 1}, warmup=0, repeats=1)
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` would, between two variants
        rows += bm.run_variants("swiglu", {"second": lambda x: x * 3}, (x,), {"n": 1}, warmup=0, repeats=1)
        return rows

    monkeypatch.setattr(bench_main, "suite_function", lambda name: suite)
    assert bench_main.main(["swiglu", "--out", str(tmp_path)]) == 1
    (path,) = tmp_path.glob("swiglu-*.json")
    data = json.loads(path.read_text())
    assert [r["variant"] for r in data["rows"]] == ["first"] and data["rows"][0]["median_ms"] > 0
    assert "stopped by SIGTERM" in path.with_suffix(".txt").read_text()
    assert "stopped by SIGTERM before its end" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_the_kan_suite_runs_only_the_sizes_named():
    from jaxgrad.bench.kan import KAN_CONFIGS, kan_configs

    assert kan_configs("full", None) == KAN_CONFIGS["full"]
    assert [(c["grid_size"], c["spline_order"]) for c in kan_configs("full", [(5, 5), (20, 3)])] == [(20, 3), (5, 5)]
