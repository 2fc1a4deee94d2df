"""Flash attention as Pallas kernels (jaxgrad.ops.flash_attention): the same function as jaxgrad.ops.attention,
computed block by block. On the CPU the kernels run in Pallas interpret mode (any dtype, float64 included).

* the forward's O and lse equal attention_fwd's in float64 (causal, GQA 3/1 and 4/2, seq 77 with blocks 16/32, head_dim 8,
  16 and 128, left and right padding, gaps in the mask inside and across blocks, left padding over a whole block, a
  fully padded row: O = 0, lse = -inf);
* the backward equals jax.grad of attention_reference in float64 to ~1e-12, and jaxgrad.verify passes it in
  float32 and bf16 as called; planted bugs (dv scaled by 1.01, a dropped GQA group term) fail that verification;
* rows with no visible key give output 0 and zero gradients, never NaN;
* segment ids (packed rows) with boundaries inside and across blocks equal the reference in float64, forward and
  backward, and lower to Triton;
* the LoRA block with attention="pallas" equals attention="xla" in float64;
* the kernels lower to Triton for a GPU on any machine (power-of-two shapes, supported ops), and on a GPU they
  compile and verify at seq 2048, head_dim 128, 16 / 8 heads, bf16, and at an odd size.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgrad.ops.flash_attention as fa
from jaxgrad.lora.block import block
from jaxgrad.ops.attention import attention_fwd, attention_reference
from jaxgrad.ops.flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd
from jaxgrad.verify import check_vjp

B = 2


def qkv(seed, t, hq, hkv, d, dtype=jnp.float32, b=B):
    """Fresh N(0, 1) q, k, v (never zeros)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype) for kk, h in zip(ks, (hq, hkv, hkv))]


def padding(t, left=0, right=0, full_row=False, gaps=()):
    """HF [B, T] mask: row 0 left-padded by ``left``, row 1 right-padded by ``right`` (or fully padded); both rows
    padded at the positions ``gaps`` too."""
    m = np.ones((B, t), np.int32)
    m[0, :left] = 0
    m[1, t - right:] = 0
    m[:, list(gaps)] = 0
    if full_row:
        m[1] = 0
    return jnp.asarray(m)


# (t, hq, hkv, d, block_q, block_k, mask)
CASES = {
    "causal-gqa3/1-seq77-blocks16/32-d16": (77, 3, 1, 16, 16, 32, None),
    "gqa4/2-seq77-blocks32/16-d8-left+right": (77, 4, 2, 8, 32, 16, dict(left=5, right=9)),
    "gqa3/1-seq20-default-blocks-d128-fully-padded-row": (20, 3, 1, 128, None, None, dict(left=3, full_row=True)),
    "mha2/2-seq33-blocks16-d16-left": (33, 2, 2, 16, 16, 16, dict(left=17)),
    # gaps inside and across block boundaries (16, 32); row 0's left padding covers the whole first kv block and
    # the first q block has no visible key there
    "gqa4/2-seq40-blocks16-d8-left+gaps": (40, 4, 2, 8, 16, 16, dict(left=18, gaps=(3, 4, 15, 16, 17, 31, 32, 33))),
}


def _case(name, dtype, seed=0):
    t, hq, hkv, d, bq, bk, mask = CASES[name]
    q, k, v = qkv(seed, t, hq, hkv, d, dtype)
    return q, k, v, (None if mask is None else padding(t, **mask)), dict(block_q=bq, block_k=bk)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_float64_equal_attention_fwd_and_jax_grad_of_the_reference(name):
    # One compile of each kernel per case: the forward's (O, lse) against attention_fwd, the backward from that lse
    # against jax.vjp of the plain reference (the custom_vjp wiring is exercised by the verifier tests below).
    with jax.enable_x64(True):
        q, k, v, mask, blocks = _case(name, jnp.float64, seed=1)
        o, lse = flash_attention_fwd(q, k, v, mask, **blocks)
        o_ref, lse_ref = attention_fwd(q, k, v, mask)
        assert o.dtype == jnp.float64 and lse.dtype == jnp.float64 and lse.shape == lse_ref.shape
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-13)
        # rows with no visible key: lse = -inf in both (and O = 0); elsewhere equal to rounding
        np.testing.assert_array_equal(jnp.isneginf(lse), jnp.isneginf(lse_ref))
        finite = jnp.isfinite(lse_ref)
        np.testing.assert_allclose(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0), rtol=0, atol=1e-13)
        ct = jax.random.normal(jax.random.key(7), q.shape, jnp.float64)
        got = flash_attention_bwd(q, k, v, lse, ct, mask, **blocks)
        want = jax.vjp(lambda *a: attention_reference(*a, mask), q, k, v)[1](ct)
        for name_, g, w in zip("qkv", got, want):
            assert g.dtype == jnp.float64
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(w))), err_msg=f"d{name_}")


def test_segment_ids_across_block_boundaries_float64_equal_attention_fwd_and_jax_grad_of_the_reference():
    # packed rows (segment ids), boundaries inside and at the edges of the 16- and 32-row blocks, with padding; a
    # padding token that starts a segment leaves that row with no visible key (O = 0, lse = -inf)
    t = 77
    seg = np.zeros((B, t), np.int32)
    seg[0, :16], seg[0, 16:35], seg[0, 35:70], seg[0, 70:] = 3, 1, 4, 0
    seg[1, :5], seg[1, 5:50], seg[1, 50:] = 9, -2, 7
    mask = padding(t, right=4, gaps=(50,))  # row 1's last segment starts with a padding token
    with jax.enable_x64(True):
        q, k, v = qkv(13, t, 4, 2, 16, jnp.float64)
        o, lse = flash_attention_fwd(q, k, v, mask, block_q=16, block_k=32, segment_ids=seg)
        o_ref, lse_ref = attention_fwd(q, k, v, mask, segment_ids=seg)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-13)
        np.testing.assert_array_equal(jnp.isneginf(lse), jnp.isneginf(lse_ref))
        assert bool(jnp.all(jnp.isneginf(lse[1, :, :, 50])))
        finite = jnp.isfinite(lse_ref)
        np.testing.assert_allclose(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0), rtol=0, atol=1e-13)
        ct = jax.random.normal(jax.random.key(14), q.shape, jnp.float64)
        got = flash_attention_bwd(q, k, v, lse, ct, mask, block_q=16, block_k=32, segment_ids=seg)
        want = jax.vjp(lambda *a: attention_reference(*a, mask, segment_ids=seg), q, k, v)[1](ct)
        for name_, g, w in zip("qkv", got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(w))), err_msg=f"d{name_}")
        # the segment term is in every kernel: without it the packed rows are one sequence
        assert float(jnp.max(jnp.abs(flash_attention_fwd(q, k, v, mask, block_q=16, block_k=32)[0] - o))) > 1e-2


def test_rows_with_no_visible_key_give_zero_output_and_zero_gradients_never_nan():
    q, k, v, mask, blocks = _case("gqa3/1-seq20-default-blocks-d128-fully-padded-row", jnp.float32)
    o, vjp = jax.vjp(lambda *a: flash_attention(*a, mask, **blocks), q, k, v)
    assert bool(jnp.all(o[1] == 0)) and bool(jnp.all(o[0, :3] == 0))  # fully padded row; left padding
    dq, dk, dv = vjp(jnp.ones_like(o))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in (dq, dk, dv))
    assert bool(jnp.all(dq[1] == 0)) and bool(jnp.all(dk[1] == 0)) and bool(jnp.all(dv[1] == 0))
    assert bool(jnp.all(dq[0, :3] == 0))  # no visible key: no gradient to q
    assert bool(jnp.all(dk[0, :3] == 0)) and bool(jnp.all(dv[0, :3] == 0))  # padded keys get none either


@pytest.mark.slow  # ~30 s on 2 cores
def test_vjp_verified_float32_gqa_odd_sequence():
    q, k, v = qkv(3, 37, 4, 2, 16, jnp.float32)
    rep = check_vjp(functools.partial(flash_attention, block_q=16, block_k=16), attention_reference, q, k, v,
                    arg_names=("q", "k", "v"))
    assert rep.passed, str(rep)


@pytest.mark.parametrize("shape", [(7, 3, 1, 8), pytest.param((77, 4, 2, 16), marks=pytest.mark.slow)],
                         ids=["seq7-gqa3/1-d8", "seq77-gqa4/2-d16"])
def test_vjp_verified_bf16_at_bf16_precision(shape):
    # bf16 inputs, fp32 arithmetic: judged at bf16, the precision of the rounded inputs and outputs. This is the
    # test that decides the D = rowsum(P dP) design (a bf16-rounded O in D failed it for attention.py).
    q, k, v = qkv(4, *shape, jnp.bfloat16)
    rep = check_vjp(functools.partial(flash_attention, block_q=16, block_k=32), attention_reference, q, k, v,
                    arg_names=("q", "k", "v"), precision="bf16")
    assert rep.passed, str(rep)


def _planted_dv_scaled(q, k, v):
    @jax.custom_vjp
    def f(q, k, v):
        return flash_attention(q, k, v)

    def fwd(q, k, v):
        return jax.vjp(flash_attention, q, k, v)

    def bwd(pullback, do):
        dq, dk, dv = pullback(do)
        return dq, dk, dv * 1.01

    f.defvjp(fwd, bwd)
    return f(q, k, v)


def test_planted_bug_dv_scaled_fails_the_verification():
    q, k, v = qkv(5, 7, 3, 1, 8, jnp.float32)
    # the as-called f32 run alone must catch it (a 1% error is ~1e5 f32 roundings): no f64 re-run, no FD
    rep = check_vjp(_planted_dv_scaled, attention_reference, q, k, v, arg_names=("q", "k", "v"), float64=False,
                    fd=False)
    assert not rep.passed


def test_planted_bug_dropped_gqa_group_term_fails_the_verification(monkeypatch):
    good = fa._dkv_kernel
    # dK/dV summed over G - 1 of the G query heads of each kv head (the last head's terms dropped)
    monkeypatch.setattr(fa, "_dkv_kernel", lambda *refs, groups, **kw: good(*refs, groups=groups - 1, **kw))
    q, k, v = qkv(6, 7, 3, 1, 8, jnp.float32)
    rep = check_vjp(flash_attention, attention_reference, q, k, v, arg_names=("q", "k", "v"), float64=False,
                    fd=False)
    assert not rep.passed


def test_block_with_pallas_attention_equals_xla_attention_float64():
    from tests.test_lora_block import CFG, LCFG, MASK, make_block

    with jax.enable_x64(True):
        params, lora, x = make_block(1, jnp.float64)
        ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float64)
        outs = {}
        for attn in ("xla", "pallas"):
            f = jax.jit(lambda p, l, x, attn=attn: block(p, l, x, CFG, LCFG, attention_mask=MASK, attention=attn))
            y, pullback = jax.vjp(f, params, lora, x)
            outs[attn] = (y, pullback(ct))
        (y, g), (y_ref, g_ref) = outs["pallas"], outs["xla"]
        np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(y_ref))))
        for a, w in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, w, rtol=0, atol=1e-12 * max(float(jnp.max(jnp.abs(w))), 1e-300))
        assert len(jax.tree.leaves(g)) == len(jax.tree.leaves(g_ref))


def test_bad_inputs_are_named():
    q, k, v = qkv(1, 7, 3, 1, 8)
    with pytest.raises(ValueError, match=r"'block_q' must be a power of two >= 16, got 24"):
        flash_attention(q, k, v, block_q=24)
    with pytest.raises(ValueError, match=r"'block_k' must be a power of two >= 16, got 8"):
        flash_attention(q, k, v, block_k=8)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        flash_attention(*qkv(1, 7, 3, 2, 8))
    with pytest.raises(ValueError, match="'attention_mask' must be"):
        flash_attention(q, k, v, attention_mask=jnp.ones((B, 8)))
    with pytest.raises(TypeError, match="'k' must be floating point"):
        flash_attention(q, k.astype(jnp.int32), v)
    from tests.test_lora_block import CFG, LCFG, make_block
    params, lora, x = make_block(11, jnp.float32)
    with pytest.raises(ValueError, match="'attention' must be one of 'xla', 'cudnn', 'pallas', got 'flash'"):
        block(params, lora, x, CFG, LCFG, attention="flash")


@pytest.mark.parametrize("shape", [(2048, 16, 8, 128, jnp.bfloat16), (77, 3, 1, 80, jnp.float32)],
                         ids=["seq2048-16/8-d128-bf16", "seq77-3/1-d80-f32"])
def test_kernels_lower_to_triton_for_a_gpu_on_any_machine(shape, monkeypatch):
    # The Triton lowering (power-of-two in-kernel shapes, supported ops, ref indexing) runs in Python; only the
    # GPU query is faked (JAX-internal hook: skipped if it moves).
    from jax._src.pallas.triton import pallas_call_registration as reg
    if not hasattr(getattr(reg, "gpu_info_lib", None), "get_gpu_info"):
        pytest.skip("jax internals moved: no gpu_info_lib.get_gpu_info to fake")
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability="9.0"))
    t, hq, hkv, d, dt = shape
    spec = [jax.ShapeDtypeStruct((B, t, h, d), dt) for h in (hq, hkv, hkv)] + [jax.ShapeDtypeStruct((B, t), jnp.int32)]

    def loss(q, k, v, m):
        return jnp.sum(flash_attention(q, k, v, m, interpret=False).astype(jnp.float32))

    low = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*spec).lower(lowering_platforms=("cuda",))
    assert low.as_text().count("xla.gpu.triton") == 3  # forward, dQ (with D), dK/dV


def test_kernels_with_segment_ids_lower_to_triton_for_a_gpu_on_any_machine(monkeypatch):
    # as above, with the segment-id inputs of the three kernels (their q rows' and kv blocks' ids)
    from jax._src.pallas.triton import pallas_call_registration as reg
    if not hasattr(getattr(reg, "gpu_info_lib", None), "get_gpu_info"):
        pytest.skip("jax internals moved: no gpu_info_lib.get_gpu_info to fake")
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability="9.0"))
    t, hq, hkv, d = 77, 4, 2, 80
    spec = [jax.ShapeDtypeStruct((B, t, h, d), jnp.bfloat16) for h in (hq, hkv, hkv)]
    spec += [jax.ShapeDtypeStruct((B, t), jnp.int32)] * 2

    def loss(q, k, v, m, seg):
        return jnp.sum(flash_attention(q, k, v, m, interpret=False, segment_ids=seg).astype(jnp.float32))

    low = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*spec).lower(lowering_platforms=("cuda",))
    assert low.as_text().count("xla.gpu.triton") == 3  # forward, dQ (with D), dK/dV


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 16, 8, 128), (77, 3, 1, 80)], ids=["seq2048-16/8-d128", "seq77-3/1-d80"])
def test_gpu_kernels_compile_and_verify_bf16(shape):
    t, hq, hkv, d = shape
    q, k, v = qkv(12, t, hq, hkv, d, jnp.bfloat16, b=1)
    mask = padding(t, left=t // 7, right=t // 5)[:1]
    fn = functools.partial(flash_attention, attention_mask=mask, interpret=False)
    ref = functools.partial(attention_reference, attention_mask=mask)
    o, lse = jax.jit(functools.partial(flash_attention_fwd, attention_mask=mask, interpret=False))(q, k, v)
    o_ref, lse_ref = attention_fwd(q, k, v, mask)
    np.testing.assert_allclose(np.float32(o), np.float32(o_ref), rtol=2 ** -6, atol=2 ** -6)  # ~1 bf16 ulp
    np.testing.assert_array_equal(jnp.isneginf(lse), jnp.isneginf(lse_ref))
    rep = check_vjp(fn, ref, q, k, v, arg_names=("q", "k", "v"), precision="bf16", float64=False, fd=False)
    assert rep.passed, str(rep)
