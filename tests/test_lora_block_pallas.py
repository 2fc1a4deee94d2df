"""The LoRA block's ``backend="pallas"`` (issue #13, step 1): both RMSNorms and the NF4 base products run as Pallas
kernels (interpret mode on this CPU), attention, RoPE, SwiGLU and the LoRA rank-r matmuls stay on XLA.

At odd sizes (batch 2, seq 77, hidden 96, 3 heads / 1 kv head, head_dim 32, intermediate 145, r 4; random base
weights, norm weights 1 + N(0, 0.2^2), random non-zero LoRA A and B, never B = 0), in f32 and bf16:

* the output, dx, the 14 LoRA gradients and both norm-weight gradients match ``backend="xla"`` (tolerances below);
* ``jaxgrad.verify`` judges the pallas block's VJP against ``jax.grad`` of the plain reference block: its own verdict
  (what ``assert_vjp_matches`` asserts) and the normwise gates ``tests/test_lora_block.py`` applies to the xla
  backend (``assert_block_vjp_verified``: as called within 10x the reference's own rounding, float64 within 1e-12),
  which are the gates that bite on this block (its sum-of-|terms| overflows, so the per-entry and z-score gates
  pass trivially);
* NF4 base weights with a partial last block (gate / up ``[145, 96]``: 13,920 elements = 217 blocks of 64 + 32;
  down ``[96, 145]``: rows starting mid-byte; q double-quantised, blocksize 128) go through the NF4 kernels, never
  form the dequantised weight, and match ``backend="xla"``;
* float64 (interpret mode) matches ``jax.grad`` of the reference to 1e-10 of each gradient's max;
* the block saves the same things; an unknown backend is refused by name.

A ``gpu`` test runs the same block compiled by Triton (``interpret=False``) and judges it with the verifier.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from jaxgrad.lora.kernels import BlockKernels
from jaxgrad.lora.model import apply
from jaxgrad.lora.nf4 import nf4_quantize
from tests.test_lora_block import _split_norms, assert_block_vjp_verified

block_mod = importlib.import_module("jaxgrad.lora.block")

# f32 / bf16 tolerance comparisons assume exact f32 dots: on a GPU machine these CPU tests run on its CPU
pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")

CFG = LlamaConfig(hidden_size=96, intermediate_size=145, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                  rms_norm_eps=1e-5, max_position_embeddings=128, vocab_size=11)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
B, T = 2, 77
NORMS = ("input_layernorm", "post_attention_layernorm")
_H, _I, _Q, _KV = (CFG.hidden_size, CFG.intermediate_size, CFG.num_attention_heads * CFG.head_dim,
                  CFG.num_key_value_heads * CFG.head_dim)
SHAPES = {("self_attn", "q_proj"): (_Q, _H), ("self_attn", "k_proj"): (_KV, _H), ("self_attn", "v_proj"): (_KV, _H),
          ("self_attn", "o_proj"): (_H, _Q), ("mlp", "gate_proj"): (_I, _H), ("mlp", "up_proj"): (_I, _H),
          ("mlp", "down_proj"): (_H, _I)}  # HF [out, in]
NF4 = {("self_attn", "q_proj"): dict(blocksize=128, double_quant=True),
       ("self_attn", "o_proj"): dict(blocksize=64), ("mlp", "gate_proj"): dict(blocksize=64),
       ("mlp", "up_proj"): dict(blocksize=64), ("mlp", "down_proj"): dict(blocksize=64)}

# |pallas - xla| / max|xla| per leaf. Both backends compute the same equations; they differ only in where sums are
# rounded. f32: the kernels sum the row statistics and the NF4 tiles in another order (a few f32 roundings of the
# result, u = 6e-8); measured <= 7.9e-7, the size of either backend's own error against float64 (3.3e-7 to
# 1.3e-6): bound 4e-6 (~64 u). bf16: each bf16 activation (h1, h2, every projection's output) is one rounding of an
# fp32 value the two backends summed in different orders, so an entry can land one bf16 ulp apart and that ulp
# propagates through the rest of the block; measured <= 8.5e-3 (NF4 base: 9.3e-3), ~2 ulp of 2^-8 and within the
# xla backend's own error against float64 (5.1e-3 to 1.3e-2): bound 2e-2 (~5 ulp).
TOL = {jnp.float32: 4e-6, jnp.bfloat16: 2e-2}


def make_block(seed, dtype, nf4=False):
    """Base weights ~ N(0, 1/hidden), norm weights 1 + N(0, 0.2^2), A ~ U(+-1/sqrt(in)) and B ~ U(+-1/sqrt(r))
    (PEFT's ``init_lora_weights=False``: both random, non-zero), x ~ N(0, 1); NumPy draws (no per-shape compiles).
    ``nf4``: the projections in :data:`NF4` quantised from their f32 values."""
    rng = np.random.default_rng(seed)
    params, lora = {n: {"weight": 1 + 0.2 * rng.standard_normal(CFG.hidden_size)} for n in NORMS}, {}
    for g, n in PROJECTIONS:
        out_f, in_f = SHAPES[(g, n)]
        w = rng.standard_normal((out_f, in_f)) / np.sqrt(CFG.hidden_size)
        params.setdefault(g, {})[n] = {"weight": nf4_quantize(np.float32(w), **NF4[(g, n)]) if nf4 and (g, n) in NF4
                                       else jnp.asarray(w, dtype)}
        lora.setdefault(g, {})[n] = {"lora_A": rng.uniform(-1, 1, (LCFG.r, in_f)) / np.sqrt(in_f),
                                     "lora_B": rng.uniform(-1, 1, (out_f, LCFG.r)) / np.sqrt(LCFG.r)}
    cast = functools.partial(jax.tree.map, lambda a: jnp.asarray(a, dtype))
    for n in NORMS:
        params[n] = cast(params[n])
    return params, cast(lora), jnp.asarray(rng.standard_normal((B, T, CFG.hidden_size)), dtype)


def _run(backend, params, lora, x, ct, interpret=True):
    """(y, dx, LoRA gradients, norm-weight gradients) of the block with ``backend`` (jit, one VJP)."""
    kw = dict(interpret=interpret) if backend == "pallas" else {}
    f = jax.jit(lambda p, ad, x: block(p, ad, x, CFG, LCFG, backend=backend, **kw))
    y, pullback = jax.vjp(f, params, lora, x)
    dp, dl, dx = pullback(ct)
    return {"y": y, "dx": dx, "lora": dl, "norms": _split_norms(dp)[1]}


def _rel(got, want):
    """max |got - want| / max |want| per leaf, in float64."""
    def rel(g, w):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        return float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
    return jax.tree.map(rel, got, want)


def _assert_backends_agree(dtype, nf4, seed):
    params, lora, x = make_block(seed, dtype, nf4)
    ct = jax.random.normal(jax.random.key(seed + 100), x.shape).astype(dtype)
    got, want = _run("pallas", params, lora, x, ct), _run("xla", params, lora, x, ct)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(a.dtype == b.dtype == dtype for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert len(jax.tree.leaves(got["lora"])) == 14 and all(float(jnp.max(jnp.abs(g))) > 0
                                                            for g in jax.tree.leaves(got))
    errs = _rel(got, want)
    assert max(jax.tree.leaves(errs)) <= TOL[dtype], errs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_block_matches_xla_block(dtype):
    _assert_backends_agree(dtype, nf4=False, seed=0)


def test_pallas_block_with_nf4_base_and_partial_last_block_matches_xla_block():
    # bf16, QLoRA's dtype (f32 and f64 NF4 are exercised by the float64 test and tests/test_nf4_matmul.py)
    assert CFG.intermediate_size * CFG.hidden_size % 64 == 32  # gate / up / down end in a partial 32-element block
    _assert_backends_agree(jnp.bfloat16, nf4=True, seed=1)


def test_nf4_base_is_never_dequantised_in_the_pallas_graph():
    params, lora, x = make_block(2, jnp.bfloat16, nf4=True)

    def text(backend):  # forward and backward jaxprs (kernel bodies included), traced only, never compiled
        kw = dict(interpret=True) if backend == "pallas" else {}
        f = lambda ad, x: block(params, ad, x, CFG, LCFG, backend=backend, **kw)  # noqa: E731
        return str(jax.make_jaxpr(lambda ad, x, c: jax.vjp(f, ad, x)[1](c))(lora, x, x))

    dense = ("[145,96]", "[96,145]", "[13920]")  # gate / up / down as matrices, or their unpacked codes
    assert not any(d in text("pallas") for d in dense)
    assert all(d in text("xla") for d in dense)  # the probe sees them where the XLA path does dequantise


def test_pallas_block_runs_swiglu_and_rmsnorm_as_kernels():
    # the forward and backward jaxprs name the Pallas kernels: SwiGLU and both RMSNorms, each way
    params, lora, x = make_block(5, jnp.bfloat16)
    f = lambda ad, x: block(params, ad, x, CFG, LCFG, backend="pallas", interpret=True)  # noqa: E731
    text = str(jax.make_jaxpr(lambda ad, x, c: jax.vjp(f, ad, x)[1](c))(lora, x, x))
    assert "swiglu_fwd" in text and "swiglu_bwd" in text
    xla = lambda ad, x: block(params, ad, x, CFG, LCFG)  # noqa: E731
    assert "swiglu_fwd" not in str(jax.make_jaxpr(lambda ad, x, c: jax.vjp(xla, ad, x)[1](c))(lora, x, x))


def test_pallas_block_float64_equals_jax_grad_of_reference():
    # float64 runs only in interpret mode; dense q/k/v and NF4 o/gate/up/down (partial last blocks) together
    with jax.enable_x64(True):
        params, lora, x = make_block(3, jnp.float64, nf4=True)
        ct = jax.random.normal(jax.random.key(4), x.shape, jnp.float64)
        got = _run("pallas", params, lora, x, ct)
        y_ref, pullback = jax.vjp(jax.jit(lambda p, ad, x: block_reference(p, ad, x, CFG, LCFG)), params, lora, x)
        dp, dl, dx = pullback(ct)
        want = {"y": y_ref, "dx": dx, "lora": dl, "norms": _split_norms(dp)[1]}
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves(got))
        errs = _rel(got, want)
        assert max(jax.tree.leaves(errs)) < 1e-10, errs  # measured 1.8e-15


def _verify(dtype, nf4, seed, interpret):
    """The pallas block's VJP (of x, the adapters and the norm weights; frozen projections closed over) by
    ``jaxgrad.verify`` against the plain reference block: ``check_vjp``'s verdict (``assert_vjp_matches``) and the
    block's normwise gates, from one verifier run."""
    params, lora, x = make_block(seed, dtype, nf4)
    frozen, norms = _split_norms(params)

    def fn(x, lora, norms):
        return block({**frozen, **norms}, lora, x, CFG, LCFG, backend="pallas", interpret=interpret)

    def ref(x, lora, norms):
        return block_reference({**frozen, **norms}, lora, x, CFG, LCFG)

    report = assert_block_vjp_verified(fn, ref, x, lora, norms, arg_names=("x", "lora", "norms"))
    assert report.passed, "VJP check failed:\n" + str(report)  # = assert_vjp_matches(fn, ref, ...), same run


@pytest.mark.slow  # ~55-65 s each on this 2-core CPU: the verifier's float64 magnitudes and rounding replicas
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_block_vjp_verified(dtype):
    _verify(dtype, nf4=False, seed=5, interpret=True)


def test_pallas_block_saves_the_same_as_xla():
    params, lora, x = make_block(6, jnp.bfloat16)
    for kern in (BlockKernels("xla"), BlockKernels("pallas", True)):
        _, res = jax.eval_shape(lambda p, ad, x, k=kern: block_mod._block_fwd(CFG, LCFG, "xla", p, ad, x, None, None,
                                                                              None, k), params, lora, x)
        saved_params, saved_lora, saved_x, positions, mask, key, x2, r1, r2, lse = res
        assert jax.tree.structure(saved_params) == jax.tree.structure(params)
        assert jax.tree.structure(saved_lora) == jax.tree.structure(lora) and saved_x.shape == x.shape
        assert positions is mask is key is None
        assert r1.dtype == r2.dtype == lse.dtype == jnp.float32 and r1.shape == r2.shape == (B, T)
        assert lse.shape == (B, CFG.num_key_value_heads, CFG.num_groups, T)


def test_interpret_is_automatic_off_gpu_and_bad_backend_is_named():
    params, lora, x = make_block(7, jnp.float32)
    if jax.default_backend() != "gpu":  # interpret=None: interpret mode here, as in jaxgrad.pallas_backend
        auto, forced = (jax.jit(lambda p, ad, x, i=i: block(p, ad, x, CFG, LCFG, backend="pallas", interpret=i))
                        for i in (None, True))
        np.testing.assert_array_equal(auto(params, lora, x), forced(params, lora, x))
    with pytest.raises(ValueError, match="block: 'backend' must be one of 'xla', 'reference', 'pallas', 'mosaic', got 'triton'"):
        block(params, lora, x, CFG, LCFG, backend="triton")


def test_model_apply_passes_the_backend_to_its_blocks():
    # apply(backend="pallas") runs its blocks with the kernels (interpret=None: interpret mode off-GPU); one layer,
    # forward only, f32 logits within the f32 tolerance of backend="xla"
    if jax.default_backend() == "gpu":
        pytest.skip("interpret=None compiles for the GPU there; this test is about the CPU's automatic interpret mode")
    params, lora, _ = make_block(9, jnp.float32)
    rng = np.random.default_rng(9)
    emb, head = (jnp.asarray(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)), jnp.float32) for _ in range(2))
    model = {"embed_tokens": {"weight": emb}, "layers": [params], "norm": {"weight": jnp.ones(CFG.hidden_size)},
             "lm_head": {"weight": head}}
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)))
    logits = {b: jax.jit(lambda m, ad, b=b: apply(m, ad, ids, CFG, LCFG, backend=b))(model, {"layers": [lora]})
              for b in ("xla", "pallas")}
    err = _rel(logits["pallas"], logits["xla"])
    assert err <= TOL[jnp.float32], err


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "nf4"), [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)],
                         ids=["f32", "bf16", "bf16-nf4"])
def test_gpu_compiled_pallas_block_vjp_verified(dtype, nf4):
    _verify(dtype, nf4=nf4, seed=8, interpret=False)
