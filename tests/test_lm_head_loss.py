"""The fused LM head + causal cross-entropy (jaxgrad.ops.lm_head_loss): its chunked custom VJP equals jax.grad of the
plain loss over the whole logits (float64, 1e-12), for every chunking (tokens and vocabulary that no chunk divides, a
chunk of ignored labels, every label ignored), tied and untied heads; float32 and bf16 are proven by jaxgrad.verify;
the compiled forward + backward holds no [tokens, vocab] logits; bad input is named; and the model's fused loss
(jaxgrad.lora.model.causal_lm_loss_fused) equals causal_lm_loss(apply(...)) with its gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora import model as model_mod
from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import (IGNORE_INDEX, apply, causal_lm_loss, causal_lm_loss_fused, count_items, head_weight,
                                hidden_states, init, init_lora, token_losses)
from jaxgrad.ops.lm_head_loss import lm_head_loss, lm_head_loss_reference
from jaxgrad.verify import assert_vjp_matches

pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")

B, T, H, V = 2, 7, 12, 37  # B * T = 14 token rows: 4-token chunks do not divide them, 16-row vocab chunks not V


def _inputs(seed, dtype, b=B, t=T, hidden=H, vocab=V, ignored=((0, 2), (1, 4))):
    kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (b, t, hidden), dtype)
    w = (jax.random.normal(kw, (vocab, hidden)) * hidden ** -0.5).astype(dtype)
    labels = np.array(jax.random.randint(ky, (b, t), 0, vocab))
    for at in ignored:
        labels[at] = IGNORE_INDEX
    return h, w, jnp.asarray(labels)


def _rel(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _value_and_grads(fn, h, w, labels):
    return jax.value_and_grad(lambda h, w: fn(h, w, labels)[0], argnums=(0, 1))(h, w)


# ---------------------------------------------------------------------------------------------------------------
# The reference is the model's loss
# ---------------------------------------------------------------------------------------------------------------
def test_the_reference_is_the_models_token_loss_sum_over_the_head_logits():
    with jax.enable_x64(True):
        h, w, labels = _inputs(0, jnp.float64)
        total, count = lm_head_loss_reference(h, w, labels)
        losses, valid = token_losses(jnp.einsum("bth,vh->btv", h, w), labels)
        assert float(total) == pytest.approx(float(jnp.sum(losses)), rel=1e-15)
        assert int(count) == int(jnp.sum(valid)) == count_items(labels) == B * (T - 1) - 2
        assert total.dtype == jnp.float64 and count.dtype == jnp.int32


# ---------------------------------------------------------------------------------------------------------------
# Float64: the custom VJP is jax.grad of the reference
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_vocab", [None, 16, 1])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 13, 14, 100])
def test_value_and_gradients_equal_jax_grad_of_the_reference_float64(chunk_tokens, chunk_vocab):
    with jax.enable_x64(True):
        h, w, labels = _inputs(1, jnp.float64)
        fused = functools.partial(lm_head_loss, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
        (got, (dh, dw)), (want, (rh, rw)) = (_value_and_grads(fused, h, w, labels),
                                             _value_and_grads(lm_head_loss_reference, h, w, labels))
        assert abs(float(got - want)) <= 1e-13 * abs(float(want))
        assert _rel(dh, rh) < 1e-12 and _rel(dw, rw) < 1e-12
        assert int(fused(h, w, labels)[1]) == int(lm_head_loss_reference(h, w, labels)[1])
        # the last position of each row predicts nothing: no gradient reaches it
        assert not np.any(np.asarray(dh[:, -1]))


def test_a_chunk_of_ignored_labels_and_a_batch_of_them():
    with jax.enable_x64(True):
        # rows 4..7 of the 14 (a whole 4-token chunk) predict ignored labels; their dh is exactly zero
        ignored = [(0, t) for t in range(5, 7)] + [(1, t) for t in range(0, 3)]
        h, w, labels = _inputs(2, jnp.float64, ignored=ignored)
        fused = functools.partial(lm_head_loss, chunk_tokens=4)
        (got, (dh, dw)), (want, (rh, rw)) = (_value_and_grads(fused, h, w, labels),
                                             _value_and_grads(lm_head_loss_reference, h, w, labels))
        assert abs(float(got - want)) <= 1e-13 * abs(float(want))
        assert _rel(dh, rh) < 1e-12 and _rel(dw, rw) < 1e-12
        assert not np.any(np.asarray(dh.reshape(-1, H)[4:8]))
        # every label ignored: a zero loss, nothing counted, zero gradients
        none = jnp.full((B, T), IGNORE_INDEX)
        total, (dh, dw) = _value_and_grads(fused, h, w, none)
        assert float(total) == 0.0 and int(fused(h, w, none)[1]) == 0
        assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_a_tied_head_gets_both_gradients_the_heads_and_the_embeddings():
    """Tied: ``w`` is also the embedding that made ``h``; the gradient through both uses adds up as jax.grad's."""
    with jax.enable_x64(True):
        _, emb, labels = _inputs(3, jnp.float64)
        ids = jnp.asarray(np.random.default_rng(3).integers(0, V, (B, T)))

        def tied(loss):
            def f(emb):
                h = jnp.tanh(emb[ids] * 3.0)  # a stand-in for the decoder stack
                return loss(h, emb, labels)[0]
            return jax.value_and_grad(f)(emb)
        got, g = tied(functools.partial(lm_head_loss, chunk_tokens=4, chunk_vocab=16))
        want, r = tied(lm_head_loss_reference)
        assert abs(float(got - want)) <= 1e-13 * abs(float(want)) and _rel(g, r) < 1e-12


def test_under_jit_an_out_of_range_label_makes_the_loss_and_the_gradient_nan():
    with jax.enable_x64(True):
        h, w, labels = _inputs(4, jnp.float64)
        bad = labels.at[1, 3].set(V)

        @jax.jit
        def both(h, w, labels):
            return (jax.value_and_grad(lambda h, w: lm_head_loss(h, w, labels, chunk_tokens=4)[0], (0, 1))(h, w),
                    lm_head_loss_reference(h, w, labels)[0])
        (total, (dh, dw)), ref = both(h, w, bad)
        assert np.isnan(float(total)) and np.isnan(float(ref))
        assert np.isnan(np.asarray(dh[1, 2])).all() and np.isnan(np.asarray(dw)).all()
        assert np.isfinite(np.asarray(dh[0])).all()  # the other tokens' rows of dh are untouched
        (total, _), _ = both(h, w, labels)
        assert np.isfinite(float(total))


# ---------------------------------------------------------------------------------------------------------------
# A frozen head (head_grad=False): dh formed in the forward, w a constant
# ---------------------------------------------------------------------------------------------------------------
def _frozen_reference(h, w, labels):
    return lm_head_loss_reference(h, jax.lax.stop_gradient(w), labels)


@pytest.mark.parametrize("chunk_vocab", [None, 16, 1])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 13, 100])
def test_a_frozen_head_is_jax_grad_of_the_reference_with_the_head_stopped_float64(chunk_tokens, chunk_vocab):
    with jax.enable_x64(True):
        h, w, labels = _inputs(11, jnp.float64)
        frozen = functools.partial(lm_head_loss, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, head_grad=False)
        (got, (dh, dw)), (want, (rh, _)) = (_value_and_grads(frozen, h, w, labels),
                                            _value_and_grads(lm_head_loss_reference, h, w, labels))
        assert abs(float(got - want)) <= 1e-13 * abs(float(want))
        assert _rel(dh, rh) < 1e-12
        assert not np.any(np.asarray(dw))  # stop_gradient(w): zero by definition, as the reference's
        assert not np.any(np.asarray(_value_and_grads(_frozen_reference, h, w, labels)[1][1]))
        assert not np.any(np.asarray(dh[:, -1]))


def test_a_frozen_head_scales_its_saved_gradient_by_the_cotangent_and_keeps_ignored_rows_at_zero():
    with jax.enable_x64(True):
        ignored = [(0, t) for t in range(5, 7)] + [(1, t) for t in range(0, 3)]
        h, w, labels = _inputs(12, jnp.float64, ignored=ignored)
        n = count_items(labels)

        def mean(loss):  # the model's normalisation: the cotangent of the sum is 1 / n_items
            return jax.grad(lambda h: 3.0 * loss(h, w, labels)[0] / n)(h)
        got = mean(functools.partial(lm_head_loss, chunk_tokens=4, head_grad=False))
        want = mean(lm_head_loss_reference)
        assert _rel(got, want) < 1e-12
        assert not np.any(np.asarray(got.reshape(-1, H)[4:8]))


def test_a_frozen_head_under_jit_makes_an_out_of_range_labels_row_nan_and_only_it():
    with jax.enable_x64(True):
        h, w, labels = _inputs(13, jnp.float64)
        bad = labels.at[1, 3].set(V)
        step = jax.jit(jax.value_and_grad(lambda h, labels: lm_head_loss(h, w, labels, chunk_tokens=4,
                                                                         head_grad=False)[0]))
        total, dh = step(h, bad)
        assert np.isnan(float(total)) and np.isnan(np.asarray(dh[1, 2])).all()
        assert np.isfinite(np.asarray(dh[0])).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_vocab", [None, 16])
def test_a_frozen_head_is_verified_in_float32_and_bf16(dtype, chunk_vocab):
    h, w, labels = _inputs(14, dtype)
    # a function of h alone (the head a constant of h's dtype: the verifier's float64 re-run casts it exactly)
    assert_vjp_matches(lambda h: lm_head_loss(h, w.astype(h.dtype), labels, chunk_tokens=4, chunk_vocab=chunk_vocab,
                                              head_grad=False)[0],
                       lambda h: lm_head_loss_reference(h, w.astype(h.dtype), labels)[0], h, arg_names=("h",))


# ---------------------------------------------------------------------------------------------------------------
# float32 and bf16: jaxgrad.verify
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_vocab", [None, 16])
def test_the_custom_vjp_is_verified_in_float32_and_bf16(dtype, chunk_vocab):
    h, w, labels = _inputs(5, dtype)
    assert_vjp_matches(lambda h, w: lm_head_loss(h, w, labels, chunk_tokens=4, chunk_vocab=chunk_vocab)[0],
                       lambda h, w: lm_head_loss_reference(h, w, labels)[0], h, w, arg_names=("h", "w"))


def test_bf16_inputs_give_an_fp32_loss_and_gradients_in_the_inputs_dtype():
    h, w, labels = _inputs(6, jnp.bfloat16)
    total, (dh, dw) = _value_and_grads(functools.partial(lm_head_loss, chunk_tokens=4), h, w, labels)
    assert total.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    want = lm_head_loss_reference(h.astype(jnp.float32), w.astype(jnp.float32), labels)[0]
    assert abs(float(total - want)) <= 1e-5 * abs(float(want))  # fp32 logits of the bf16 operands, as the reference


# ---------------------------------------------------------------------------------------------------------------
# Memory: no [tokens, vocab] logits
# ---------------------------------------------------------------------------------------------------------------
def test_the_compiled_step_holds_no_token_by_vocab_logits():
    """T = 2048, V = 4096, H = 64, float32: one [T, V] fp32 logits array is 32 MiB. Measured on the CPU: the plain
    loss's forward + backward temporaries are 2.0x of it (the logits and their gradient), the fused loss's with
    256-token chunks 0.16x (one chunk's logits and softmax; 0.13x with the head frozen: XLA drops the dW product and
    its fp32 accumulator) and 0.065x with 1024-row vocabulary chunks too; 0.25x with the head frozen and dh formed in
    the forward (``head_grad=False``)."""
    t, v, hidden = 2048, 4096, 64
    args = (jax.ShapeDtypeStruct((1, t, hidden), jnp.float32), jax.ShapeDtypeStruct((v, hidden), jnp.float32),
            jax.ShapeDtypeStruct((1, t), jnp.int32))
    logits = t * v * 4

    def temp(loss, argnums=(0, 1)):
        step = jax.jit(jax.value_and_grad(lambda h, w, labels: loss(h, w, labels)[0], argnums=argnums))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    plain = temp(lm_head_loss_reference)
    fused = temp(functools.partial(lm_head_loss, chunk_tokens=256))
    fused_vocab = temp(functools.partial(lm_head_loss, chunk_tokens=256, chunk_vocab=1024))
    assert plain > logits, plain / logits
    assert fused < logits / 4, fused / logits
    assert fused_vocab < fused, (fused_vocab / logits, fused / logits)
    # a frozen head (LoRA): the dW product and its fp32 accumulator [V, H] are dropped from the compiled step
    frozen_head = temp(functools.partial(lm_head_loss, chunk_tokens=256), argnums=0)
    assert fused - frozen_head >= v * hidden * 4, (fused, frozen_head)
    # head_grad=False: dh made in the forward (measured 0.25x: a chunk's logits, its softmax and dZ alive together,
    # and the saved dh [T, H] fp32, 1/64 of the logits here)
    grad_in_forward = temp(functools.partial(lm_head_loss, chunk_tokens=256, head_grad=False), argnums=0)
    assert grad_in_forward < logits / 2, grad_in_forward / logits


# ---------------------------------------------------------------------------------------------------------------
# Bad input, named
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", [lm_head_loss, lm_head_loss_reference])
def test_bad_input_is_named(loss):
    h, w, labels = _inputs(7, jnp.float32)
    cases = [
        ((h[0], w, labels), ValueError, "'h' must be \\[batch, seq, hidden\\]"),
        ((h, w[:, :5], labels), ValueError, "'w' must be \\[vocab, hidden\\] with hidden = h.shape\\[2\\] = 12"),
        ((h, w[None], labels), ValueError, "'w' must be \\[vocab, hidden\\]"),
        ((h, w.astype(jnp.bfloat16), labels), TypeError, "'h' and 'w' must have the same dtype"),
        ((h, w, labels[:, 1:]), ValueError, "'labels' must be \\[batch, seq\\] = \\(2, 7\\)"),
        ((h, w, labels.astype(jnp.float32)), TypeError, "'labels' must be integers"),
        ((h.astype(jnp.int32), w, labels), TypeError, "'h' must be a floating-point array"),
        ((h, w, labels.at[1, 3].set(V)), ValueError, f"'labels' must lie in \\[0, {V}\\).*got {V} at \\[1, 3\\]"),
        ((h, w, labels.at[0, 1].set(-1)), ValueError, "'labels' must lie in .* or be -100 \\(ignored\\), got -1"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            loss(*args)


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk_tokens": 0}, "'chunk_tokens' must be an int >= 1, got 0"),
    ({"chunk_tokens": 2.5}, "'chunk_tokens' must be an int >= 1, got 2.5"),
    ({"chunk_tokens": True}, "'chunk_tokens' must be an int >= 1, got True"),
    ({"chunk_vocab": 0}, "'chunk_vocab' must be an int >= 1 or None, got 0"),
])
def test_bad_chunks_are_named(kwargs, match):
    h, w, labels = _inputs(8, jnp.float32)
    with pytest.raises(ValueError, match=match):
        lm_head_loss(h, w, labels, **kwargs)
    with pytest.raises(TypeError, match="'ignore_index' must be an int"):
        lm_head_loss(h, w, labels, ignore_index=-100.0)
    with pytest.raises(TypeError, match="'head_grad' must be a bool, got 'no'"):
        lm_head_loss(h, w, labels, head_grad="no")


# ---------------------------------------------------------------------------------------------------------------
# The model: hidden_states + the head is apply; causal_lm_loss_fused is causal_lm_loss(apply(...))
# ---------------------------------------------------------------------------------------------------------------
CFG = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                  rms_norm_eps=1e-5, max_position_embeddings=32, vocab_size=29, num_hidden_layers=2)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _model(seed, cfg, dtype=jnp.float64):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = jax.tree.map(lambda a: a.astype(dtype), init(k1, cfg, std=0.3))
    lora = jax.tree.map(lambda a: a.astype(dtype), init_lora(k2, cfg, LCFG))
    return params, lora


def _packed_batch(seed, b=2, t=9, vocab=29):
    """Two rows, each packing two segments: positions restart and the label of each segment's first token is
    ignored (no loss across a boundary)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (b, t))
    segment_ids = np.array([[0] * 4 + [1] * 5, [0] * 6 + [1] * 3])
    positions = np.stack([np.r_[np.arange(4), np.arange(5)], np.r_[np.arange(6), np.arange(3)]])
    labels = ids.copy()
    labels[0, 4] = labels[1, 6] = IGNORE_INDEX
    labels[1, 2] = IGNORE_INDEX
    return (jnp.asarray(ids), jnp.asarray(labels), jnp.asarray(segment_ids), jnp.asarray(positions))


def test_apply_is_hidden_states_and_the_head_bit_for_bit():
    params, lora = _model(0, CFG, jnp.float32)
    ids, _, seg, pos = _packed_batch(0)
    h = hidden_states(params, lora, ids, CFG, LCFG, segment_ids=seg, positions=pos)
    logits = jnp.einsum("bth,vh->btv", h, head_weight(params, CFG), preferred_element_type=jnp.float32)
    assert h.shape == (2, 9, 24)
    np.testing.assert_array_equal(logits, apply(params, lora, ids, CFG, LCFG, segment_ids=seg, positions=pos))


@pytest.mark.parametrize("tied", [False, True])
def test_the_fused_model_loss_equals_causal_lm_loss_of_apply_float64(tied):
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": tied})
    with jax.enable_x64(True):
        params, lora = _model(1 + tied, cfg)
        ids, labels, seg, pos = _packed_batch(2 + tied)
        n = count_items(labels) + 3  # the window holds another micro-batch's 3 labels
        kwargs = {"segment_ids": seg, "positions": pos}

        def plain(lora, params, **kw):
            return causal_lm_loss(apply(params, lora, ids, cfg, LCFG, **kwargs, **kw), labels, n)

        def fused(lora, params, **kw):
            return causal_lm_loss_fused(params, lora, ids, labels, n, cfg, LCFG, chunk_tokens=4, chunk_vocab=8,
                                        **kwargs, **kw)
        # LoRA's gradients through the hand-written block VJP (the head frozen)
        (got, g), (want, r) = (jax.value_and_grad(f)(lora, params) for f in (fused, plain))
        assert abs(float(got - want)) <= 1e-13 * abs(float(want))
        assert max(jax.tree.leaves(jax.tree.map(_rel, g, r))) < 1e-12
        # training the base: the embedding's and the head's gradients too (tied: one array, both uses)
        base = jax.value_and_grad(lambda params, f: f(lora, params, backend="reference", train_base=True))
        (got, g), (want, r) = base(params, fused), base(params, plain)
        assert abs(float(got - want)) <= 1e-13 * abs(float(want))
        assert ("lm_head" in g) != tied
        assert max(jax.tree.leaves(jax.tree.map(_rel, g, r))) < 1e-12
        assert _rel(head_weight(g, cfg), head_weight(r, cfg)) < 1e-12 and float(jnp.max(jnp.abs(head_weight(g, cfg))))


def test_the_fused_model_loss_names_bad_input():
    params, lora = _model(4, CFG, jnp.float32)
    ids, labels, _, _ = _packed_batch(4)
    with pytest.raises(ValueError, match="'n_items' must be > 0"):
        causal_lm_loss_fused(params, lora, ids, labels, 0, CFG, LCFG)
    with pytest.raises(ValueError, match="'labels' must lie in \\[0, 29\\)"):
        causal_lm_loss_fused(params, lora, ids, labels.at[0, 0].set(29), 5, CFG, LCFG)
    with pytest.raises(ValueError, match="'chunk_tokens' must be an int >= 1"):
        causal_lm_loss_fused(params, lora, ids, labels, 5, CFG, LCFG, chunk_tokens=0)
    with pytest.raises(ValueError, match="attention"):
        model_mod.hidden_states(params, lora, ids, CFG, LCFG, attention="sdpa:xla")
