"""The LoRA block with ``backend="mosaic"``: every dense projection's forward, recompute and ``dX`` through the Mosaic
GPU kernels (:mod:`jaxgrad.ops.lora_linear_mgpu`), verified by ``jaxgrad.verify`` at bf16 against the plain
reference block on a Hopper GPU. The shapes are chosen so that every projection qualifies (rows a multiple of 256,
widths of 128, r = 16), and the test checks that the kernels are really in the compiled program. (Off a GPU the
mosaic backend is the XLA path bit for bit: ``tests/test_lora_block.py``.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgrad.lora.kernels as kernels_mod
import jaxgrad.ops.lora_linear_mgpu as mgpu_mod
from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from tests.test_lora_block import assert_block_vjp_verified

CFG = LlamaConfig(hidden_size=256, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  rms_norm_eps=1e-5, max_position_embeddings=256, vocab_size=11)
LCFG = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
B, T = 2, 128

# odd sizes (issue #13 item 3): seq 77, hidden 96, 3 q heads on 1 kv head (head dim 32), intermediate 160, r 4 --
# every projection's operands zero-padded to the kernels' tiles
CFG_ODD = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1,
                      head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=128, vocab_size=11)
LCFG_ODD = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
T_ODD = 77


def _inputs(seed, dtype, odd=False):
    """Base weights ~ N(0, 1/in), norm weights 1 + N(0, 0.2^2), A and B random and non-zero, x ~ N(0, 1); ``odd``:
    at CFG_ODD and seq 77 instead of CFG and seq 128 (batch 2 either way)."""
    c, r, t = (CFG_ODD, LCFG_ODD.r, T_ODD) if odd else (CFG, LCFG.r, T)
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}  # HF [out, in]
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(np.float32(a), dtype)  # noqa: E731
    norms = {n: {"weight": cast(1 + 0.2 * rng.standard_normal(h))}
             for n in ("input_layernorm", "post_attention_layernorm")}
    frozen, lora = {}, {}
    for g, n in PROJECTIONS:
        out_f, in_f = shapes[n]
        frozen.setdefault(g, {})[n] = {"weight": cast(rng.standard_normal((out_f, in_f)) / np.sqrt(in_f))}
        lora.setdefault(g, {})[n] = {"lora_A": cast(rng.uniform(-1, 1, (r, in_f)) / np.sqrt(in_f)),
                                     "lora_B": cast(rng.uniform(-1, 1, (out_f, r)) / np.sqrt(r))}
    return frozen, norms, lora, cast(rng.standard_normal((B, t, h)))


def _step(fn):
    def step(x, lora, norms):
        y, pb = jax.vjp(fn, x, lora, norms)
        return y, pb(y)
    return jax.jit(step)


def _kernel_calls(fn, x, lora, norms, **lower):
    """The distinct Mosaic GPU kernels (one line each, by their kernel hash) in the lowered program of the forward
    and the VJP. A kernel whose side output one call site leaves unused lowers once per site (JAX prunes the unused
    result from the call's wrapper, not from the kernel), so the lines are deduplicated by the kernel itself."""
    text = _step(fn).trace(x, lora, norms).lower(**lower).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    return list({re.search(r'kernel_hash = "([^"]*)"', line).group(1): line for line in lines}.values())


def _fn(frozen, backend="mosaic", odd=False):
    cfg, lcfg = (CFG_ODD, LCFG_ODD) if odd else (CFG, LCFG)
    return lambda x, lora, norms: block({**frozen, **norms}, lora, x, cfg, lcfg, backend=backend)


@pytest.mark.parametrize("odd", [False, True], ids=["tiles", "odd-sizes"])
def test_every_projection_takes_the_kernels_when_lowered_for_a_gpu(monkeypatch, odd):
    # on this CPU, lowered for CUDA as if on a GPU: the forward and dX kernels of every projection shape are in the
    # program (4 forward shapes -- q/o, k/v, gate/up, down -- and their 4 dX shapes; XLA shares identical calls);
    # at odd sizes (seq 77, hidden 96, r 4) too, through zero padding
    monkeypatch.setattr(kernels_mod, "_on_gpu", lambda: True)
    monkeypatch.setattr(mgpu_mod, "_num_sms", lambda: 132)
    frozen, norms, lora, x = _inputs(11, jnp.bfloat16, odd)
    calls = _kernel_calls(_fn(frozen, odd=odd), x, lora, norms, lowering_platforms=("cuda",))
    if odd:  # padded, q, k, v and o share one forward shape (128 x 128) and q / o one dX shape: 3 + 4 kernels
        assert len(calls) == 7 and not any("xf32>" in c.split("->")[-1] for c in calls), len(calls)
        return
    assert len(calls) == 8, len(calls)
    # the dX kernels write the operand dtype (bf16; the sums of the projections' dX stay fp32): no fp32 result
    assert not any("xf32>" in c.split("->")[-1] for c in calls)
    # each reads its rank-r product (sU, sG: [rows, r] in bf16, computed by XLA; the backward's dB / dA reuse it)
    assert all("tensor<256x16xbf16>" in re.search(r": \(([^()]*)\) -> [^>]*>$", c).group(1) for c in calls)


def _nf4(frozen):
    """The frozen projection weights quantised to NF4 (bitsandbytes' blocksize 64), as QLoRA trains."""
    from jaxgrad.lora.nf4 import nf4_quantize

    return jax.tree.map(lambda w: nf4_quantize(np.asarray(w, np.float32), blocksize=64), frozen,
                        is_leaf=lambda t: hasattr(t, "shape"))


def test_nf4_weights_take_the_kernels_after_xla_dequantises_them(monkeypatch):
    # QLoRA on the mosaic backend: each NF4 weight is dequantised by XLA (the XLA path's rounding), then the same
    # 8 kernels run; the forward's and the backward's dequantisations are the same ops (merged by XLA's CSE)
    monkeypatch.setattr(kernels_mod, "_on_gpu", lambda: True)
    monkeypatch.setattr(mgpu_mod, "_num_sms", lambda: 132)
    frozen, norms, lora, x = _inputs(18, jnp.bfloat16)
    assert len(_kernel_calls(_fn(_nf4(frozen)), x, lora, norms, lowering_platforms=("cuda",))) == 8


def test_fp32_master_adapters_take_the_kernels_too(monkeypatch):
    # PEFT keeps adapters in fp32 on a bf16 model (the lora_model bench does too): the kernels take them rounded to
    # the activation dtype, forward and dX alike
    monkeypatch.setattr(kernels_mod, "_on_gpu", lambda: True)
    monkeypatch.setattr(mgpu_mod, "_num_sms", lambda: 132)
    frozen, norms, lora, x = _inputs(13, jnp.bfloat16)
    lora = jax.tree.map(lambda a: a.astype(jnp.float32), lora)
    assert len(_kernel_calls(_fn(frozen), x, lora, norms, lowering_platforms=("cuda",))) == 8


@pytest.mark.gpu
def test_gpu_mosaic_block_at_odd_sizes_vjp_verified_bf16():
    # seq 77, hidden 96, 3 q heads / 1 kv head, intermediate 160, r 4: every projection padded to the kernels' tiles
    frozen, norms, lora, x = _inputs(17, jnp.bfloat16, odd=True)
    fn = _fn(frozen, odd=True)
    assert len(_kernel_calls(fn, x, lora, norms)) == 7  # compiled for this GPU: the kernels are there

    def ref(x, lora, norms):
        return block_reference({**frozen, **norms}, lora, x, CFG_ODD, LCFG_ODD)

    assert_block_vjp_verified(fn, ref, x, lora, norms, arg_names=("x", "lora", "norms"))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "nf4"])
def test_gpu_mosaic_block_vjp_verified_bf16(kind):
    frozen, norms, lora, x = _inputs(11, jnp.bfloat16)
    if kind == "nf4":  # QLoRA: NF4 base weights, dequantised by XLA for the kernels (the reference dequantises too)
        frozen = _nf4(frozen)
    fn = _fn(frozen)
    assert len(_kernel_calls(fn, x, lora, norms)) == 8  # compiled for this GPU: the kernels are really there
    # and in the optimised program each projection's forward kernel runs once, shared by the backward's recompute
    # (XLA's CSE of identical calls), beside its dX kernel: 7 + 7 launches
    hlo = _step(fn).lower(x, lora, norms).compile().as_text()
    launches = [ln for ln in hlo.splitlines() if "custom_call_target=\"mosaic_gpu" in ln]
    assert len(launches) == 14, len(launches)

    def ref(x, lora, norms):
        return block_reference({**frozen, **norms}, lora, x, CFG, LCFG)

    assert_block_vjp_verified(fn, ref, x, lora, norms, arg_names=("x", "lora", "norms"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_gpu_one_cudnn_forward_per_training_step(backend):
    # attention="cudnn": the forward's cuDNN call is the training-mode one (it also writes the softmax statistics),
    # identical to the backward's recompute, so XLA merges the two: one forward and one backward cuDNN call per step
    # (otherwise the forward's unused pullback lets JAX take cuDNN's inference-mode kernel: two forwards per step)
    frozen, norms, lora, x = _inputs(15, jnp.bfloat16)
    fn = lambda x, lora, norms: block({**frozen, **norms}, lora, x, CFG, LCFG, backend=backend,  # noqa: E731
                                      attention="cudnn")
    hlo = _step(fn).lower(x, lora, norms).compile().as_text()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', hlo)
    assert sorted(calls) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls
