"""The ``scaling`` benchmark (``python -m jaxgrad.bench scaling``, :mod:`jaxgrad.bench.scaling`): weak scaling on 1,
2 and 4 devices through the engine's own paths. Here on 4 fake CPU devices at tiny widths: the rows, the scaling
arithmetic, the fsdp base split 1/N, the collective times read from a real profile, a row that does not fit recorded
as such, the budget, and the result file's header."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxgrad.bench import scaling as sc
from jaxgrad.bench import scaling_profile as sp
from jaxgrad.bench.scaling_run import INJECT_OOM

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, inject: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               **{INJECT_OOM: inject})
    proc = subprocess.run([sys.executable, "-m", "jaxgrad.bench", "scaling", "--tiny", "--repeats", "2", "--warmup",
                           "0", "--profile-steps", "1", "--out", str(tmp_path), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    files = sorted(tmp_path.glob("scaling-*.json"))
    return proc, (json.loads(files[-1].read_text()) if files else {})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """8B QLoRA and the 70B shapes (tiny widths) and the CNN on 1, 2 and 4 fake devices, in this process's child;
    the 70B shapes' replicated 1-device row fails as out of memory."""
    out = tmp_path_factory.mktemp("scaling")
    return (out, *_run(out, "--same-process", "--workloads", "8b,70b,cnn", inject="llama-70b-shapes:1:data"))


def _rows(result) -> dict:
    return {(r["workload"], r["devices"], r["layout"]): r for r in result["environment"]["scaling"]["rows"]}


def test_rows_for_one_two_and_four_devices_and_both_layouts(tiny_run):
    _, proc, result = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(result)
    assert set(rows) == {("llama-8b-qlora", 1, "data"), ("llama-8b-qlora", 2, "data"), ("llama-8b-qlora", 2, "fsdp"),
                         ("llama-8b-qlora", 4, "data"), ("llama-8b-qlora", 4, "fsdp"),
                         ("llama-70b-shapes", 1, "data"), ("llama-70b-shapes", 4, "fsdp"),
                         ("cnn", 1, "data"), ("cnn", 2, "data"), ("cnn", 4, "data")}
    for key, r in rows.items():
        if key != ("llama-70b-shapes", 1, "data"):
            assert r["status"] == "measured", (key, r.get("reason"))
            assert r["median_ms"] > 0 and len(r["losses"]) >= 1
    # weak scaling: the global batch is N per-device micro-batches
    one, four = rows["llama-8b-qlora", 1, "data"], rows["llama-8b-qlora", 4, "fsdp"]
    assert four["items_per_step"] == 4 * one["items_per_step"] == 4 * one["spec"]["batch"] * one["spec"]["seq"]


def test_scaling_factor_and_efficiency_are_against_the_one_device_row(tiny_run):
    rows = _rows(tiny_run[2])
    for (w, n, _), r in rows.items():
        if r["status"] != "measured" or (w, 1, "data") not in rows or rows[w, 1, "data"]["status"] != "measured":
            continue
        expected = r["throughput"] / rows[w, 1, "data"]["throughput"]
        assert r["scaling_factor"] == pytest.approx(expected) and r["efficiency"] == pytest.approx(expected / n)
        assert r["throughput"] == pytest.approx(r["items_per_step"] / (r["median_ms"] * 1e-3))
    assert rows["llama-70b-shapes", 4, "fsdp"]["scaling_factor"] is None  # its 1-device row did not fit


def test_fsdp_holds_one_nth_of_the_base_per_device_and_data_all_of_it(tiny_run):
    rows = _rows(tiny_run[2])
    whole = rows["llama-8b-qlora", 1, "data"]["base_bytes_per_device"]
    for n in (2, 4):
        fsdp, data = rows["llama-8b-qlora", n, "fsdp"], rows["llama-8b-qlora", n, "data"]
        assert fsdp["base_bytes_whole"] == data["base_bytes_per_device"] == whole
        assert 1 / n <= fsdp["base_bytes_ratio"] <= sc.BASE_BYTES_SLACK / n
    targets = tiny_run[2]["environment"]["scaling"]["targets"]
    split = [t for t in targets if "base bytes" in t["target"]]
    assert {t["row"] for t in split} == {"llama-8b-qlora N=2 fsdp", "llama-8b-qlora N=4 fsdp",
                                         "llama-70b-shapes N=4 fsdp"}
    assert all(t["met"] is True for t in split)


def test_the_profile_times_the_collectives_each_layout_uses(tiny_run):
    rows = _rows(tiny_run[2])
    fsdp = rows["llama-8b-qlora", 4, "fsdp"]["profile"]["mean"]
    data = rows["llama-8b-qlora", 4, "data"]["profile"]["mean"]
    assert fsdp["all_gather"] > 0 and fsdp["compute"] > 0  # the layers' weights gathered
    assert data["all_gather"] == 0 and data["all_reduce"] > 0  # replicated base: only the gradient sums
    assert 0 <= fsdp["exposed_collective"] <= fsdp["collective"]


def test_a_row_that_does_not_fit_is_a_result(tiny_run):
    out, proc, result = tiny_run
    r = _rows(result)["llama-70b-shapes", 1, "data"]
    assert r["status"] == "out of memory" and r["median_ms"] is None
    assert "out of memory" in r["reason"] and "GiB, computed" in r["reason"]
    printed = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("llama-70b-shapes")]
    assert ["llama-70b-shapes", "1", "data"] in [ln[:3] for ln in printed]  # in the printed table, not a crash
    assert proc.returncode == 0


def test_result_file_has_the_house_header_and_the_printed_targets(tiny_run):
    out, proc, result = tiny_run
    (path,) = out.glob("scaling-*.json")
    assert path.name.startswith("scaling-cpu-") and path.with_suffix(".txt").exists()
    env = result["environment"]
    assert {"device_kind", "jax", "commit", "dirty", "command"} <= set(env)
    assert "scaling" in env["command"] and "--tiny" in env["command"]
    assert [r["variant"] for r in result["rows"]][:2] == ["llama-8b-qlora N=1 data", "llama-8b-qlora N=2 data"]
    verdicts = [ln for ln in proc.stdout.splitlines() if ln.startswith("# target: 8B QLoRA scaling")]
    assert len(verdicts) == 4 and all(ln.endswith((": met", ": not met")) for ln in verdicts)


def test_rows_run_in_fresh_processes(tmp_path):
    proc, result = _run(tmp_path, "--workloads", "cnn", "--devices", "1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(result)
    assert set(rows) == {("cnn", 1, "data"), ("cnn", 2, "data")}
    assert all(r["status"] == "measured" for r in rows.values())


def test_efficiency_arithmetic_and_targets_from_rows():
    spec = {"batch": 2, "seq": 8}
    rows = [dict(workload="llama-8b-qlora", family="lora", devices=n, layout=lay, spec=spec, status="measured",
                 throughput=t, base_bytes_per_device=b, base_bytes_whole=1000)
            for n, lay, t, b in [(1, "data", 100.0, 1000), (2, "fsdp", 195.0, 501), (4, "fsdp", 370.0, 260)]]
    d = {r["devices"]: r for r in sc.derive(rows)}
    assert d[2]["scaling_factor"] == pytest.approx(1.95) and d[2]["efficiency"] == pytest.approx(0.975)
    assert d[4]["scaling_factor"] == pytest.approx(3.7) and d[4]["efficiency"] == pytest.approx(0.925)
    met = {(t["row"], "scaling" in t["target"]): t["met"] for t in sc.evaluate_targets(list(d.values()))}
    assert met["llama-8b-qlora N=2 fsdp", True] is True and met["llama-8b-qlora N=4 fsdp", True] is False
    assert met["llama-8b-qlora N=2 fsdp", False] is True and met["llama-8b-qlora N=4 fsdp", False] is False


def test_rows_that_would_not_start_in_budget_or_lack_devices_are_skipped():
    rows = sc.plan_rows(["kan"], [1, 2], ["data"], batch=None, seq=None, layers=None, tiny=True, repeats=1,
                        warmup=0, profile_steps=0)
    out = sc.run_rows(rows, budget_s=1.0, same_process=True, say=lambda _: None)
    assert [r["status"] for r in out] == ["skipped", "skipped"]
    assert all("budget" in r["reason"] for r in out)
    out = sc.run_rows(rows, budget_s=100.0, same_process=True, available=1, say=lambda _: None)
    assert out[1]["status"] == "skipped" and "2 devices asked, 1 here" in out[1]["reason"]


def test_collective_time_and_exposed_time_from_intervals():
    assert sp.union_length([(0, 4), (2, 6), (10, 11)]) == 7
    assert sp.exposed_length([(0, 10)], [(2, 4), (6, 7)]) == 7  # 10 of collective, 3 hidden under compute
    assert sp.kind_of("all-gather-start.3", "") == "all_gather"
    assert sp.kind_of("", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert sp.kind_of("all-reduce.1", "") == "all_reduce" and sp.kind_of("fusion.2", "gemm") == "compute"


def test_fsdp_kept_splits_the_base_and_gathers_less_than_fsdp(tmp_path):
    proc, result = _run(tmp_path, "--same-process", "--workloads", "8b", "--devices", "1,4", "--layouts",
                        "fsdp,fsdp-kept")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(result)
    assert set(rows) == {("llama-8b-qlora", 1, "data"), ("llama-8b-qlora", 4, "fsdp"),
                         ("llama-8b-qlora", 4, "fsdp-kept")}
    kept, fsdp = rows["llama-8b-qlora", 4, "fsdp-kept"], rows["llama-8b-qlora", 4, "fsdp"]
    assert kept["status"] == "measured" and 1 / 4 <= kept["base_bytes_ratio"] <= sc.BASE_BYTES_SLACK / 4
    assert "gathered weights kept for the backward" in json.dumps(kept)
    assert "gathered weights kept" not in json.dumps(fsdp)
    assert kept["losses"][0] == pytest.approx(fsdp["losses"][0], rel=1e-5)  # the same step


def test_bad_options_are_refused_by_name(tmp_path):
    for args, word in ((["--layouts", "tp"], "--layouts"), (["--workloads", "gpt"], "--workloads"),
                       (["--devices", "0"], "--devices"), (["--workloads", "8b", "--layers", "4"], "--layers")):
        proc = subprocess.run([sys.executable, "-m", "jaxgrad.bench", "scaling", *args, "--out", str(tmp_path)],
                              capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert proc.returncode == 2 and word in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match="--layers"):
        sc.lora_spec("llama-8b-qlora", batch=2, seq=None, layers=4, tiny=False)


def test_a_row_can_run_as_one_process_per_device_and_trains_as_one_process_does(tmp_path):
    # 8B QLoRA (tiny widths) fsdp on 2 devices: 2 processes of one device each, joined by jax.distributed over
    # loopback, against one process driving 2 devices; the same losses (float32; the cross-device sums in another
    # order), the base split 1/2, each process's device memory in the row
    args = ("--workloads", "8b", "--devices", "1,2", "--layouts", "fsdp")
    procs, per_device = _run(tmp_path / "procs", *args, "--process-per-device")
    one, single = _run(tmp_path / "one", *args)
    for proc in (procs, one):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    split, whole = (_rows(r)["llama-8b-qlora", 2, "fsdp"] for r in (per_device, single))
    assert split["status"] == whole["status"] == "measured" and (split["processes"], whole["processes"]) == (2, 1)
    assert "(2 processes)" in procs.stdout and "2 processes of one device each" in " ".join(split["notes"])
    assert len(split["peak_bytes_per_device"]) == 2 and split["base_bytes_ratio"] == whole["base_bytes_ratio"]
    assert split["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    assert _rows(per_device)["llama-8b-qlora", 1, "data"]["processes"] == 1


def test_one_process_per_device_is_each_processs_own_device_and_coordinator():
    base = {"CUDA_VISIBLE_DEVICES": "2,3", "JAX_PROCESS_ID": "7", "PATH": "/bin"}
    e = sc.process_env(base, 1, 2, 1234)
    assert (e["CUDA_VISIBLE_DEVICES"], e["JAX_PROCESS_ID"], e["JAX_NUM_PROCESSES"]) == ("3", "1", "2")
    assert e["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234" and e["PATH"] == "/bin"
    assert sc.process_env({"PATH": "/bin"}, 3, 4, 1)["CUDA_VISIBLE_DEVICES"] == "3"
    cpu = sc.process_env({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --x=1"},
                         0, 2, 1)
    assert cpu["XLA_FLAGS"] == "--x=1 --xla_force_host_platform_device_count=1" and "CUDA_VISIBLE_DEVICES" not in cpu
