"""scripts/readme_tables.py: the figure tables of README.md and docs/*.md are generated from the committed results,
so a hand-edited or stale figure fails here."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "readme_tables.py"
spec = importlib.util.spec_from_file_location("readme_tables", SCRIPT)
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def test_the_committed_tables_match_the_committed_results():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "stale tables (run python scripts/readme_tables.py):\n" + out.stdout[-4000:] + out.stderr


def test_the_readme_and_docs_have_the_generated_tables():
    # the README's one table of measurements; every table of every size in docs/benchmarks.md; the verifier's
    # detection limits in docs/verify.md
    where = {"README.md": ("headline",), "docs/benchmarks.md": ("bench", "bench-full"), "docs/verify.md": ("detection",)}
    for path, names in where.items():
        text = (ROOT / path).read_text()
        for name in names:
            assert f"<!-- table:{name} begin -->" in text and f"<!-- table:{name} end -->" in text, (path, name)


def test_a_hand_edited_figure_fails_the_check(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    begin = text.index("<!-- table:headline begin -->")
    end = text.index("<!-- table:headline end -->")
    row = next(line for line in text[begin:end].splitlines() if " ms (`" in line)
    edited = row.replace(" ms (`", "1 ms (`", 1)  # "2.40 ms" -> "2.401 ms"
    readme.write_text(text.replace(row, edited, 1))
    assert readme.read_text() != text
    assert rt.main([str(readme), "--results", str(ROOT / "benchmarks" / "results"), "--check"]) == 1
    assert rt.main([str(readme), "--results", str(ROOT / "benchmarks" / "results")]) == 0  # regenerates
    assert rt.main([str(readme), "--results", str(ROOT / "benchmarks" / "results"), "--check"]) == 0
    assert edited not in readme.read_text()


def test_the_headline_rows_come_from_the_files_they_link():
    # every headline row's figures are the ones of the result file it links, read afresh here
    text = (ROOT / "README.md").read_text()
    body = text[text.index("<!-- table:headline begin -->"):text.index("<!-- table:headline end -->")]
    rows = [line for line in body.splitlines() if " ms (`" in line]
    assert len(rows) == len(rt.HEADLINE)
    for line, (what, suite, device, dtype, precision) in zip(rows, rt.HEADLINE):
        link = line.rsplit("](", 1)[1].split(")", 1)[0]
        data = json.loads((ROOT / link).read_text())
        assert data["rows"][0]["suite"] == suite and device in data["environment"]["device_kind"]
        ms = float(line.split(" | ")[2].split(" ms")[0])
        timed = [r["median_ms"] for r in data["rows"] if r["dtype"] == dtype and r.get("median_ms")
                 and r["sizes"] == data["rows"][0]["sizes"]]
        assert any(abs(ms - t) <= 0.005 * t for t in timed), (line, timed)


def _bench_row(variant, dtype, ms, floor=1.0, sizes=None, notes=""):
    return {"suite": "toy", "variant": variant, "sizes": sizes or {"n": 8}, "dtype": dtype, "precision": "default",
            "median_ms": ms, "p10_ms": ms and ms * 0.9, "p90_ms": ms and ms * 1.1, "floor_ms": floor,
            "achieved_fraction": ms and floor and floor / ms, "compiled_bytes": 2**20, "peak_bytes": 2 * 2**20, "notes": notes}


def _write_bench(results, name, when, precision, rows, device="Fake GPU"):
    env = {"device_kind": device, "platform": "gpu", "jax": "0.11.2", "jaxlib": "0.11.2", "python": "3.12.3",
           "datetime_utc": when, "matmul_precision": precision}
    (results / name).write_text(json.dumps({"environment": env, "rows": rows}))


@pytest.fixture
def fake_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    # an older default run, superseded by the later one
    _write_bench(results, "toy-fake-gpu-20260101-000000.json", "2026-01-01T00:00:00+00:00",
                 "default (TF32 for f32 dots/convs on NVIDIA GPUs)",
                 [_bench_row("ours", "f32", 9.0), _bench_row("jax.grad(reference)", "f32", 9.0)])
    _write_bench(results, "toy-fake-gpu-20260102-000000.json", "2026-01-02T00:00:00+00:00",
                 "default (TF32 for f32 dots/convs on NVIDIA GPUs)",
                 [_bench_row("ours", "f32", 2.0), _bench_row("jax.grad(reference)", "f32", 4.0),
                  _bench_row("torch autograd", "f32", 5.0, floor=None),
                  _bench_row("ours", "bf16", 1.0, floor=0.5), _bench_row("jax.grad(reference)", "bf16", 1.5, 0.5),
                  _bench_row("ours", "f32", 20.0, sizes={"n": 64}),
                  _bench_row("jax.grad(reference)", "f32", 30.0, sizes={"n": 64})])
    _write_bench(results, "toy-fake-gpu-20260103-000000.json", "2026-01-03T00:00:00+00:00", "highest",
                 [_bench_row("ours fast", "f32", None, notes="error: out of shared memory"),
                  _bench_row("ours", "f32", 6.0), _bench_row("jax.grad(reference)", "f32", 3.0)])
    det = {"environment": {"device_kind": "Fake GPU", "datetime_utc": "2026-01-04T00:00:00+00:00", "commit": "abcdef1234"},
           "summary": {"false_alarms": 0, "correct_runs": 8, "model_false_alarm_rate_per_leaf": 1e-4, "replicas": 16},
           "rows": [{"op": "dense", "precision": p, "size": 64, "entries": 63, "trials": 2, "kinks": False,
                     "smallest_scale_caught_in_all": lim, "caught_in_all": {"0.001": lim is not None, "0.3": lim is not None}}
                    for p, lim in (("f32", 1e-05), ("tf32", 0.001), ("f16", 0.001), ("bf16", None))]}
    (results / "verify-detection-fake-gpu-20260104-000000.json").write_text(json.dumps(det))
    (results / "notes.json").write_text("[1, 2]")  # not a result file: ignored
    return results


def _render(results, *names):
    text = "\n".join(f"<!-- table:{n} begin -->\nSTALE\n<!-- table:{n} end -->" for n in names)
    return rt.render(text, results, results.parent)


def test_bench_table_from_a_fake_results_dir(fake_results):
    text = _render(fake_results, "bench")
    assert "STALE" not in text and "toy-fake-gpu-20260101" not in text  # the later default run replaced it
    assert "toy-fake-gpu-20260102-000000.json" in text and "toy-fake-gpu-20260103-000000.json" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| variant"))
    assert header == "| variant | f32, TF32 (JAX default) | bf16 | f32, exact (highest) |"
    row = lambda name: next(line for line in lines if line.startswith(f"| {name} |"))  # noqa: E731
    assert row("`ours`") == "| `ours` | **2.00** (2.00x) | **1.00** (1.50x) | 6.00 (0.500x) |"
    assert row("`ours fast`") == "| `ours fast` | - | - | failed |"
    assert row("`jax.grad(reference)`") == "| `jax.grad(reference)` | 4.00 | 1.50 | **3.00** |"
    assert row("torch autograd") == "| torch autograd | 5.00 (0.800x) | - | - |"
    assert row("fastest jaxgrad vs PyTorch") == "| fastest jaxgrad vs PyTorch | 2.50x (`ours`) | - | - |"
    assert row("floor") == "| floor | 1.00 | 0.500 | 1.00 |"
    assert "n=64" not in text  # only the first (headline) size in the compact table


def test_bench_full_table_has_every_size(fake_results):
    text = _render(fake_results, "bench-full")
    assert "| n=64 | f32 | `ours` | 20.0 | 18.0-22.0 | 1.50x | 1.00 | 0.05 | 1 | 2 |" in text
    assert "| n=8 | f32 | `ours fast` | failed |" in text


def test_detection_table_from_a_fake_results_dir(fake_results):
    text = _render(fake_results, "detection")
    assert "| dense (W) | 63 | no | 1e-05 | 0.001 | 0.001 | > 0.3 |" in text
    assert "commit abcdef1" in text and "all 2 random trials" in text


def test_detection_table_prefers_a_complete_emulated_sweep(fake_results):
    # a newer sweep of every op wins over a partial one; a newer hardware-rounding spot check (--hardware: the
    # GPU's own TF32/bf16, two precisions only) never becomes the table
    def write(name, stamp, ops, hardware=False):
        rows = [{"op": op, "precision": "tf32", "size": 64, "entries": 64, "trials": 2, "kinks": False,
                 "hardware": hardware, "smallest_scale_caught_in_all": 0.002, "caught_in_all": {"0.002": True}}
                for op in ops]
        (fake_results / name).write_text(json.dumps({"environment": {"datetime_utc": stamp, "commit": "c0ffee1"},
                                                     "summary": {"replicas": 16, "model_false_alarm_rate_per_leaf": 1e-4},
                                                     "rows": rows}))

    write("verify-detection-fake-gpu-20260105-000000.json", "2026-01-05T00:00:00+00:00",
          ("dense", "conv_relu", "attention"))
    write("verify-detection-hardware-fake-gpu-20260106-000000.json", "2026-01-06T00:00:00+00:00",
          ("dense", "conv_relu", "attention"), hardware=True)
    write("verify-detection-fake-gpu-20260107-000000.json", "2026-01-07T00:00:00+00:00", ("dense",))
    text = _render(fake_results, "detection")
    assert "verify-detection-fake-gpu-20260105-000000.json" in text and "softmax attention (q)" in text


def test_detection_table_shows_the_cramer_rao_floor_and_larger_leaves(fake_results):
    # a cell carries the kernel's own floor in parentheses; leaves larger than the table's (a GPU sweep) get a second
    # table, the newest file per cell, never a hardware spot check; the complete sweep stays the main table
    def write(name, stamp, size, limit, hardware=False):
        rows = [{"op": "attention", "precision": "f16", "size": size, "entries": size, "trials": 20, "kinks": False,
                 "hardware": hardware, "smallest_scale_caught_in_all": limit, "caught_in_all": {str(limit): True},
                 "ideal_limit": limit / 4}]
        (fake_results / name).write_text(json.dumps({"environment": {"datetime_utc": stamp, "commit": "c0ffee1"},
                                                     "summary": {"replicas": 16}, "rows": rows}))

    complete = [{"op": op, "precision": "tf32", "size": 64, "entries": 64, "trials": 20, "kinks": False,
                 "smallest_scale_caught_in_all": 0.002, "caught_in_all": {"0.002": True}, "ideal_limit": 0.0004}
                for op in ("dense", "conv_relu", "attention")]
    (fake_results / "verify-detection-fake-cpu-20260107-000000.json").write_text(json.dumps(
        {"environment": {"datetime_utc": "2026-01-07T00:00:00+00:00", "commit": "c0ffee1"},
         "summary": {"replicas": 16, "model_false_alarm_rate_per_leaf": 1e-4}, "rows": complete}))
    write("verify-detection-fake-gpu-20260108-000000.json", "2026-01-08T00:00:00+00:00", 262144, 0.005)
    write("verify-detection-fake-gpu-20260109-000000.json", "2026-01-09T00:00:00+00:00", 262144, 0.002)
    write("verify-detection-hardware-fake-gpu-20260110-000000.json", "2026-01-10T00:00:00+00:00", 262144, 0.3, True)
    text = _render(fake_results, "detection")
    assert "| dense (W) | 64 | no | - | 0.002 (0.0004) | - | - |" in text  # the complete sweep is the table
    assert "Larger leaves" in text and "verify-detection-fake-gpu-20260109-000000.json" in text
    assert "| softmax attention (q) | 262144 | no | - | - | 0.002 (0.0005) | - |" in text
    assert "20260108" not in text and "0.3 (" not in text


def test_check_mode_and_unknown_tables(fake_results, tmp_path):
    md = tmp_path / "doc.md"
    md.write_text("# doc\n<!-- table:detection begin -->\n<!-- table:detection end -->\n")
    assert rt.main([str(md), "--results", str(fake_results), "--check"]) == 1
    assert rt.main([str(md), "--results", str(fake_results)]) == 0
    assert rt.main([str(md), "--results", str(fake_results), "--check"]) == 0
    md.write_text(md.read_text() + "<!-- table:nonsense begin -->\n<!-- table:nonsense end -->\n")
    with pytest.raises(SystemExit, match="unknown table 'nonsense'"):
        rt.main([str(md), "--results", str(fake_results), "--check"])


def test_empty_results_dir_says_so(tmp_path):
    text = _render(tmp_path, "bench", "detection")
    assert "no benchmark results" in text and "no `verify-detection-*.json`" in text


def test_one_suite_tables(fake_results):
    assert "toy-fake-gpu-20260102-000000.json" in _render(fake_results, "bench.toy")
    assert "no benchmark results" in _render(fake_results, "bench.kan")
    assert "toy-fake-gpu-20260103-000000.json" in _render(fake_results, "bench-full.toy")


def test_detection_table_takes_newer_cells_of_a_partial_sweep_with_as_many_trials(fake_results):
    # the verifier changed for one op: its newer sweep (same trials) replaces those cells and is named; a newer
    # sweep with fewer trials (a quick check) does not
    def write(name, stamp, ops, limit, trials):
        rows = [{"op": op, "precision": "tf32", "size": 64, "entries": 64, "trials": trials, "kinks": False,
                 "smallest_scale_caught_in_all": limit, "caught_in_all": {str(limit): True}} for op in ops]
        (fake_results / name).write_text(json.dumps({"environment": {"datetime_utc": stamp, "commit": "c0ffee1"},
                                                     "summary": {"replicas": 16, "false_alarms": 0, "correct_runs": 4,
                                                                 "model_false_alarm_rate_per_leaf": 1e-4},
                                                     "rows": rows}))

    write("verify-detection-fake-gpu-20260105-000000.json", "2026-01-05T00:00:00+00:00",
          ("dense", "conv_relu", "attention"), 0.002, 2)
    write("verify-detection-fake-gpu-20260108-000000.json", "2026-01-08T00:00:00+00:00", ("conv_relu",), 0.0003, 2)
    write("verify-detection-fake-gpu-20260109-000000.json", "2026-01-09T00:00:00+00:00", ("conv_relu",), 0.1, 1)
    text = _render(fake_results, "detection")
    assert "| conv3x3+ReLU (x) | 64 | no | - | 0.0003 | - | - |" in text
    assert "| dense (W) | 64 | no | - | 0.002 | - | - |" in text
    assert "re-measured since: [`verify-detection-fake-gpu-20260108-000000.json`]" in text
    assert "(`conv_relu` at 64)" in text
    assert "20260109" not in text and "0 false alarms in 8 leaves" in text


def test_headline_table_from_a_fake_results_dir(fake_results):
    spec = (("toy step", "toy", "Fake", "f32", "default"), ("toy step", "toy", "Fake", "bf16", "default"),
            ("absent", "nothing", "Fake", "f32", "default"))
    text = "\n".join(rt.table_headline(fake_results, spec))
    lines = text.splitlines()
    assert lines[2] == ("| measurement | device, precision | jaxgrad | vs `jax.grad` | vs PyTorch (same run) | "
                        "peak memory, jaxgrad / PyTorch | result |")
    # the later default run (with its PyTorch row) is the one shown; the fastest of ours against both peers
    assert ("| toy step | Fake GPU, f32 (TF32) | 2.00 ms (`ours`) | 2.00x | **2.50x** (torch autograd) | - | "
            "[2026-01-02](") in text
    assert "| toy step | Fake GPU, bf16 | 1.00 ms (`ours`) | 1.50x | - | - |" in text  # no PyTorch row for bf16
    assert "| absent | Fake, f32 (TF32) | no result | - | - | - | - |" in text  # never silently dropped


def test_headline_memory_only_for_variants_each_in_a_fresh_process(fake_results):
    rows = [_bench_row("ours", "bf16", 4.0, notes="fresh process; backend=mosaic"),
            _bench_row("jax.grad(reference)", "bf16", 8.0, notes="fresh process"),
            _bench_row("torch+peft", "bf16", 8.4, notes="fresh process; torch 2.11")]
    rows[0]["peak_bytes"], rows[2]["peak_bytes"] = 801 * 2**20, 1073 * 2**20
    for r in rows:
        r["suite"] = "blk"
    _write_bench(fake_results, "blk-fake-gpu-bf16-20260105-000000.json", "2026-01-05T00:00:00+00:00", "default",
                 rows, device="NVIDIA H100 80GB HBM3")
    text = "\n".join(rt.table_headline(fake_results, (("block", "blk", "H100", "bf16", "default"),)))
    assert "| block | H100, bf16 | 4.00 ms (`ours`) | 2.00x | **2.10x** (torch+peft) | 801 / 1073 MiB |" in text
    assert "/blk-fake-gpu-bf16-20260105-000000.json)" in text
    # the same variants timed one after the other in one process: the process-wide peak is no one variant's own
    for r in rows:
        r["notes"] = ""
    _write_bench(fake_results, "blk-fake-gpu-bf16-20260106-000000.json", "2026-01-06T00:00:00+00:00", "default",
                 rows, device="NVIDIA H100 80GB HBM3")
    text = "\n".join(rt.table_headline(fake_results, (("block", "blk", "H100", "bf16", "default"),)))
    assert "| **2.10x** (torch+peft) | - |" in text and "20260106" in text


def test_tables_find_their_files_by_content_not_by_name(fake_results):
    # a result renamed keeps its place in the tables; only its link changes
    (fake_results / "toy-fake-gpu-20260102-000000.json").rename(fake_results / "anything-else.json")
    assert "anything-else.json" in _render(fake_results, "bench") and "2.00 ms (`ours`)" in "\n".join(
        rt.table_headline(fake_results, (("toy", "toy", "Fake", "f32", "default"),)))
    fit = {"task": "toy fit", "dtype": "float64", "device": "cpu:0", "seed": 1, "jax": "0.11.2",
           "results": [{"G": 3, "train_rmse": 0.0165, "test_rmse": 0.0179}]}
    (fake_results / "kan-fit-cpu-f64-20260101-000000.json").write_text(json.dumps(fit))
    text = _render(fake_results, "kan-fit")
    assert "kan-fit-cpu-f64-20260101-000000.json" in text and "| 3 | 1.65e-2 / 1.79e-2 | - |" in text


def test_short_device_names():
    assert rt._short_device("NVIDIA H100 80GB HBM3") == "H100"
    assert rt._short_device("NVIDIA H200") == "H200"
    assert rt._short_device("cpu") == "cpu"


def test_the_real_size_table_reads_each_models_latest_full_depth_run(tmp_path):
    """Rows come from the llama_real files' own metrics; the ratios are the same run's peers; a model without a full-
    depth file reads "no result"; a tiny or shortened run is never shown."""
    src = sorted(ROOT.glob("benchmarks/results/llama_real_8b-*.json"))[-1]
    data = json.loads(src.read_text())
    (tmp_path / src.name).write_text(json.dumps(data))
    short = json.loads(src.read_text())
    short["environment"]["llama_real"]["spec"]["layers"] = 2
    short["environment"]["datetime_utc"] = "2099-01-01T00:00:00+00:00"
    (tmp_path / ("llama_real_8b-later" + src.name[len("llama_real_8b"):])).write_text(json.dumps(short))
    lines = rt.table_real_size(tmp_path)
    v = data["environment"]["llama_real"]["variants"]
    ours = next(line for line in lines if "| **jaxgrad** |" in line and "8B LoRA" in line)
    assert f"{v['jaxgrad']['tokens_per_s']:,.0f}" in ours
    ratio = v["jaxgrad"]["tokens_per_s"] / v["transformers+PEFT"]["tokens_per_s"]
    assert f"| {ratio:.2f}x |" in ours
    assert any("Llama-3.2-1B LoRA | no result" in line for line in lines)
    assert src.name in lines[0] and "later" not in lines[0]


def test_a_variant_missing_from_the_newest_run_comes_from_the_run_that_measured_it_with_its_date(tmp_path):
    src = sorted(ROOT.glob("benchmarks/results/llama_real_8b-*.json"))[-1]
    old = json.loads(src.read_text())
    old["environment"]["datetime_utc"] = "2026-01-01T00:00:00+00:00"
    (tmp_path / "llama_real_8b-dev-bf16-20260101-000000.json").write_text(json.dumps(old))
    new = json.loads(src.read_text())
    new["environment"]["datetime_utc"] = "2026-02-01T00:00:00+00:00"
    variants = new["environment"]["llama_real"]["variants"]
    del variants["jaxgrad"]  # the newest run re-measured everything but the default variant, at other peers
    peft = variants["transformers+PEFT"]
    peft["tokens_per_s"] *= 2
    (tmp_path / "llama_real_8b-dev-bf16-20260201-000000.json").write_text(json.dumps(new))
    lines = rt.table_real_size(tmp_path)
    ours = next(line for line in lines if "| **jaxgrad** (2026-01-01) |" in line)
    v = old["environment"]["llama_real"]["variants"]
    assert f"| {v['jaxgrad']['tokens_per_s'] / v['transformers+PEFT']['tokens_per_s']:.2f}x |" in ours  # its own peers
    assert "20260101-000000.json" in lines[0] and "20260201-000000.json" in lines[0]
    assert sum("transformers+PEFT |" in line and "(2026-" not in line for line in lines) == 1  # the newest PEFT row


def _scaling_file(path, rows):
    import json

    path.write_text(json.dumps({"environment": {"scaling": {"rows": rows}}, "rows": []}))


def _scaling_row(devices, layout, ms, scaling, status="measured"):
    return {"workload": "llama-8b-qlora", "devices": devices, "layout": layout, "status": status, "spec": {"batch": 2},
            "throughput": 8192 * devices / ms * 1e3 if ms else None, "unit": "tokens", "scaling_factor": scaling,
            "efficiency": scaling / devices, "peak_bytes_max": 2**30, "base_bytes_per_device": 2**30 / devices,
            "base_bytes_ratio": 1 / devices, "median_ms": ms,
            "profile": {"mean": {"all_gather": 1.0, "all_reduce": 2.0, "exposed_collective": 0.5, "compute": ms - 5}}}


def test_the_scaling_table_takes_each_row_from_the_newest_run_that_measured_it(tmp_path):
    assert rt.table_scaling(tmp_path) == ["No scaling run is committed yet."]
    old = tmp_path / "scaling-gpu-tf32-20261127-010000.json"
    new = tmp_path / "scaling-gpu-tf32-20261127-020000.json"
    _scaling_file(old, [_scaling_row(1, "data", 700.0, 1.0), _scaling_row(2, "fsdp", 720.0, 1.94)])
    _scaling_file(new, [_scaling_row(1, "data", 550.0, 1.0), _scaling_row(2, "fsdp", 0.0, 0.0, status="timed out")])
    rows = [line for line in rt.table_scaling(tmp_path) if line.startswith("| llama")]
    assert len(rows) == 2
    assert "550.0" in rows[0] and "2026-11-27 02:00" in rows[0]  # the newer run's 1-GPU row
    assert "720.0" in rows[1] and "1.940" in rows[1] and "2026-11-27 01:00" in rows[1]  # the only measured fsdp row


def test_a_scaling_row_without_a_one_gpu_row_shows_no_factor_and_the_bench_tables_leave_scaling_out(tmp_path):
    # a base too large for one GPU: the 1-GPU row ran out of memory, so the 4-GPU row has nothing to scale by
    row = dict(_scaling_row(4, "fsdp", 3900.0, 1.0), workload="llama-70b-shapes", scaling_factor=None,
               efficiency=None)
    path = tmp_path / "scaling-gpu-bf16-20261127-191116.json"
    oom = dict(_scaling_row(1, "data", 0.0, 1.0, status="out of memory"), workload="llama-70b-shapes",
               throughput=None, scaling_factor=None, efficiency=None, median_ms=None)
    _scaling_file(path, [oom, row])
    body = json.loads(path.read_text())
    body["rows"] = [{"suite": "scaling", "variant": "llama-70b-shapes N=4 fsdp", "median_ms": 3900.0, "sizes": {}}]
    path.write_text(json.dumps(body))
    rows = [line for line in rt.table_scaling(tmp_path) if line.startswith("| llama-70b")]
    assert len(rows) == 1 and "| 4 | fsdp | 2 |" in rows[0] and "| - | - |" in rows[0]
    assert rt.load_bench(tmp_path) and rt.latest_bench(tmp_path) == {}  # its own table, not the per-suite ones
    assert rt.latest_bench(tmp_path, "scaling")
