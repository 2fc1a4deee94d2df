"""Padding-free packing on the GPU: a packed row gives each segment's logits and the LoRA gradients of running it
alone, with cuDNN's attention (backend ``xla`` and ``mosaic``, bf16) and the Pallas flash kernels compiled by
Triton (f32, whose products are TF32 by default, and bf16).

Exact equality is not the question at these precisions: the packed and the alone runs round differently (other
shapes, other tilings). The judge is the rounding of the same path: against a float64 oracle (each segment alone,
the plain reference block, on the GPU in float64), the packed run's normwise error in every array (the logits of the
real tokens, each LoRA gradient) must be within 4x that of the same backend and attention running each segment
alone (or within 4x the dtype's unit roundoff where that is larger). Segment leakage is not rounding: the same packed
row without segment ids fails that bound (checked, so the test can fail).

Sizes: a row of 19 holding segments of 5, 9 and 3 tokens and 2 of padding, a row of 7 + 12; 4 query heads on 2 kv
heads, head_dim 16, hidden 64, 2 layers, LoRA r 4 on all 7 projections with random non-zero A and B (fp32 master
adapters, as PEFT keeps them), positions restarting at 0 per segment, labels -100 at each segment's first token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import IGNORE_INDEX, _apply, causal_lm_loss, count_items, init, init_lora

pytestmark = pytest.mark.gpu

SEGMENTS = np.array([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 2,
                     [5] * 7 + [6] * 12])
MASK = (SEGMENTS != 0).astype(np.int32)
CFG = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, max_position_embeddings=32, vocab_size=29, num_hidden_layers=2)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
UNIT_ROUNDOFF = {jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float32): 2.0 ** -11}  # f32: TF32 products
RATIO = 4.0


def segments():
    """``[(row, positions)]`` of the segments holding tokens."""
    return [(b, np.nonzero(SEGMENTS[b] == s)[0]) for b in range(SEGMENTS.shape[0])
            for s in dict.fromkeys(SEGMENTS[b].tolist()) if MASK[b, SEGMENTS[b] == s].any()]


def inputs(seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(np.asarray, init(k1, CFG, std=0.1))
    lora = jax.tree.map(np.asarray, init_lora(k2, CFG, LCFG))
    ids = np.asarray(jax.random.randint(k3, SEGMENTS.shape, 0, CFG.vocab_size), np.int32)
    labels = np.where(MASK != 0, ids, IGNORE_INDEX).astype(np.int32)
    positions = np.zeros(SEGMENTS.shape, np.int32)
    for b, idx in segments():
        labels[b, idx[0]] = IGNORE_INDEX  # no loss across a boundary
        positions[b, idx] = np.arange(len(idx))
    return params, lora, ids, labels, positions


def run(params, lora, ids, labels, n, dtype, backend, attention, **kw):
    """``(logits as float64 numpy, LoRA gradient as float64 numpy)`` of one batch, jitted."""
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    lora = jax.tree.map(lambda a: jnp.asarray(a, jnp.promote_types(dtype, jnp.float32)), lora)

    def loss(lora, ids, labels, kw):
        logits = _apply(params, lora, ids, CFG, LCFG, backend=backend, attention=attention, **kw)
        return causal_lm_loss(logits, labels, n), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(lora, jnp.asarray(ids), jnp.asarray(labels),
                                                                         {k: jnp.asarray(v) for k, v in kw.items()})
    return np.asarray(logits, np.float64), jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


def alone(params, lora, ids, labels, n, dtype, backend, attention):
    """Every segment run as its own sequence: its logits put back in the packed layout, the gradients summed."""
    logits, grads = np.zeros(SEGMENTS.shape + (CFG.vocab_size,)), None
    for b, idx in segments():
        lb, gb = run(params, lora, ids[b:b + 1, idx], labels[b:b + 1, idx], n, dtype, backend, attention)
        logits[b, idx] = lb[0]
        grads = gb if grads is None else jax.tree.map(np.add, grads, gb)
    return logits, grads


def normwise(got, want):
    """``{name: ||got - want|| / ||want||}`` over the real tokens' logits and every LoRA gradient."""
    real = MASK != 0
    errs = {"logits": np.linalg.norm(got[0][real] - want[0][real]) / np.linalg.norm(want[0][real])}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True):
        errs[jax.tree_util.keystr(path)] = float(np.linalg.norm(g - w) / np.linalg.norm(w))
    return errs


@pytest.fixture(scope="module")
def case():
    params, lora, ids, labels, positions = inputs(0)
    n = count_items(labels)
    with jax.enable_x64(True):
        oracle = alone(params, lora, ids, labels, n, jnp.float64, "reference", "xla")
    return (params, lora, ids, labels, positions, n), oracle


CASES = [("xla", "cudnn", jnp.bfloat16), ("mosaic", "cudnn", jnp.bfloat16), ("xla", "pallas", jnp.float32),
         ("pallas", "pallas", jnp.float32), ("xla", "pallas", jnp.bfloat16)]


@pytest.mark.parametrize("backend,attention,dtype", CASES,
                         ids=[f"{b}-{a}-{jnp.dtype(d).name}" for b, a, d in CASES])
def test_gpu_a_packed_row_equals_each_segment_alone_within_rounding(backend, attention, dtype, case):
    (params, lora, ids, labels, positions, n), oracle = case
    args = (params, lora, ids, labels, n, dtype, backend, attention)
    packed = run(*args, attention_mask=MASK, positions=positions, segment_ids=SEGMENTS)
    leaked = run(*args, attention_mask=MASK, positions=positions)  # no segment ids: the segments see each other
    own = normwise(alone(*args), oracle)  # the same path's rounding, each segment alone
    bound = {k: RATIO * max(e, UNIT_ROUNDOFF[jnp.dtype(dtype)]) for k, e in own.items()}
    got = normwise(packed, oracle)
    bad = {k: (got[k], bound[k]) for k in got if not got[k] <= bound[k]}
    assert not bad, f"packed error above {RATIO}x the alone run's (error, bound): {bad}"
    assert normwise(leaked, oracle)["logits"] > bound["logits"]  # leakage is not within rounding
