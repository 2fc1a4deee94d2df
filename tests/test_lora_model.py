"""The Llama/LoRA causal LM: custom-VJP and reference backends agree (float64, 1e-12), the loss is normalised by
the non-ignored tokens of the whole gradient-accumulation window (transformers #34191 cannot happen), padding
masks, checkpoint policies, tied embeddings, PEFT initialisation, and bad input named."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora import model as model_mod
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from jaxgrad.lora.hf import expected_shapes
from jaxgrad.lora.model import IGNORE_INDEX, apply, causal_lm_loss, count_items, init, init_lora, loss_fn

CFG = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                  rms_norm_eps=1e-5, max_position_embeddings=32, vocab_size=13, num_hidden_layers=2)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _model(seed, dtype, cfg=CFG, lcfg=LCFG):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = jax.tree.map(lambda a: a.astype(dtype), init(k1, cfg, std=0.3))
    lora = jax.tree.map(lambda a: a.astype(dtype), init_lora(k2, cfg, lcfg))
    return params, lora


def _batch(seed, b, t, vocab=13, n_ignored=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (b, t))
    labels = ids.copy()
    if n_ignored:
        flat = labels.reshape(-1)
        flat[rng.choice(flat.size, n_ignored, replace=False)] = IGNORE_INDEX
    return jnp.asarray(ids), jnp.asarray(labels)


def test_model_custom_vjp_equals_reference_float64_two_layers_tied_checkpointed():
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True, "gradient_checkpointing": "dots_saveable"})
    with jax.enable_x64(True):
        params, lora = _model(1, jnp.float64, cfg)
        assert "lm_head" not in params
        ids, labels = _batch(2, 2, 7, n_ignored=3)
        mask = jnp.array([[1] * 7, [1] * 5 + [0] * 2])
        n = count_items(labels)

        def loss(lora, backend):
            return loss_fn(lora, params, ids, labels, n, cfg, LCFG, attention_mask=mask, backend=backend)
        l1, g1 = jax.jit(jax.value_and_grad(lambda lora: loss(lora, "xla")))(lora)
        l2, g2 = jax.jit(jax.value_and_grad(lambda lora: loss(lora, "reference")))(lora)
        assert abs(float(l1 - l2)) <= 1e-13 * abs(float(l2))
        errs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))), g1, g2)
        assert max(jax.tree.leaves(errs)) < 1e-12, errs
        assert len(jax.tree.leaves(g1)) == 2 * 7 * 2


def test_ce_over_a_two_micro_batch_window_equals_the_full_batch_and_mean_of_means_does_not():
    with jax.enable_x64(True):
        params, lora = _model(3, jnp.float64)
        ids, labels = _batch(4, 4, 9)
        labels = labels.at[0, 2:].set(IGNORE_INDEX).at[1, 5:].set(IGNORE_INDEX)  # micro-batch 1 has fewer tokens
        micro = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
        n_window = count_items([lab for _, lab in micro])
        assert n_window == count_items(labels) == int(np.sum(np.asarray(labels)[:, 1:] != IGNORE_INDEX))

        def loss(lora, ids, labels, n):
            return loss_fn(lora, params, ids, labels, n, CFG, LCFG)
        vg = jax.jit(jax.value_and_grad(loss))
        full_l, full_g = vg(lora, ids, labels, n_window)
        parts = [vg(lora, i, lab, n_window) for i, lab in micro]
        acc_l = sum(p[0] for p in parts)
        acc_g = jax.tree.map(lambda a, b: a + b, parts[0][1], parts[1][1])
        assert abs(float(acc_l - full_l)) <= 1e-14 * abs(float(full_l))
        errs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))), acc_g, full_g)
        assert max(jax.tree.leaves(errs)) < 1e-13
        # the #34191 bug: the mean of per-micro-batch means is a different number
        means = [vg(lora, i, lab, count_items(lab))[0] for i, lab in micro]
        assert abs(float(sum(means) / 2 - full_l)) > 1e-3 * abs(float(full_l))


def test_token_loss_is_logsumexp_minus_target_logit():
    logits = jax.random.normal(jax.random.key(0), (1, 4, 5))
    labels = jnp.array([[0, 3, IGNORE_INDEX, 1]])
    got = causal_lm_loss(logits, labels, n_items=2)
    z = np.asarray(logits[0], np.float64)
    want = sum(np.log(np.sum(np.exp(z[t]))) - z[t, labels[0, t + 1]] for t in (0, 2)) / 2
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_padding_does_not_change_the_real_tokens():
    params, lora = _model(5, jnp.float32)
    ids, _ = _batch(6, 1, 5)
    padded = jnp.concatenate([ids, jnp.zeros((1, 3), ids.dtype)], axis=1)
    mask = jnp.array([[1] * 5 + [0] * 3])
    f = jax.jit(lambda ids, mask: apply(params, lora, ids, CFG, LCFG, attention_mask=mask))
    out = f(padded, mask)
    np.testing.assert_allclose(out[:, :5], f(ids, jnp.ones_like(ids)), rtol=2e-5, atol=2e-5)


def test_checkpoint_policies_give_the_same_gradient():
    params, lora = _model(7, jnp.float32)
    ids, labels = _batch(8, 2, 6)
    grads = []
    for policy in ("none", "full", "nothing_saveable"):
        cfg = LlamaConfig(**{**CFG.__dict__, "gradient_checkpointing": policy})
        grads.append(jax.jit(jax.grad(lambda lora: loss_fn(lora, params, ids, labels, count_items(labels), cfg,
                                                            LCFG)))(lora))
    for g in grads[1:]:
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads[0])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))  # f32 rounding


def test_projection_shapes_are_hf_out_in_and_every_layout_uses_them():
    # GQA (3 q heads on 1 kv head) and head_dim * heads != hidden: every factor of the table shows
    shapes = CFG.projection_shapes
    assert list(shapes) == list(PROJECTIONS)
    assert shapes == {("self_attn", "q_proj"): (24, 24), ("self_attn", "k_proj"): (8, 24),
                      ("self_attn", "v_proj"): (8, 24), ("self_attn", "o_proj"): (24, 24),
                      ("mlp", "gate_proj"): (40, 24), ("mlp", "up_proj"): (40, 24), ("mlp", "down_proj"): (24, 40)}
    cfg = LlamaConfig(**{**CFG.__dict__, "head_dim": 6})
    assert cfg.projection_shapes[("self_attn", "q_proj")] == (18, 24)
    assert cfg.projection_shapes[("self_attn", "o_proj")] == (24, 18)
    params, lora = _model(0, jnp.float32, cfg)
    hf = expected_shapes(cfg)
    for (g, n), (out_f, in_f) in cfg.projection_shapes.items():
        for i in range(cfg.num_hidden_layers):
            assert params["layers"][i][g][n]["weight"].shape == (out_f, in_f)
            assert lora["layers"][i][g][n]["lora_A"].shape == (LCFG.r, in_f)
            assert lora["layers"][i][g][n]["lora_B"].shape == (out_f, LCFG.r)
            assert hf[f"model.layers.{i}.{g}.{n}.weight"] == (out_f, in_f)


def test_peft_initialisation():
    cfg = LlamaConfig(**{**CFG.__dict__, "hidden_size": 256, "head_dim": 8, "num_attention_heads": 3})
    lora = init_lora(jax.random.key(0), cfg, LoraConfig(r=8, target_modules=["q_proj"]))["layers"][0]
    a, b = lora["self_attn"]["q_proj"]["lora_A"], lora["self_attn"]["q_proj"]["lora_B"]
    assert a.shape == (8, 256) and b.shape == (24, 8) and not bool(jnp.any(b))  # PEFT default: B = 0
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(in))
    assert float(jnp.max(jnp.abs(a))) <= bound and float(jnp.max(jnp.abs(a))) > 0.9 * bound
    g = init_lora(jax.random.key(0), cfg, LoraConfig(r=8, init_lora_weights="gaussian"))["layers"][0]
    np.testing.assert_allclose(float(jnp.std(g["self_attn"]["v_proj"]["lora_A"])), 1 / 8, rtol=0.1)
    assert set(g["self_attn"]) == {"q_proj", "v_proj"} and "mlp" not in g  # PEFT's Llama default targets
    r = init_lora(jax.random.key(0), cfg, LoraConfig(r=8, init_lora_weights=False))["layers"][0]
    rb = r["self_attn"]["q_proj"]["lora_B"]  # init_lora_weights=False: random non-zero B, U(+-1/sqrt(r))
    assert bool(jnp.all(rb != 0)) and float(jnp.max(jnp.abs(rb))) <= 1 / math.sqrt(8)
    assert LoraConfig(r=16, lora_alpha=32).scale == 2.0
    assert LoraConfig(r=16, lora_alpha=32, use_rslora=True).scale == 8.0


def test_model_bad_input_is_named():
    params, lora = _model(9, jnp.float32)
    with pytest.raises(ValueError, match=r"sequence length 33 is longer than 'max_position_embeddings' \(32\)"):
        apply(params, lora, jnp.zeros((1, 33), jnp.int32), CFG, LCFG)
    with pytest.raises(ValueError, match="'input_ids' must be \\[batch, seq\\]"):
        apply(params, lora, jnp.zeros((33,), jnp.int32), CFG, LCFG)
    with pytest.raises(ValueError, match="'n_items' must be > 0"):
        causal_lm_loss(jnp.zeros((1, 3, 13)), jnp.zeros((1, 3), jnp.int32), 0)
    with pytest.raises(ValueError, match="'gradient_checkpointing' must be one of"):
        LlamaConfig(hidden_size=24, num_attention_heads=3, gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="'train_base' needs backend='reference'"):
        apply(params, lora, jnp.zeros((1, 3), jnp.int32), CFG, LCFG, train_base=True)
    ids = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="apply: 'attention' must be one of 'xla', 'cudnn', 'pallas', got 'sdpa:xla'"):
        apply(params, lora, ids, CFG, LCFG, attention="sdpa:xla")
    with pytest.raises(ValueError, match="apply: 'attention' must be one of 'xla', 'cudnn', 'pallas', got 'sdpa:xla'"):
        loss_fn(lora, params, ids, ids, 2, CFG, LCFG, attention="sdpa:xla")
    # the private cuDNN code path on the CPU (tests, benchmarks) takes the custom VJP or the reference only
    with pytest.raises(ValueError, match="attention='sdpa:xla' needs backend 'xla' or 'reference', got 'pallas'"):
        model_mod._apply(params, lora, ids, CFG, LCFG, backend="pallas", attention="sdpa:xla")
    with pytest.raises(ValueError, match=r"config.json keys \['sliding_window'\] are not supported"):
        LlamaConfig.from_hf_dict({"hidden_size": 24, "num_attention_heads": 3, "sliding_window": 4096})


def test_token_ids_outside_the_vocabulary_are_refused_by_name_where_concrete():
    # PyTorch's embedding raises on such an id; JAX's gather would fill (id >= vocab) or wrap (negative id)
    params, lora = _model(10, jnp.float32)
    ids, _ = _batch(11, 2, 5)
    for bad, at in ((13, [1, 2]), (-1, [1, 2]), (10 ** 6, [1, 2])):
        with pytest.raises(ValueError, match=rf"apply: 'input_ids' must lie in \[0, 13\) \(the vocabulary size: the "
                                             rf"rows of params\['embed_tokens'\]\['weight'\]\), got {bad} at "
                                             rf"\[1, 2\]"):
            apply(params, lora, ids.at[tuple(at)].set(bad), CFG, LCFG)
    with pytest.raises(ValueError, match=r"'input_ids' must lie in \[0, 13\).*got -3 at \[0, 0\]"):
        apply(params, lora, np.array([[-3, 1, 2]], np.int8), CFG, LCFG)  # numpy ids, any integer dtype
    with pytest.raises(ValueError, match=r"'input_ids' must lie in \[0, 13\).*got 13 at \[0, 1\]"):
        apply(params, lora, np.array([[3, 13]]), CFG, LCFG, backend="reference")
    apply(params, lora, np.array([[0, 12]]), CFG, LCFG)  # both ends of the vocabulary are fine


def test_token_ids_outside_the_vocabulary_under_jit_give_nan_logits_for_their_sequence():
    # traced ids cannot be checked: a bad id (negative ones too, which the gather would wrap to the last row)
    # gathers a NaN embedding; its sequence's logits are NaN, the other sequences' are untouched
    params, lora = _model(12, jnp.float32)
    ids, _ = _batch(13, 2, 5)
    f = jax.jit(lambda ids: apply(params, lora, ids, CFG, LCFG))
    good = f(ids)
    assert bool(jnp.all(jnp.isfinite(good)))
    for bad in (13, -1, -13):
        out = f(ids.at[1, 2].set(bad))
        assert bool(jnp.all(jnp.isnan(out[1]))), bad
        np.testing.assert_array_equal(out[0], good[0])


@pytest.mark.parametrize("bad", [-1, -7, 11])
def test_labels_outside_the_vocabulary_are_refused_by_name_where_concrete(bad):
    # a negative label other than -100 used to wrap to another class (take_along_axis), one >= vocab to clamp
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 11)), jnp.float32)
    labels = np.full((2, 5), 3)
    labels[1, 2] = bad
    with pytest.raises(ValueError, match=r"'labels' must lie in \[0, 11\).*-100.*at \[1, 2\]"):
        causal_lm_loss(logits, labels, 8)
    labels[1, 2] = IGNORE_INDEX
    assert np.isfinite(causal_lm_loss(logits, labels, 7))


def test_labels_outside_the_vocabulary_under_jit_give_a_nan_loss():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 11)), jnp.float32)
    labels = np.full((2, 5), 3)
    loss = jax.jit(causal_lm_loss)
    assert np.isfinite(loss(logits, labels, 8))
    for bad in (-1, 11):
        labels[1, 2] = bad
        assert np.isnan(loss(logits, labels, 8))


def test_a_concrete_attention_mask_must_be_zeros_and_ones():
    params, lora = _model(14, jnp.float32)
    ids, _ = _batch(15, 2, 5)
    with pytest.raises(ValueError, match=r"apply: 'attention_mask' must hold 0 \(padding\) and 1 \(token\) only, "
                                         r"got -1 at \[0, 4\]"):
        apply(params, lora, ids, CFG, LCFG, attention_mask=jnp.array([[1, 1, 1, 1, -1], [1, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"apply: 'attention_mask' must be \[batch, seq\] = \(2, 5\), got \(5,\)"):
        apply(params, lora, ids, CFG, LCFG, attention_mask=jnp.ones(5))


def test_from_hf_dict_reads_llama3_config_and_transformers5_rope_parameters():
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 24, "intermediate_size": 40,
         "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 10, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64, "vocab_size": 50, "num_hidden_layers": 1, "tie_word_embeddings": True,
         "attention_bias": False, "torch_dtype": "bfloat16",
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.head_dim == 10 and cfg.rope_theta == 500000.0 and cfg.rope_scaling_dict["factor"] == 8.0
    assert cfg.tie_word_embeddings and hash(cfg)


def test_an_nf4_layers_weights_wait_for_the_layers_input():
    # a layer's NF4 dequantisation depends on its weights alone: unless tied to the layer's input, XLA's GPU scheduler
    # ran many layers' ahead and held their bf16 copies (~6 GiB at Llama-3.1-8B QLoRA). One barrier per NF4 layer,
    # taking that layer's input; a dense model has none
    from jaxgrad.lora.hf import quantize_projections

    cfg = LlamaConfig(**{**CFG.__dict__, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                         "num_attention_heads": 4, "num_key_value_heads": 2})
    params, lora = _model(9, jnp.float32, cfg)
    ids, _ = _batch(9, 2, 8)
    nf4 = quantize_projections(params, blocksize=64)

    def barriers(p):
        jaxpr = jax.make_jaxpr(lambda p: model_mod.hidden_states(p, lora, ids, cfg, LCFG))(p).jaxpr
        return [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]

    assert not barriers(params)
    found = barriers(nf4)
    assert len(found) == cfg.num_hidden_layers
    # the first layer's barrier takes the embedding lookup's output (the layer's input) with the layer's NF4 leaves
    first = found[0]
    assert len(first.invars) == 1 + sum(
        len(jax.tree.leaves(nf4["layers"][0][g])) for g in ("self_attn", "mlp", "input_layernorm",
                                                            "post_attention_layernorm"))
