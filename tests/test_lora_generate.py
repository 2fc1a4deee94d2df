"""Greedy decoding (jaxgrad.lora.generate): every token is the argmax of apply's logits at the end of the growing
sequence, computed here one step at a time without the generator; EOS stops a row and is kept; a batch of prompts
of different lengths gives each prompt what it gives alone; LoRA adapters and NF4 projections take part; bad input
is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.generate import buffer_length, generate
from jaxgrad.lora.hf import quantize_projections
from jaxgrad.lora.model import apply, init, init_lora

CFG = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=24, vocab_size=37, num_hidden_layers=2)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
PARAMS = init(jax.random.key(0), CFG, std=0.5)  # wide logits: no near-ties for rounding to flip
PROMPTS = [[3], [5, 17, 2, 30, 8], [11, 11, 4, 29, 0, 19, 7, 1, 23]]


apply_jit = jax.jit(apply, static_argnames=("cfg", "lcfg", "backend"))


def argmax_by_hand(params, lora, prompt, n, lcfg=None, eos=()):
    """Token by token: apply on the whole sequence so far (no padding, no buffer), argmax of the last logits."""
    seq, out = list(prompt), []
    for _ in range(n):
        logits = apply_jit(params, lora, jnp.asarray([seq], jnp.int32), cfg=CFG, lcfg=lcfg, backend="reference")
        token = int(np.argmax(np.asarray(logits[0, -1])))
        out.append(token)
        seq.append(token)
        if token in eos:
            break
    return out


def lora_with_nonzero_b(seed=1, scale=0.5):
    lora = init_lora(jax.random.key(seed), CFG, LCFG)  # PEFT init: B = 0, the model unchanged
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(lora))))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: scale * jax.random.normal(next(keys), x.shape) if "lora_B" in str(path[-1]) else x, lora)


def test_tokens_are_the_argmax_of_apply_on_the_growing_sequence():
    prompt = PROMPTS[1]
    [got] = generate(PARAMS, None, [prompt], CFG, max_new_tokens=10)
    assert got == argmax_by_hand(PARAMS, None, prompt, 10)
    assert len(got) == 10 and len(set(got)) > 2  # a sequence that moves, not one token repeated


def test_a_row_stops_after_its_eos_which_is_kept():
    prompt = PROMPTS[1]
    free = argmax_by_hand(PARAMS, None, prompt, 10)
    k = next(i for i, t in enumerate(free) if free.index(t) == i and i >= 2)  # a token's first appearance
    [got] = generate(PARAMS, None, [prompt], CFG, max_new_tokens=10, eos_token_id=free[k])
    assert got == free[:k + 1]
    # several EOS ids (Llama 3's generation_config lists two): the first one emitted stops the row
    [got] = generate(PARAMS, None, [prompt], CFG, max_new_tokens=10, eos_token_id=[36 if free[k] != 36 else 35,
                                                                                  free[k]])
    assert got[-1] == free[k] and len(got) <= k + 1


def test_a_batch_of_different_lengths_gives_each_prompt_what_it_gives_alone():
    eos = argmax_by_hand(PARAMS, None, PROMPTS[0], 3)[1]  # stops the first row early, the others go on
    alone = [generate(PARAMS, None, [p], CFG, max_new_tokens=8, eos_token_id=eos)[0] for p in PROMPTS]
    batch = generate(PARAMS, None, PROMPTS, CFG, max_new_tokens=8, eos_token_id=eos)
    assert batch == alone
    assert batch == [argmax_by_hand(PARAMS, None, p, 8, eos=(eos,)) for p in PROMPTS]
    assert len(batch[0]) < 8 and len({len(b) for b in batch}) > 1


def test_an_equal_length_integer_array_is_a_batch():
    ids = np.array([PROMPTS[1], PROMPTS[1][::-1]], np.int32)
    assert generate(PARAMS, None, ids, CFG, max_new_tokens=4) == \
        generate(PARAMS, None, ids.tolist(), CFG, max_new_tokens=4)


def test_lora_adapters_change_the_path_only_when_b_is_not_zero():
    prompt = PROMPTS[2]
    base = generate(PARAMS, None, [prompt], CFG, max_new_tokens=8)
    zero_b = generate(PARAMS, init_lora(jax.random.key(1), CFG, LCFG), [prompt], CFG, LCFG, max_new_tokens=8)
    assert zero_b == base
    lora = lora_with_nonzero_b()
    [tuned] = generate(PARAMS, lora, [prompt], CFG, LCFG, max_new_tokens=8)
    assert tuned != base[0]
    assert tuned == argmax_by_hand(PARAMS, lora, prompt, 8, LCFG)


def test_nf4_projections_decode_as_apply_runs_them():
    q = quantize_projections(PARAMS)
    lora = lora_with_nonzero_b(scale=0.1)
    [got] = generate(q, lora, [PROMPTS[1]], CFG, LCFG, max_new_tokens=6)
    assert got == argmax_by_hand(q, lora, PROMPTS[1], 6, LCFG)


@pytest.mark.parametrize(("backend", "attention"), [("xla", "xla"), ("reference", "pallas")])
def test_the_custom_vjp_forward_and_flash_attention_decode_the_same_tokens(backend, attention):
    lora = lora_with_nonzero_b()
    reference = generate(PARAMS, lora, PROMPTS, CFG, LCFG, max_new_tokens=6)
    assert generate(PARAMS, lora, PROMPTS, CFG, LCFG, max_new_tokens=6, backend=backend,
                    attention=attention) == reference


def test_buffer_rounds_up_to_a_multiple_and_stops_at_the_positions():
    assert buffer_length(5, 10, 2048) == 64
    assert buffer_length(60, 10, 2048) == 128
    assert buffer_length(5, 10, 24) == 24


@pytest.mark.parametrize(("prompts", "kwargs", "error", "names"), [
    ([[1, 2]], {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ([[1, 2]], {"max_new_tokens": 2.0}, ValueError, "max_new_tokens"),
    ([list(range(25))], {"max_new_tokens": 1}, ValueError, "prompt_ids.0. has 25 tokens.*max_position_embeddings"),
    ([[1] * 20], {"max_new_tokens": 5}, ValueError, "max_new_tokens.*at most 4"),
    ([[1, 2], []], {"max_new_tokens": 1}, ValueError, r"prompt_ids\[1\] is empty"),
    ([], {"max_new_tokens": 1}, ValueError, "prompt_ids"),
    ([1, 2, 3], {"max_new_tokens": 1}, TypeError, r"prompt_ids\[0\] is the int 1.*\[ids\]"),
    ("abc", {"max_new_tokens": 1}, TypeError, "prompt_ids"),
    ([[1, 37]], {"max_new_tokens": 1}, ValueError, r"prompt_ids\[0\]\[1\] = 37 is outside \[0, 37\)"),
    ([[1, 2]], {"max_new_tokens": 1, "eos_token_id": 99}, ValueError, "eos_token_id"),
    ([[1, 2]], {"max_new_tokens": 1, "eos_token_id": []}, TypeError, "eos_token_id"),
    ([[1, 2]], {"max_new_tokens": 1, "backend": "cuda"}, ValueError, "backend"),
    ([[1, 2]], {"max_new_tokens": 1, "attention": "flash"}, ValueError, "attention"),
])
def test_bad_input_is_refused_naming_the_argument(prompts, kwargs, error, names):
    with pytest.raises(error, match=names):
        generate(PARAMS, None, prompts, CFG, **kwargs)
