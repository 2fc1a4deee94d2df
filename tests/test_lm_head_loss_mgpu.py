"""The LM head's Mosaic GPU kernel (jaxgrad.ops.lm_head_loss_mgpu) and the fused loss's ``backend="mosaic"``: the
per-tile softmax statistics give the rows' log-sum-exp and softmax exactly; the loss and ``dh`` assembled from them
equal jax.grad of the plain loss (float64, the kernel's plain-JAX stand-in) at sizes no tile or chunk divides; the
kernel lowers for Hopper at odd and real sizes on any machine; what the backend does not take is named; and on the
GPU the kernel equals its formulas and the loss is verified at bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.ops import lm_head_loss_mgpu as mgpu
from jaxgrad.ops.lm_head_loss import lm_head_loss, lm_head_loss_reference

pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")


def _inputs(seed, dtype, b, t, hidden, vocab, ignore_every=5):
    kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (b, t, hidden), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (vocab, hidden)) * hidden ** -0.5 * 3).astype(dtype)  # logits of scale ~3
    labels = np.array(jax.random.randint(ky, (b, t), 0, vocab))
    labels.reshape(-1)[::ignore_every] = -100
    return h, w, jnp.asarray(labels)


@pytest.fixture
def kernel_stand_in(monkeypatch):
    """The kernel replaced by its plain-JAX formulas with 16-column tiles (several tiles, the last one partial at
    vocabulary 37), any dtype accepted: the code around the kernel, testable in float64 on a CPU."""
    monkeypatch.setattr(mgpu, "lm_head_softmax_tiles_mgpu", lambda h, w: mgpu.softmax_tiles_reference(h, w, 16))
    monkeypatch.setattr(mgpu, "supported", lambda h, w: None)


# ---------------------------------------------------------------------------------------------------------------
# The tile statistics are the softmax (the math the kernel's epilogue and row_statistics implement)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,tile_n", [(37, 16), (64, 16), (5, 128)])
def test_tile_statistics_give_the_rows_log_sum_exp_and_softmax_float64(vocab, tile_n):
    with jax.enable_x64():
        h, w, _ = _inputs(0, jnp.float64, 1, 9, 12, vocab)
        h = h[0]
        p, m_t, s_t = mgpu.softmax_tiles_reference(h, w, tile_n)
        tiles = -(-vocab // tile_n)
        assert p.shape == (9, tiles * tile_n) and m_t.shape == s_t.shape == (tiles, 9)
        m, s, factor = mgpu.row_statistics(m_t, s_t)
        z = h @ w.T
        np.testing.assert_allclose(m + jnp.log(s), jax.nn.logsumexp(z, axis=-1), rtol=1e-14)
        probs = (p.reshape(9, tiles, tile_n) * factor[:, :, None]).reshape(9, -1)
        np.testing.assert_allclose(probs[:, :vocab], jax.nn.softmax(z, axis=-1), rtol=1e-13, atol=1e-16)
        assert not np.asarray(probs[:, vocab:]).any()  # the padding columns carry no probability


# ---------------------------------------------------------------------------------------------------------------
# backend="mosaic" around the kernel: jax.grad of the plain loss
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [4, 1024])
def test_the_mosaic_backend_is_jax_grad_of_the_reference_with_the_head_stopped_float64(kernel_stand_in,
                                                                                      chunk_tokens):
    with jax.enable_x64():
        h, w, labels = _inputs(1, jnp.float64, 2, 7, 12, 37)

        def loss(h, backend):
            return lm_head_loss(h, w, labels, chunk_tokens=chunk_tokens, head_grad=False, backend=backend)[0]

        value, dh = jax.value_and_grad(loss)(h, "mosaic")
        want, dh_want = jax.value_and_grad(lambda h: lm_head_loss_reference(h, w, labels)[0])(h)
        np.testing.assert_allclose(value, want, rtol=1e-13)
        np.testing.assert_allclose(dh, dh_want, rtol=1e-11, atol=1e-14)
        g = jax.grad(lambda h: 2.5 * loss(h, "mosaic"))(h)  # the saved gradient is scaled by the cotangent
        np.testing.assert_allclose(g, 2.5 * dh_want, rtol=1e-11, atol=1e-14)


def test_the_mosaic_backend_counts_only_fresh_rows_of_the_overlapping_last_chunk(kernel_stand_in):
    # 14 rows in 4-row chunks: the last chunk is rows 10..13, rows 10 and 11 done by the third
    with jax.enable_x64():
        h, w, labels = _inputs(2, jnp.float64, 2, 7, 12, 37, ignore_every=100)
        got = lm_head_loss(h, w, labels, chunk_tokens=4, head_grad=False, backend="mosaic")
        want = lm_head_loss(h, w, labels, chunk_tokens=4, head_grad=False, backend="xla")
        np.testing.assert_allclose(got[0], want[0], rtol=1e-13)
        assert int(got[1]) == int(want[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="triton"), r"'backend' must be one of \('xla', 'mosaic'\), got 'triton'"),
    (dict(backend="mosaic", head_grad=True), "frozen head's loss; it needs head_grad=False"),
    (dict(backend="mosaic", head_grad=False, chunk_vocab=16), "needs chunk_vocab=None, got 16"),
    (dict(backend="mosaic", head_grad=False), r"'h' and 'w' must share one 16-bit dtype \(bf16 or f16\), got "
                                              "float32 and float32"),
])
def test_what_the_mosaic_backend_does_not_take_is_named(kwargs, match):
    h, w, labels = _inputs(3, jnp.float32, 2, 7, 12, 37)
    with pytest.raises(ValueError, match=match):
        lm_head_loss(h, w, labels, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The kernel lowers for Hopper on any machine
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,v,hidden", [(256, 128, 64), (1024, 128256, 2048), (512, 384, 4096)])
def test_the_kernel_lowers_for_hopper_on_any_machine(m, v, hidden):
    spec = (jax.ShapeDtypeStruct((m, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((v, hidden), jnp.bfloat16))
    low = mgpu._call.trace(*spec, vocab=v - 3, config=mgpu.TileConfig(), num_sms=132).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()


def test_odd_sizes_lower_through_padding_and_come_back_at_their_own_shape(monkeypatch):
    monkeypatch.setattr(mgpu, "_num_sms", lambda: 132)
    h = jax.ShapeDtypeStruct((77, 96), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1000, 96), jnp.bfloat16)
    out = jax.eval_shape(mgpu.lm_head_softmax_tiles_mgpu, h, w)
    assert [o.shape for o in out] == [(77, 1024), (8, 77), (8, 77)]
    text = jax.jit(mgpu.lm_head_softmax_tiles_mgpu).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ---------------------------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,v,hidden", [(77, 1000, 96), (256, 128, 64), (1024, 8192 + 77, 2048)])
def test_gpu_kernel_equals_its_formulas(m, v, hidden, dtype):
    h, w, _ = _inputs(4, dtype, 1, m, hidden, v)
    h = h[0]
    p, m_t, s_t = jax.jit(mgpu.lm_head_softmax_tiles_mgpu)(h, w)
    p_ref, m_ref, s_ref = mgpu.softmax_tiles_reference(h, w)
    # the same bf16 products summed in fp32 in another order: logits agree to ~1e-6 of their scale; exp2 vs exp
    np.testing.assert_allclose(np.asarray(m_t), np.asarray(m_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p), np.asarray(p_ref), rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(s_t), np.asarray(s_ref), rtol=2e-5)
    assert not np.asarray(p[:, v:]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,hidden,vocab,chunk", [(2, 77, 96, 1000, 64), (2, 1024, 2048, 128256, 1024)])
def test_gpu_mosaic_backend_is_verified_at_bf16_and_agrees_with_xla(b, t, hidden, vocab, chunk):
    from jaxgrad.verify import assert_vjp_matches

    h, w, labels = _inputs(5, jnp.bfloat16, b, t, hidden, vocab)

    def loss(backend):
        return lambda h: lm_head_loss(h, w, labels, chunk_tokens=chunk, head_grad=False, backend=backend)[0]

    got, dh = jax.jit(jax.value_and_grad(loss("mosaic")))(h)
    want, dh_xla = jax.jit(jax.value_and_grad(loss("xla")))(h)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    dh, dh_xla = np.asarray(dh, np.float32), np.asarray(dh_xla, np.float32)
    assert np.linalg.norm(dh - dh_xla) <= 1e-2 * np.linalg.norm(dh_xla)  # both round dZ to bf16 once or twice
    if t <= 128:
        assert_vjp_matches(loss("mosaic"), lambda h: lm_head_loss_reference(h, w.astype(h.dtype), labels)[0], h,
                           arg_names=("h",))


def test_the_head_follows_the_blocks_backend_where_it_qualifies(monkeypatch):
    from jaxgrad.ops import lm_head_loss as mod

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert mod.backend_beside("mosaic", jnp.bfloat16, head_grad=False) == "mosaic"
    assert mod.backend_beside("mosaic", jnp.float16, head_grad=False) == "mosaic"
    for backend, dtype, head_grad, chunk_vocab in (("xla", jnp.bfloat16, False, None),
                                                   ("pallas", jnp.bfloat16, False, None),
                                                   ("mosaic", jnp.float32, False, None),  # f32: TF32 on XLA's dots
                                                   ("mosaic", jnp.bfloat16, True, None),  # a trained head
                                                   ("mosaic", jnp.bfloat16, False, 32768)):  # vocabulary chunks
        assert mod.backend_beside(backend, dtype, head_grad, chunk_vocab) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert mod.backend_beside("mosaic", jnp.bfloat16, head_grad=False) == "xla"


@pytest.mark.gpu
def test_gpu_the_lora_models_loss_on_mosaic_takes_the_kernel_and_agrees_with_xla(monkeypatch):
    from jaxgrad.lora.config import LlamaConfig, LoraConfig
    from jaxgrad.lora.model import causal_lm_loss_fused, count_items, init, init_lora
    from jaxgrad.ops import lm_head_loss as mod

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=256, vocab_size=1000, num_hidden_layers=2)
    lcfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    k1, k2, k3 = jax.random.split(jax.random.key(6), 3)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init(k1, cfg))
    lora = init_lora(k2, cfg, lcfg)  # fp32 adapters over the bf16 base, as the CLI trains them
    ids = jax.random.randint(k3, (2, 200), 0, cfg.vocab_size)
    n = count_items(ids)
    calls = []
    kernel = mgpu.lm_head_softmax_tiles_mgpu
    monkeypatch.setattr(mgpu, "lm_head_softmax_tiles_mgpu", lambda h, w: calls.append(h.shape) or kernel(h, w))

    def loss(backend):
        return jax.jit(jax.value_and_grad(lambda lora: causal_lm_loss_fused(
            params, lora, ids, ids, n, cfg, lcfg, chunk_tokens=128, backend=backend, attention="xla")))

    got, g = loss("mosaic")(lora)
    assert calls, "backend='mosaic' did not reach the LM head's kernel"
    assert mod.backend_beside("mosaic", jnp.bfloat16, False) == "mosaic"
    want, r = loss("xla")(lora)
    assert abs(float(got) - float(want)) <= 2e-2 * abs(float(want))  # the blocks' Mosaic GEMMs round differently
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 5e-2 * np.linalg.norm(b)


@pytest.mark.parametrize("mode, dtype, kernel", [("lora", "bfloat16", True), ("lora", "float32", False),
                                                 ("full", "bfloat16", False)])
def test_the_run_says_whether_its_head_takes_the_kernel(monkeypatch, mode, dtype, kernel):
    from jaxgrad.lora.task import make_task
    from jaxgrad.lora.task_config import LoraFit

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fit = LoraFit(mode=mode, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, seq_len=16, n_bytes=4096, dtype=dtype)
    describe = make_task(fit, device=("gpu", "9.0")).describe
    assert "fused LM head (1024-token chunks" in describe
    assert ("mosaic kernel" in describe) == kernel, describe
