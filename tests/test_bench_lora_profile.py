"""The ``lora_profile`` tool (no GPU): the HLO reader and op categories (:mod:`jaxgrad.bench.hlo_profile`) on a
hand-written GPU-style module, the GPU trace's stream lines on a synthetic trace, and the whole tool on the CPU with
the small block (:mod:`jaxgrad.bench.lora_profile`)."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from jaxgrad.bench import hlo_profile as hp
from jaxgrad.bench import lora_profile as lp

# A GPU-style optimised module: a cuBLAS gemm (f32 operands, tuple output with workspace), a cuDNN attention
# forward, an RMSNorm-like fusion with a source, a convert fusion attributed only to the block's call site.
HLO = r"""HloModule jit_fwd_bwd, is_scheduled=true

FileNames
1 "/x/jaxgrad/lora/block.py"
2 "/x/jaxgrad/ops/rmsnorm.py"

FunctionNames
1 "block"
2 "_block_fwd"
3 "rms_norm_rstd"

FileLocations
1 {file_name_id=1 function_name_id=1 line=350 end_line=350 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=256 end_line=256 column=1 end_column=2}
3 {file_name_id=2 function_name_id=3 line=63 end_line=63 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=0}
3 {file_location_id=3 parent_frame_id=0}

%fused_rms (param_0: bf16[8192,2048]) -> f32[8192] {
  %param_0 = bf16[8192,2048]{1,0} parameter(0)
  %convert.1 = f32[8192,2048]{1,0} convert(%param_0), metadata={op_name="jit(fwd_bwd)/jvp()/convert_element_type" stack_frame_id=3}
  %multiply.1 = f32[8192,2048]{1,0} multiply(%convert.1, %convert.1), metadata={op_name="jit(fwd_bwd)/jvp()/mul" stack_frame_id=3}
  %constant.1 = f32[] constant(0)
  %reduce.1 = f32[8192]{0} reduce(%multiply.1, %constant.1), dimensions={1}, to_apply=%add_comp, metadata={op_name="jit(fwd_bwd)/jvp()/reduce_sum" stack_frame_id=3}
  ROOT %rsqrt.1 = f32[8192]{0} rsqrt(%reduce.1), metadata={op_name="jit(fwd_bwd)/jvp()/rsqrt" stack_frame_id=3}
}

%fused_convert (param_0.1: bf16[2048,2048]) -> f32[2048,2048] {
  %param_0.1 = bf16[2048,2048]{1,0} parameter(0)
  ROOT %convert.2 = f32[2048,2048]{1,0} convert(%param_0.1), metadata={op_name="jit(fwd_bwd)/transpose(jvp())/convert_element_type" stack_frame_id=1}
}

ENTRY %main.1 (x.1: bf16[8192,2048], w.1: bf16[2048,2048], dy.1: f32[8192,2048], q.1: bf16[4,2048,16,128], k.1: bf16[4,2048,8,128], v.1: bf16[4,2048,8,128]) -> f32[8192,2048] {
  %x.1 = bf16[8192,2048]{1,0} parameter(0)
  %w.1 = bf16[2048,2048]{1,0} parameter(1)
  %dy.1 = f32[8192,2048]{1,0} parameter(2)
  %q.1 = bf16[4,2048,16,128]{3,2,1,0} parameter(3)
  %k.1 = bf16[4,2048,8,128]{3,2,1,0} parameter(4)
  %v.1 = bf16[4,2048,8,128]{3,2,1,0} parameter(5)
  %input_rsqrt_fusion = f32[8192]{0} fusion(%x.1), kind=kInput, calls=%fused_rms, metadata={op_name="jit(fwd_bwd)/jvp()/rsqrt" stack_frame_id=3}
  %loop_convert_fusion.2 = f32[2048,2048]{1,0} fusion(%w.1), kind=kLoop, calls=%fused_convert, metadata={op_name="jit(fwd_bwd)/transpose(jvp())/convert_element_type" stack_frame_id=1}
  %custom-call.5 = (f32[8192,2048]{1,0}, s8[4194304]{0}) custom-call(%dy.1, %loop_convert_fusion.2), custom_call_target="__cublas$gemm", metadata={op_name="jit(fwd_bwd)/transpose(jvp())/dot_general" stack_frame_id=1}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %custom-call.7 = (bf16[4,16,2048,128]{3,1,2,0}, f32[4,16,2048]{2,1,0}, u8[0]{0}) custom-call(%q.1, %k.1, %v.1), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(fwd_bwd)/jvp()/dot_product_attention" stack_frame_id=2}, backend_config={"cudnn_fmha_backend_config":{"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]},"intermediate_tensor_shape":{"dimensions":["4","16","2048","2048"],"element_type":"BF16"},"mask_type":"CAUSAL"}}
  %bt.1 = bf16[16,2048]{1,0} parameter(6)
  %at.1 = bf16[2048,16]{1,0} parameter(7)
  %dyb.1 = bf16[8192,2048]{1,0} parameter(8)
  %custom-call.9 = (f32[8192,2048]{1,0}, bf16[8192,16]{1,0}) custom-call(%dyb.1, %w.1, %bt.1, %at.1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(fwd_bwd)/transpose(jvp())/mosaic_gpu_call" stack_frame_id=1}
  %sg.1 = bf16[8192,16]{1,0} parameter(9)
  %custom-call.10 = bf16[8192,2048]{1,0} custom-call(%dyb.1, %w.1, %sg.1, %at.1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(fwd_bwd)/transpose(jvp())/mosaic_gpu_call" stack_frame_id=1}
  ROOT %get-tuple-element.1 = f32[8192,2048]{1,0} get-tuple-element(%custom-call.5), index=0
}
"""


def test_parse_hlo_and_describe():
    mod = hp.parse_hlo(HLO)
    assert mod.name == "jit_fwd_bwd"
    assert [f for f, _, _ in mod.frame_chain(3)] == ["/x/jaxgrad/ops/rmsnorm.py"]

    gemm = hp.describe(mod, "custom-call.5")
    assert gemm.kind == "gemm" and gemm.category == "cuBLAS gemm base f32/tf32"
    assert gemm.flops == 2.0 * 8192 * 2048 * 2048
    assert gemm.bytes == 4 * (8192 * 2048 + 2048 * 2048) + 4 * 8192 * 2048  # workspace not counted
    assert gemm.phase == "bwd" and gemm.bound == "flops"
    assert gemm.floor_s == pytest.approx(gemm.flops / hp.MATMUL_FLOPS)

    # a Mosaic GPU LoRA kernel of the older form (the r-wide G formed in its K loop), here the dX one:
    # dY W + (s dY B) A with sG out; profiles of it are still read
    mos = hp.describe(mod, "custom-call.9")
    assert mos.kind == "gemm" and mos.category == "Mosaic GPU gemm+lora bf16"
    assert mos.flops == 2.0 * 8192 * 2048 * (2048 + 16) + 2.0 * 8192 * 16 * 2048
    assert mos.detail == "8192x2048x2048 r16 bf16->f32"
    # the kernel as jaxgrad.ops.lora_linear_mgpu has it, reading sG computed by XLA: no r-wide product inside
    mos = hp.describe(mod, "custom-call.10")
    assert mos.flops == 2.0 * 8192 * 2048 * 2048 + 2.0 * 8192 * 16 * 2048
    assert mos.detail == "8192x2048x2048 r16 in bf16->bf16"

    att = hp.describe(mod, "custom-call.7")
    assert att.category == "cuDNN attention fwd"
    assert att.flops == 4.0 * 4 * 16 * (2048 * 2049 / 2) * 128
    assert att.detail == "B=4 Hq=16 T=2048 S=2048 d=128 causal"

    norm = hp.describe(mod, "input_rsqrt_fusion")
    assert norm.kind == "reduction" and norm.category == "rmsnorm reduction"
    assert norm.source == "rmsnorm:rms_norm_rstd" and norm.phase == "fwd"
    assert norm.bytes == 2 * 8192 * 2048 + 4 * 8192 and norm.bound == "bytes"

    conv = hp.describe(mod, "loop_convert_fusion.2")  # only the block's call site: a custom VJP's backward
    assert conv.kind == "convert" and conv.category == "vjp-bwd convert" and conv.phase == "bwd"

    # a kernel name without its hlo_op: XLA names a fusion's kernel after it, '.' -> '_'
    assert mod.lookup("loop_convert_fusion_2").name == "loop_convert_fusion.2"
    assert hp.describe(mod, "nonexistent").category.startswith("unmapped")


def _gpu_trace(tmp_path: pathlib.Path) -> pathlib.Path:
    def meta(pid, tid, kind, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

    ev = [meta(1, 0, "process_name", "/host:CPU"), meta(2, 0, "process_name", "/device:GPU:0"),
          meta(2, 7, "thread_name", "Stream #7(Compute)"), meta(2, 99, "thread_name", "XLA Ops"),
          meta(1, 5, "thread_name", "python")]
    for step in range(2):
        t = 1000.0 * step
        ev += [
            {"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": 300.0, "name": "sm90_xmma_gemm_f32f32_tf32",
             "args": {"hlo_op": "custom-call.5", "hlo_module": "jit_fwd_bwd"}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": t + 300, "dur": 2.0, "name": "Memset 3",
             "args": {"hlo_op": "custom-call.5", "hlo_module": "jit_fwd_bwd"}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": t + 303, "dur": 2.0, "name": "Memset 3",
             "args": {"hlo_op": "custom-call.5", "hlo_module": "jit_fwd_bwd"}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": t + 400, "dur": 20.0, "name": "loop_convert_fusion_2", "args": {}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": t + 450, "dur": 5.0, "name": "MemcpyD2D", "args": {}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": t + 500, "dur": 50.0, "name": "other_module_kernel",
             "args": {"hlo_op": "fusion", "hlo_module": "jit_something_else"}},
            # a derived line and a host event: both must be ignored
            {"ph": "X", "pid": 2, "tid": 99, "ts": t, "dur": 320.0, "name": "custom-call.5",
             "args": {"hlo_op": "custom-call.5", "hlo_module": "jit_fwd_bwd"}},
            {"ph": "X", "pid": 1, "tid": 5, "ts": t, "dur": 900.0, "name": "PjitFunction(fwd_bwd)", "args": {}},
        ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": ev}, f)
    return path


def test_gpu_trace_events_and_table(tmp_path):
    path = _gpu_trace(tmp_path)
    assert hp.find_trace(tmp_path) == path
    rows, which, mod = hp.analyse(path, HLO, steps=2)
    assert "Stream #7(Compute)" in which and "XLA Ops" not in which
    by_op = {r.op: r for r in rows}
    assert set(by_op) == {"custom-call.5", "loop_convert_fusion.2", "[MemcpyD2D]"}
    gemm = by_op["custom-call.5"]  # one execution per step: its two memsets are not executions
    assert gemm.ms == pytest.approx(0.304) and gemm.count == 1 and gemm.launches == 3
    assert gemm.main_kernel == "sm90_xmma_gemm_f32f32_tf32"
    assert by_op["loop_convert_fusion.2"].info.category == "vjp-bwd convert"  # matched by kernel name
    assert by_op["[MemcpyD2D]"].info.category == "memcpy/memset"
    table = lp.variant_table("v", rows, {"median_ms": 0.4, "profiled_median_ms": 0.4, "steps": 2,
                                         "profiled_with": "test", "events_from": which})
    assert "cuBLAS gemm base f32/tf32" in table and "vjp-bwd convert" in table
    gap_line = next(ln for ln in table.splitlines() if ln.startswith("GPU busy"))
    assert "0.329 ms" in gap_line  # (300 + 2 + 2 + 20 + 5) us per step


def test_script_on_cpu_small_block(tmp_path):
    """The whole script on the CPU: the small block (custom VJP), a real trace, a results file with its header,
    and the same table remade from the saved artifacts."""
    pytest.importorskip("jax")
    out, art = tmp_path / "out", tmp_path / "art"
    assert lp.main(["--variants", "custom_vjp cudnn", "--steps", "2", "--repeats", "2", "--warmup", "1",
                    "--out", str(out), "--artifacts", str(art), "--top", "10"]) == 0
    (txt,) = out.glob("lora-profile-cpu-bf16-*.txt")  # <suite>-<device>-<precision>-<date>-<time>
    text = txt.read_text()
    head = text.splitlines()[:4]
    assert head[1].startswith("# device:") and head[2].startswith("# jax ") and "command:" in head[3]
    assert "== custom_vjp sdpa(xla) ==" in text and "-- by category" in text
    payload = json.loads(txt.with_suffix(".json").read_text())
    ops = payload["variants"][0]["ops"]
    assert sum(o["ms_per_step"] for o in ops) > 0
    cats = {o["category"] for o in ops}
    assert any(c.startswith("XLA gemm") for c in cats)  # the CPU's dots (all skinny at this size)
    assert any(c.startswith("rmsnorm") for c in cats) and any(c.startswith("swiglu") for c in cats)
    assert {o["phase"] for o in ops} >= {"fwd", "bwd"}
    assert sorted(p.name for p in art.iterdir()) == ["hlo-custom_vjp_sdpa_xla.txt.gz", "meta.json",
                                                     "trace-custom_vjp_sdpa_xla.json.gz"]
    again = tmp_path / "again"
    assert lp.main(["--from-artifacts", str(art), "--out", str(again), "--top", "10"]) == 0
    (txt2,) = again.glob("lora-profile-*.txt")
    t2 = txt2.read_text()
    assert "remade with --from-artifacts" in t2
    strip = lambda t: [ln for ln in t.split("== custom_vjp", 1)[1].splitlines() if not ln.startswith("events")]  # noqa: E731
    assert strip(t2) == strip(text)
