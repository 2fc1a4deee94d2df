"""``gradient_checkpointing="offload"`` on a GPU: each block's input goes to host memory between the forward and the
backward (the CPU backend drops memory-kind transfers of intermediates when it lowers, so this is checked where they
are real). The compiled step carries host-memory buffers (memory space 5), holds less device memory than "full" at a
size where the block inputs dominate, and gives "none"'s LoRA gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import count_items, init, init_lora, loss_fn

pytestmark = pytest.mark.gpu

BASE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, num_hidden_layers=12, max_position_embeddings=4096)
LCFG = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)


def _step(policy, seq=4096):
    cfg = LlamaConfig(**BASE, gradient_checkpointing=policy)
    params = init(jax.random.key(0), cfg, jnp.bfloat16)
    lora = init_lora(jax.random.key(1), cfg, LCFG)
    ids = jax.random.randint(jax.random.key(2), (1, seq), 0, BASE["vocab_size"])
    step = jax.jit(jax.grad(lambda lo: loss_fn(lo, params, ids, ids, count_items(ids), cfg, LCFG, backend="xla",
                                               attention="cudnn")))
    return step, lora


def test_offload_keeps_block_inputs_in_host_memory_and_the_gradients():
    compiled = {}
    for policy in ("none", "full", "offload"):
        step, lora = _step(policy)
        compiled[policy] = (step.lower(lora).compile(), lora)
    text = compiled["offload"][0].as_text()
    assert "S(5)" in text and "S(5)" not in compiled["full"][0].as_text()
    temp = {p: c.memory_analysis().temp_size_in_bytes for p, (c, _) in compiled.items()}
    assert temp["offload"] < temp["full"], temp
    want = compiled["none"][0](compiled["none"][1])
    got = compiled["offload"][0](compiled["offload"][1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                   atol=2e-2 * float(jnp.abs(b).max()))
