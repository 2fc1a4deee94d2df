"""The LoRA Llama block's custom VJP (XLA backend) on a GPU, at odd sizes, against ``jax.grad`` of the plain
reference block through :func:`jaxgrad.verify.check_vjp`.

Sizes: batch 2, seq 77 (odd: the block pads it by one position for cuDNN's training kernels), hidden 96, 3 heads /
1 kv head, head_dim 32, intermediate 200, LoRA r 6 on all 7 projections with random non-zero A and B, random norm
weights. Cases: float32 (the GPU's default matmul precision, TF32; cuDNN's attention has no float32), bf16 through
cuDNN's attention, bf16 through jaxgrad's XLA attention.

The verdict (``tests/test_lora_block.py``'s normwise gates): every as-called leaf within its per-entry bound and
within 10x the normwise rounding error of the reference's own VJP run at the same precision, every float64 re-run
leaf within 1e-12 of ``jax.grad``, and every finite-difference, adjoint and structural check passed. A check the
verifier calls undetermined (no evidence either way, e.g. a bf16 comparison whose possible jumps it can only bound
by an overflowing sum of |terms|) does not fail the test; it is named in the report printed on failure.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import init, init_lora
from jaxgrad.verify import check_vjp

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(hidden_size=96, intermediate_size=200, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                  rms_norm_eps=1e-5, max_position_embeddings=128, vocab_size=11)
LCFG = LoraConfig(r=6, lora_alpha=12, target_modules="all-linear", init_lora_weights=False)
NORMS = ("input_layernorm", "post_attention_layernorm")


def _inputs(seed):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    params = init(k1, CFG, std=CFG.hidden_size ** -0.5)["layers"][0]
    for i, n in enumerate(NORMS):
        params[n]["weight"] = 1 + 0.2 * jax.random.normal(jax.random.fold_in(k2, i), (CFG.hidden_size,))
    lora = init_lora(k3, CFG, LCFG)["layers"][0]
    return params, lora, jax.random.normal(k4, (2, 77, CFG.hidden_size))


@pytest.mark.parametrize("dtype, attention", [(jnp.float32, "xla"), (jnp.bfloat16, "cudnn"), (jnp.bfloat16, "xla")],
                         ids=["f32-xla-attention", "bf16-cudnn-attention", "bf16-xla-attention"])
def test_gpu_block_vjp_verified_at_odd_sizes(dtype, attention):
    params, lora, x = jax.tree.map(lambda a: a.astype(dtype), _inputs(42))
    norms = {n: params[n] for n in NORMS}
    frozen = {k: v for k, v in params.items() if k not in NORMS}
    fn = functools.partial(lambda x, lora, norms: block({**frozen, **norms}, lora, x, CFG, LCFG, attention=attention))
    ref = functools.partial(lambda x, lora, norms: block_reference({**frozen, **norms}, lora, x, CFG, LCFG))
    report = check_vjp(fn, ref, x, lora, norms, arg_names=("x", "lora", "norms"),
                       name=f"lora block custom VJP ({jnp.dtype(dtype).name}, attention={attention})")
    bad = [f"{leaf.name} [{leaf.run}]" for leaf in report.leaves
           if not (leaf.passed and leaf.rel_err <= 1e-12 if leaf.run == "f64" else
                   leaf.per_entry_passed and leaf.rel_err <= 10 * max(leaf.ref_rel_err or 0.0, 2.0 ** -24))]
    bad += [c.name for c in report.checks if not c.passed and not getattr(c, "undetermined", False)]
    assert not bad, f"failing: {bad}\n{report}"
