"""The ``llama_real`` benchmark (``python -m jaxgrad.bench llama_real``, :mod:`jaxgrad.bench.llama_real`): the real
shapes and their parameter counts, NeMo's accounting, the frozen weights, the longest-context search, and an
end-to-end run of one layer at tiny widths here (each variant in its own process; a peer that cannot run says why)."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxgrad.bench import llama_real as real
from jaxgrad.bench import llama_real_peers as peers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_parameter_counts_are_the_published_models():
    one = real.make_spec("1b")
    eight = real.make_spec("8b")
    # Llama-3.2-1B: 1.24 B (tied: the embedding is the head); Llama-3.1-8B: 8.03 B
    assert real.parameter_counts(one)["total"] == 1_235_814_400
    assert real.parameter_counts(eight)["total"] == 8_030_261_248
    assert (one["layers"], one["seq"], one["batch"], one["tied"]) == (16, 4096, 2, True)
    assert (eight["layers"], eight["head_dim"], eight["intermediate"], eight["tied"]) == (32, 128, 14336, False)
    assert one["rope_scaling"]["rope_type"] == eight["rope_scaling"]["rope_type"] == "llama3"


def test_nemo_accounting_reproduces_its_published_ratio():
    s = real.make_spec("8b")
    a = real.accounting(s)
    # NeMo: 402 TFLOP/s at 12,473 tokens/s = 32.2 GFLOP a token = 4 x 8.03 B parameters (its figures are
    # rounded: 4 P = 32.12 GFLOP, 0.3 % below)
    assert a["flops_nemo"] / a["tokens_per_step"] == pytest.approx(402e12 / 12473, rel=5e-3)
    assert a["tokens_per_step"] == 2 * 4096
    attention = 12 * 32 * 2 * 32 * 128 * 4096 * 4097 / 2
    assert a["flops_with_attention"] - a["flops_nemo"] == pytest.approx(attention)
    m = real.metrics(s, 1000 * a["flops_nemo"] / 402e12, None)
    assert m["model_tflops_nemo"] == pytest.approx(402) and m["tokens_per_s"] == pytest.approx(12473, rel=5e-3)
    assert "estimate_full_depth_tokens_per_s" not in m  # every layer ran: nothing to estimate


def test_fewer_layers_are_accounted_as_run_and_the_estimate_is_labelled():
    s = real.make_spec("8b", layers=2)
    a = real.accounting(s)
    # 2 layers of 218,112,000, the embedding and the head of 525,336,576 each, the final norm
    assert a["layers"] == 2 and a["parameters"] == 2 * 218_112_000 + 2 * 525_336_576 + 4096
    m = real.metrics(s, 100.0, 2**30)
    assert (m["layers_run"], m["layers_model"]) == (2, 32)
    assert m["estimate_full_depth_tokens_per_s"] < m["tokens_per_s"] and "not measured" in m["estimate_rule"]


def test_frozen_weights_bf16_and_nf4():
    s = real.make_spec("8b")
    assert real.frozen_weight_bytes(s) == 2 * 8_030_261_248  # 16 GB of bf16
    q = real.make_spec("8b", qlora=True)
    proj = real.parameter_counts(q)["projections"]
    assert real.frozen_weight_bytes(q) == pytest.approx(
        proj * (0.5 + 1 / 64 + 4 / (64 * 256)) + 2 * (8_030_261_248 - proj))


@pytest.mark.parametrize("kw, match", [(dict(model="70b"), "'model'"), (dict(model="1b", layers=17), "'layers'"),
                                        (dict(model="8b", seq=1), "'seq'"), (dict(model="1b", batch=0), "'batch'"),
                                        (dict(model="1b", checkpointing="some"), "'checkpointing'"),
                                        (dict(model="1b", backend="cuda"), "'backend'")])
def test_bad_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        real.make_spec(**kw)


def test_max_context_finds_the_largest_fitting_multiple(monkeypatch):
    limit = 300_000 * 1000 + 1
    monkeypatch.setattr(real, "compiled_bytes_at", lambda s, seq: None if seq > 400_000 else seq * 1000)
    res = real.max_context(real.make_spec("8b", qlora=True, batch=1), step=8192, limit_bytes=limit, say=lambda _: 0)
    assert res["max_seq"] == 294_912 and res["first_too_big"] == 303_104 and res["complete"]  # 36 and 37 x 8192
    assert all(int(k) % 8192 == 0 for k in res["compiled_bytes"])
    with pytest.raises(ValueError, match="--context-start"):
        real.max_context(real.make_spec("8b"), step=8192, start=10_000, limit_bytes=limit)


def test_max_context_stops_before_a_compile_the_budget_cannot_hold(monkeypatch):
    clock = iter(range(0, 10_000, 40))  # each compile takes 40 s
    monkeypatch.setattr(real.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(real, "compiled_bytes_at", lambda s, seq: seq)
    res = real.max_context(real.make_spec("8b", batch=1), step=8192, limit_bytes=10**9, budget_s=200,
                           say=lambda _: 0)
    assert not res["complete"] and res["max_seq"] in map(int, res["compiled_bytes"]) and res["max_seq"] >= 8192


def test_peers_say_why_they_cannot_run():
    q = real.make_spec("8b", qlora=True)
    assert peers.skip_reason("jaxgrad", q) is None
    why = peers.missing("transformers+PEFT+Liger", q)
    assert why is None or (why.startswith("skipped: ") and "not installed" in why)


def test_tiny_run_writes_every_variant_with_numbers_or_a_reason(tmp_path):
    cmd = [sys.executable, "-m", "jaxgrad.bench", "llama_real", "--model", "1b", "--layers", "1", "--tiny",
           "--repeats", "2", "--warmup", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows, info = _check_result(tmp_path)
    ours = info["variants"]["jaxgrad"]
    assert ours["status"] == "measured" and "fused LM-head loss" in rows[0]["notes"]
    assert info["variants"]["jax.grad"]["status"] == "measured"  # tiny: the plain model fits


def _first_losses(rows) -> dict:
    out = {}
    for r in rows:
        m = re.search(r"losses of steps 1-3: ([-\d.e+]+)", r["notes"])
        if m:
            out[r["variant"]] = float(m.group(1))
    return out


def _check_result(out_dir):
    """The result file's structure: its header, the accounting, and every variant measured (tokens/s, both
    TFLOP/s) or not with its reason; every measured variant starts from the same loss, ln(vocab) at this init."""
    (path,) = out_dir.glob("llama_real_1b_tiny-*-bf16-*.json")
    assert path.with_suffix(".txt").exists()
    result = json.loads(path.read_text())
    env, rows = result["environment"], result["rows"]
    for key in ("device_kind", "jax", "commit", "command", "datetime_utc"):
        assert key in env
    info = env["llama_real"]
    assert info["spec"]["layers"] == 1 and info["spec"]["full_layers"] == 16 and info["spec"]["tiny"]
    acc = info["accounting"]
    assert "attention not counted" in acc["rule_nemo"] and acc["flops_with_attention"] > acc["flops_nemo"] > 0
    assert [r["variant"] for r in rows] == list(real.VARIANTS)
    for row in rows:
        m = info["variants"][row["variant"]]
        if m["status"] == "measured":
            assert row["median_ms"] > 0 and m["tokens_per_s"] > 0
            assert m["model_tflops_with_attention"] > m["model_tflops_nemo"] > 0
            assert "estimate_full_depth_tokens_per_s" in m and m["layers_run"] == 1
        else:
            assert m["status"] in ("skipped", "out of memory") and m["reason"], row
    assert any("NeMo" in line for line in env["suite_notes"])
    losses = _first_losses(rows)
    assert set(losses) == {v for v, m in info["variants"].items() if m["status"] == "measured"}
    for variant, loss in losses.items():  # logits of N(0, 0.02^2) weights are near 0: the loss is near ln(V)
        assert loss == pytest.approx(math.log(info["spec"]["vocab"]), abs=0.05), variant
    return rows, info


@pytest.mark.gpu
def test_tiny_run_on_a_gpu_with_the_peers(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    cmd = [sys.executable, "-m", "jaxgrad.bench", "llama_real", "--model", "1b", "--layers", "1", "--tiny",
           "--repeats", "2", "--warmup", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows, info = _check_result(tmp_path)
    assert info["variants"]["transformers+PEFT"]["status"] == "measured"
    assert all(r["peak_bytes"] > 0 for r in rows if r["median_ms"] is not None)
