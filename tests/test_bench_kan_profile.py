"""The ``kan_profile`` tool on the CPU: one KAN layer variant of the ``kan`` suite, traced and read against its HLO
(:mod:`jaxgrad.bench.kan_profile`); a name that is not a variant is refused with the list of those that are."""

from __future__ import annotations

import json

import pytest

from jaxgrad.bench import kan_profile as kp


def test_the_tool_writes_a_per_op_table_whose_time_is_in_the_spline_and_the_products(tmp_path, capsys):
    rc = kp.main(["--sizes", "small", "--variants", "xla custom_vjp fp16_scaled", "--steps", "2", "--repeats", "2",
                  "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    [txt] = tmp_path.glob("kan-profile-cpu-*.txt")
    text = txt.read_text()
    assert text.startswith("# kan-profile:") and "command: python -m jaxgrad.bench kan_profile" in text
    assert "batch 64, 32 -> 32, G=5, k=3" in text and "== xla custom_vjp fp16_scaled ==" in text
    data = json.loads(txt.with_suffix(".json").read_text())
    [v] = data["variants"]
    sources = {op["source"].split(":")[0] for op in v["ops"]}
    assert {"spline", "layer"} <= sources  # the bases (Cox-de Boor) and the layer's products and passes
    assert v["meta"]["median_ms"] > 0 and sum(op["ms_per_step"] for op in v["ops"]) > 0


def test_a_name_that_is_not_a_layer_variant_is_refused_naming_the_variants(capsys):
    with pytest.raises(SystemExit) as exc:
        kp.main(["--sizes", "small", "--variants", "nosuch"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--variants: ['nosuch'] are not layer variants here" in err
    assert "'xla custom_vjp'" in err


def test_idle_gaps_are_the_gpus_waits_before_each_op_per_step():
    from jaxgrad.bench.hlo_profile import KernelEvent, idle_gaps, parse_hlo

    mod = parse_hlo("HloModule m\n\nENTRY e {\n  ROOT p = f32[] parameter(0)\n}\n")
    # two steps of a, b, c; b starts 10 us after a ends, c overlaps b (no gap), a waits 40 us for the next step
    events = [KernelEvent("a", "ka", 20.0, 0.0), KernelEvent("b", "kb", 30.0, 30.0),
              KernelEvent("c", "kc", 10.0, 50.0), KernelEvent("a", "ka", 20.0, 100.0),
              KernelEvent("b", "kb", 30.0, 130.0), KernelEvent("c", "kc", 10.0, 150.0)]
    gaps = dict(idle_gaps(events, mod, steps=2))
    assert gaps["b"] == 0.010  # ms per step
    assert gaps["a"] == 0.020  # one 40 us wait over two steps
    assert "c" not in gaps
