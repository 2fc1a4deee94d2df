"""The ``lora`` benchmark suite (``python -m jaxgrad.bench lora``, :mod:`jaxgrad.bench.lora_block`): the FLOP count
and floor at the issue's shape, and an end-to-end ``--sizes small`` run on this machine (each variant in its own
process; the torch variant skipped with a note where torch is missing), whose rows agree on the block's outputs."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from jaxgrad.bench import harness as bm
from jaxgrad.bench import lora_block as bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_flops_and_floor_at_the_benchmark_shape():
    s = bench.SIZES["full"]
    assert s == dict(batch=4, seq=2048, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632, r=16)
    f = bench.block_flops(**s)
    n, p = 4 * 2048, 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632  # tokens; q, o + k, v + gate, up, down
    pairs = 2048 * 2049 // 2  # causal (query, key) pairs per row and head
    io = (2048 + 2048) * 2 + (2048 + 1024) * 2 + (2048 + 5632) * 3  # sum of in + out over the 7 projections
    assert f["base_fwd"] == f["base_bwd_dx"] == 2 * n * p == 773_094_113_280
    assert f["attention_fwd"] == 4 * 4 * 16 * pairs * 128 and f["attention_bwd"] == 2 * f["attention_fwd"]
    assert f["lora_fwd"] == 2 * n * 16 * io and f["lora_bwd"] == 2 * f["lora_fwd"]
    assert f["total"] == 1_781_841_002_496  # ~1.78 TFLOP
    floor = bm.floor_ms(f["total"], bench.block_bytes(s), device_kind="NVIDIA H100 80GB HBM3", dtype="bf16",
                        precision="tf32")
    assert floor["bound"] == "compute" and floor["floor_ms"] == pytest.approx(1.8017, abs=1e-4)
    assert f["total"] / 790e12 * 1e3 == pytest.approx(2.2555, abs=1e-4)
    lines = bench.floor_lines("full")
    assert any("FLOPs = 1.782e+12" in line for line in lines) and any("1.802 ms" in line for line in lines)


def test_variant_names_and_a_failing_child_comes_back_as_a_row():
    on_gpu = bench.variant_names(True)
    assert on_gpu[:5] == ["custom_vjp cudnn", "jax.grad(reference) cudnn", bench.TORCH_VARIANT,
                          "custom_vjp+low-memory cudnn", "custom_vjp+unfolded cudnn"] and len(on_gpu) == 16
    assert "custom_vjp cudnn nf4 pallas" in on_gpu and bench._jax_spec("custom_vjp cudnn pallas")[0] == "pallas"
    assert "custom_vjp sdpa(xla)" in bench.variant_names(False)
    assert not any("pallas" in n or "mosaic" in n for n in bench.variant_names(False))  # compiled: GPU only
    assert bench._jax_spec("custom_vjp cudnn mosaic") == ("mosaic", "cudnn", False)
    assert bench._jax_spec("custom_vjp cudnn nf4 mosaic") == ("mosaic", "cudnn", True)
    assert bench._jax_spec("custom_vjp sdpa(xla) nf4") == ("xla", "sdpa:xla", True)
    assert bench._jax_spec("jax.grad(reference) cudnn") == ("reference", "cudnn", False)
    assert "custom_vjp pallas-attn" in on_gpu and bench._jax_spec("custom_vjp pallas-attn") == ("xla", "pallas", False)
    row = bench.run_in_fresh_process("no such variant", "small", repeats=1, warmup=0)
    assert row.median_ms is None and row.notes.startswith("error: child exited 1") and "unknown variant" in row.notes
    with pytest.raises(ValueError, match="selects none"):
        bench.suite_lora("small", "default", variants=["zzz"], say=lambda _: None)
    with pytest.raises(ValueError, match="selects none"):  # "=name" is exact: a prefix of a name selects nothing
        bench.suite_lora("small", "default", variants=["=custom_vjp"], say=lambda _: None)


def test_bench_lora_small_runs_here_each_variant_in_its_own_process(tmp_path):
    on_gpu = jax.default_backend() == "gpu"
    attn = "cudnn" if on_gpu else "sdpa(xla)"
    cmd = [sys.executable, "-m", "jaxgrad.bench", "lora", "--sizes", "small", "--repeats", "2",
           "--warmup", "1", "--out", str(tmp_path), "--variants", f"custom_vjp {attn},reference) xla,torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("lora-*-bf16-*.json")
    data = json.loads(path.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {f"custom_vjp {attn}", f"custom_vjp {attn} nf4", "jax.grad(reference) xla-attn",
                         bench.TORCH_VARIANT}
    env = data["environment"]
    assert " -m jaxgrad.bench lora --sizes small" in env["command"] and env["commit"] and env["dirty"]
    assert any(line.startswith("FLOPs = ") for line in env["suite_notes"])
    txt = path.with_suffix(".txt").read_text()
    assert txt.startswith("# device: ") and "# FLOPs = " in txt and "fresh process" in txt
    jax_rows = [r for name, r in rows.items() if name != bench.TORCH_VARIANT]
    for r in jax_rows:
        assert r["median_ms"] > 0 and r["compile_ms"] > 0 and r["flops"] == bench.block_flops(**bench.SIZES["small"])[
            "total"]
        assert (r["peak_bytes"] is not None) == on_gpu
    torch_row = rows[bench.TORCH_VARIANT]
    assert len(jax_rows) == 3
    if bench.torch_missing():
        assert torch_row["median_ms"] is None and torch_row["notes"].startswith("skipped: ")
        assert "not installed" in torch_row["notes"] and "skipped" in proc.stdout
    elif torch_row["median_ms"] is not None:  # the GPU machine: torch computes the same block
        jax_rows = [*jax_rows, torch_row]

    def norms(r):
        return {k: float(v) for k, v in re.findall(r"\|(\w+)\|=([0-9.e+-]+)", r["notes"])}

    # every variant computes the same block on the same inputs: their output and gradient norms agree to bf16
    # rounding (NF4: to its quantisation error)
    want = norms(rows["jax.grad(reference) xla-attn"])
    assert set(want) == {"y", "dx", "dA_q", "dB_down"}
    for r in jax_rows:
        tol = 0.05 if "nf4" in r["variant"] else 0.02
        got = norms(r)
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=tol), (r["variant"], k, got, want)


def test_the_seq_8192_row_has_the_full_block_widths_and_more_attention_flops():
    full, long = bench.SIZES["full"], bench.SIZES["long"]
    assert long["seq"] == 8192 and long["batch"] * long["seq"] == full["batch"] * full["seq"]
    assert {k: v for k, v in long.items() if k not in ("batch", "seq")} == \
        {k: v for k, v in full.items() if k not in ("batch", "seq")}
    f_full, f_long = (bench.block_flops(**bench.SIZES[s])["total"] for s in ("full", "long"))
    assert f_long > f_full  # the same projections, 4x the causal pairs per sequence
    assert any("seq=8192" in line for line in bench.floor_lines("long"))
