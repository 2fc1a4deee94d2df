"""The ``lm_head`` benchmark suite (``python -m jaxgrad.bench lm_head``, :mod:`jaxgrad.bench.lm_head`): the FLOP
floor at the real shape, the variants it runs, that the steps it times compute the same loss and gradients, and an
end-to-end ``--sizes small`` run here (each variant in its own process, the torch peers skipped with their reason
where torch or liger_kernel is missing), whose fused rows hold less memory than the plain one."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.bench import harness as bm, lm_head as bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_floor_counts_two_products_and_a_third_with_the_head_gradient():
    one_b, eight_b = bench.SHAPES["full"]["1B"], bench.SHAPES["full"]["8B"]
    assert (one_b["batch"] * one_b["seq"], one_b["hidden"], one_b["vocab"], one_b["tied"]) == (8192, 2048, 128256, True)
    assert (eight_b["hidden"], eight_b["vocab"], eight_b["tied"]) == (4096, 128256, False)
    product = 2 * 8192 * 128256 * 4096  # one [8192, 4096] x [4096, 128256] matmul
    assert bench.head_flops(eight_b, head_grad=False) == 2 * product == 17_214_228_922_368
    assert bench.head_flops(eight_b, head_grad=True) == 3 * product
    assert bench.head_flops(one_b, head_grad=False) == product
    lines = bench.floor_lines("full", head_grad=False)
    assert any(line.startswith("1B: ") and "8.703 ms" in line for line in lines)
    assert any(line.startswith("8B: ") and "17.41 ms" in line and "7.83 GiB" in line for line in lines)
    assert any("26.11 ms" in line for line in bench.floor_lines("full", head_grad=True))


def test_the_variants_are_the_fused_chunkings_the_plain_loss_and_the_torch_peers_per_head():
    names = bench.variant_names("full")
    for model in ("1B", "8B"):
        fused = [n for n in names if n.startswith(f"{model} jaxgrad fused ct")]
        assert sorted(fused) == sorted(f"{model} jaxgrad fused ct={ct} cv={cv} bf16 dh" for ct in (512, 1024, 2048)
                                       for cv in ("all", 32768))
        # the library's default chunking first, then what it is compared with (a spent budget cuts the tail)
        assert names[names.index(f"{model} jaxgrad fused ct=1024 cv=all bf16 dh") + 1:][:4] == [
            f"{model} jax.grad plain bf16 dh", f"{model} torch F.linear+F.cross_entropy bf16 dh",
            f"{model} torch liger FLCE bf16 dh", f"{model} jaxgrad fused recompute ct=1024 cv=all bf16 dh"]
    assert len(names) == 2 * 12 and all(n.endswith(" bf16 dh") for n in names)
    for model in ("1B", "8B"):  # the frozen head's products alone follow its recompute row, the Mosaic kernel them
        assert names.index(f"{model} products only ct=1024 bf16 dh") == names.index(
            f"{model} jaxgrad fused recompute ct=1024 cv=all bf16 dh") + 1
        assert names.index(f"{model} jaxgrad fused mosaic ct=1024 bf16 dh") == names.index(
            f"{model} products only ct=1024 bf16 dh") + 1
    with_dw = bench.variant_names("full", head_grad=True)
    assert len(with_dw) == 2 * 9 and all(n.endswith(" bf16 dh+dW") for n in with_dw)
    v = bench.variant("8B jaxgrad fused ct=512 cv=32768 bf16 dh+dW", "full")
    assert (v.model, v.impl, v.dtype, v.head_grad, v.chunk_tokens, v.chunk_vocab) == (
        "8B", bench.FUSED, "bf16", True, 512, 32768)
    assert bench.variant("1B jaxgrad fused ct=1024 cv=all f32 dh", "full").chunk_vocab is None
    with pytest.raises(ValueError, match="unknown variant"):
        bench.variant("8B jaxgrad fused ct=100 cv=all bf16 dh", "full")
    with pytest.raises(ValueError, match="selects none"):
        bench.suite_lm_head("small", "default", variants=["zzz"], say=lambda _: None)
    with pytest.raises(ValueError, match="--sizes must be one of"):
        bench.suite_lm_head("long", "default", say=lambda _: None)


def test_the_inputs_are_drawn_block_by_block_into_every_row():
    x = bench._normal_rows(jax.random.key(0), (1000, 64), jnp.bfloat16, 0.125, block_rows=384)  # 3 blocks, last clamped
    assert x.shape == (1000, 64) and x.dtype == jnp.bfloat16
    x = np.asarray(x, np.float32)
    assert np.all(np.abs(x).max(axis=1) > 0)  # no row left at zero
    assert abs(x.mean()) < 0.01 and x.std() == pytest.approx(0.125, rel=0.02)
    h, w, labels = bench.jax_inputs(bench.SHAPES["small"]["8B"], "bf16")
    assert (h.shape, w.shape, labels.shape) == ((2, 64, 64), (1024, 64), (2, 64))
    assert float(jnp.std(w.astype(jnp.float32))) == pytest.approx(64 ** -0.5, rel=0.05)
    assert 0 <= int(labels.min()) and int(labels.max()) < 1024


@pytest.mark.parametrize("impl, head_grad", [(bench.FUSED, False), (bench.FUSED_RECOMPUTE, False),
                                             (bench.FUSED, True)])
def test_the_timed_steps_compute_the_same_loss_and_gradients_and_the_fused_one_holds_less(impl, head_grad):
    s = bench.SHAPES["small"]["8B"]
    args = bench.jax_inputs(s, "f32")
    fused = bench.Variant("8B", impl, "f32", head_grad, 16, 256)
    plain = bench.Variant("8B", bench.PLAIN, "f32", head_grad)
    (loss_f, grads_f), (loss_p, grads_p) = (jax.jit(bench.jax_step(v))(*args) for v in (fused, plain))
    np.testing.assert_allclose(loss_f, loss_p, rtol=1e-5)
    grads_f, grads_p = (g if head_grad else (g,) for g in (grads_f, grads_p))
    assert [g.shape for g in grads_f] == [args[0].shape] + ([args[1].shape] if head_grad else [])
    for a, b in zip(grads_f, grads_p):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
    mem_f, mem_p = (bm.compiled_memory(bm.compile_fn(bench.jax_step(v), *args)) for v in (fused, plain))
    assert mem_f["temp_bytes"] < mem_p["temp_bytes"] / 4  # [16, 256] blocks, not [128, 1024] logits


def test_the_products_only_row_is_the_fused_heads_two_products_without_the_softmax():
    s = bench.SHAPES["small"]["8B"]
    h, w, labels = bench.jax_inputs(s, "f32")
    total, dh = jax.jit(bench.jax_step(bench.Variant("8B", bench.PRODUCTS, "f32", False, 16)))(h, w, labels)
    z = np.einsum("bth,vh->btv", np.asarray(h, np.float64), np.asarray(w, np.float64))
    want = np.einsum("btv,vh->bth", z, np.asarray(w, np.float64))
    assert dh.shape == h.shape and dh.dtype == h.dtype
    np.testing.assert_allclose(np.asarray(dh), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert float(total) == pytest.approx(want.sum(), rel=1e-3, abs=1e-3 * np.abs(want).sum())
    with pytest.raises(ValueError, match="must divide the 128 token rows"):
        jax.jit(bench.products_step(48))(h, w, labels)
    rows = [bm.Row(suite="lm_head", variant=n, sizes={}, dtype="bf16", precision="default", median_ms=ms)
            for n, ms in (("8B jaxgrad fused ct=16 cv=all bf16 dh", 10.0), ("8B products only ct=16 bf16 dh", 8.0))]
    (line,) = [ln for ln in bench.summary_lines(rows, "small") if ln.startswith("8B products only")]
    assert "takes 2.000 ms more (20% of its time" in line


def test_the_mosaic_row_is_skipped_with_its_reason_off_hopper_and_compared_with_the_xla_fused_row():
    name = "8B jaxgrad fused mosaic ct=16 bf16 dh"
    assert name in bench.variant_names("small")
    if bench.mosaic_unavailable() is not None:
        row = bench.run_jax_variant(name, "small", repeats=1, warmup=0)
        assert row.median_ms is None and row.notes.startswith("skipped: Mosaic GPU's wgmma needs a Hopper GPU")
    rows = [bm.Row(suite="lm_head", variant=n, sizes={}, dtype="bf16", precision="default", median_ms=ms)
            for n, ms in (("8B jaxgrad fused ct=16 cv=all bf16 dh", 10.0), (name, 9.0))]
    (line,) = [ln for ln in bench.summary_lines(rows, "small") if ln.startswith(name)]
    assert "0.900x the XLA fused loss's time at this chunking" in line


def _run_small(tmp_path, variants):
    cmd = [sys.executable, "-m", "jaxgrad.bench", "lm_head", "--sizes", "small", "--repeats", "2", "--warmup", "1",
           "--out", str(tmp_path), "--variants", ",".join(variants)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_lm_head_small_runs_here_each_variant_in_its_own_process(tmp_path):
    fused = ["8B jaxgrad fused ct=16 cv=all bf16 dh", "8B jaxgrad fused ct=8 cv=256 bf16 dh"]
    plain, torch_plain, liger = ("8B jax.grad plain bf16 dh", "8B torch F.linear+F.cross_entropy bf16 dh",
                                 "8B torch liger FLCE bf16 dh")
    proc = _run_small(tmp_path, [f"={n}" for n in (*fused, plain, torch_plain, liger)])
    (path,) = tmp_path.glob("lm_head-*-bf16-*.json")
    assert re.fullmatch(r"lm_head-[a-z0-9-]+-bf16-\d{8}-\d{6}\.json", path.name)
    data = json.loads(path.read_text())
    env, rows = data["environment"], {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {*fused, plain, torch_plain, liger}
    assert " -m jaxgrad.bench lm_head --sizes small" in env["command"] and env["commit"] and env["dirty"]
    assert env["device_kind"] and env["jax"] and any(line.startswith("8B: ") and "FLOPs = " in line
                                                    for line in env["suite_notes"])
    txt = path.with_suffix(".txt").read_text()
    assert txt.startswith("# device: ") and "# 8B: " in txt and "fresh process" in txt
    s = bench.SHAPES["small"]["8B"]
    on_gpu = jax.default_backend() == "gpu"
    for name in (*fused, plain):
        r = rows[name]
        assert r["suite"] == "lm_head" and r["dtype"] == "bf16" and r["median_ms"] > 0 and r["compile_ms"] > 0
        assert {k: r["sizes"][k] for k in s} == s and r["sizes"]["head_grad"] is False
        assert r["flops"] == bench.head_flops(s, False) and (r["peak_bytes"] is not None) == on_gpu
        assert r["compiled_bytes"] > 0 and any(line.startswith(f"{name}: ") for line in env["suite_notes"])
    assert rows[fused[1]]["sizes"]["chunk_tokens"] == 8 and rows[fused[1]]["sizes"]["chunk_vocab"] == 256

    def memory(r):  # the step's own bytes on every platform (a device high-water mark also holds what the
        return r["compiled_bytes"]  # compiler allocated for itself, which at these tiny shapes may dominate)

    def loss_per_token(r):
        return float(re.search(r"loss/token=([0-9.e+-]+)", r["notes"]).group(1))

    for name in fused:
        assert memory(rows[name]) < memory(rows[plain]), (name, memory(rows[name]), memory(rows[plain]))
        # the same inputs: the plain loss differs only by its logits' rounding to bf16
        assert loss_per_token(rows[name]) == pytest.approx(loss_per_token(rows[plain]), rel=1e-3)
    assert loss_per_token(rows[plain]) == pytest.approx(np.log(s["vocab"]) + 0.5, rel=0.05)
    for name, needs in ((torch_plain, "torch"), (liger, "liger_kernel")):
        r = rows[name]
        if r["median_ms"] is None:  # a peer that cannot run here is a skipped row with its reason, not a failure
            assert r["notes"].startswith("skipped: ") and "skipped" in proc.stdout, r["notes"]
            why = bench.torch_missing(bench.variant(name, "small").impl)
            assert r["notes"] == why if why else "no CUDA device" in r["notes"] or needs in r["notes"]
        else:  # its own random inputs, the same distributions: the same loss per token, statistically
            assert loss_per_token(r) == pytest.approx(loss_per_token(rows[plain]), rel=0.05)
    if bench.torch_missing(bench.TORCH):
        assert rows[torch_plain]["notes"] == "skipped: torch not installed"


def test_the_head_gradient_rows_add_dw_to_the_flops_and_the_outputs(tmp_path):
    name = "8B jaxgrad fused ct=16 cv=all bf16 dh+dW"
    rows, notes = bench.suite_lm_head("small", "default", repeats=1, warmup=0, variants=[f"={name}"],
                                      head_grad=True, say=lambda _: None)
    (r,) = rows
    s = bench.SHAPES["small"]["8B"]
    assert r.variant == name and r.median_ms > 0 and r.sizes["head_grad"] is True
    assert r.flops == bench.head_flops(s, True) == 1.5 * bench.head_flops(s, False)
    # the outputs hold dW [vocab, hidden] beside dh [batch, seq, hidden] (bf16) and the fp32 loss
    assert r.output_bytes >= 2 * (s["vocab"] * s["hidden"] + s["batch"] * s["seq"] * s["hidden"])
    assert any("gradient dh and dW" in line for line in notes)


def test_the_summary_compares_each_row_with_the_plain_losses_of_its_own_head_and_like_memory_only():
    def row(name, ms, peak=None, compiled=None):
        return bm.Row("lm_head", name, {}, "bf16", "default", median_ms=ms, peak_bytes=peak, compiled_bytes=compiled)

    gib = 2**30
    rows = [row("8B jax.grad plain bf16 dh", 50.0, peak=12 * gib), row("8B torch liger FLCE bf16 dh", None),
            row("8B torch F.linear+F.cross_entropy bf16 dh", 60.0, peak=16 * gib),
            row("8B jaxgrad fused ct=1024 cv=all bf16 dh", 30.0, peak=2 * gib),
            row("1B jaxgrad fused ct=1024 cv=all bf16 dh", 20.0, compiled=gib)]
    lines = {line.split(":")[0]: line for line in bench.summary_lines(rows, "full")}
    assert "8B torch liger FLCE bf16 dh" not in lines  # skipped: no line
    assert lines["8B jaxgrad fused ct=1024 cv=all bf16 dh"].endswith(
        "30.000 ms, peak 2048.0 MiB; 0.60x jax.grad plain's time, 0.17x its peak; 0.50x HF's time, 0.12x its peak")
    assert lines["8B jax.grad plain bf16 dh"].endswith("; 0.83x HF's time, 0.75x its peak")
    assert lines["1B jaxgrad fused ct=1024 cv=all bf16 dh"] == \
        "1B jaxgrad fused ct=1024 cv=all bf16 dh: 20.000 ms, compiled 1024.0 MiB"  # no 1B plain row to compare
