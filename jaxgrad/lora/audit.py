"""``jaxgrad audit`` cases of the Llama decoder block with LoRA (:func:`jaxgrad.lora.block.block`'s whole-block VJP).

Each case differentiates ``(x, lora, norms)``: the block input, every adapter (all 7 projections targeted, ``A``
and ``B`` random and non-zero) and both RMSNorm weights; the frozen projection weights are closed over (fixed white
noise of std ``1/sqrt(in)`` per configuration). The configuration follows from the hidden size, so one ``fn``
serves every size (:data:`CONFIGS`). Backends:

* ``lora_block[xla]``: the custom VJP in XLA (float32);
* ``lora_block[pallas]``: the same VJP with both RMSNorms and SwiGLU as Pallas kernels and the attention core as the
  flash-attention kernels (float32; off a GPU at the smallest size only, in interpret mode: its kernels are
  audited one by one at several sizes, the block at one);
* ``lora_block[mosaic]``: each projection's forward and ``dX`` as Mosaic GPU kernels (bf16, the kernels' dtype;
  Hopper only);
* ``lora_block[cudnn]``: the attention core through cuDNN (bf16; GPU only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig

__all__ = ["CONFIGS", "audit_cases"]


def _configs(hidden, intermediate, heads, kv_heads, head_dim, r):
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      max_position_embeddings=256, vocab_size=11)
    return cfg, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)


#: hidden size -> (LlamaConfig, LoraConfig): GQA everywhere, sizes that are no multiple of the kernels' tiles
#: (24, 40, 96), and the Mosaic kernels' own tile sizes (256, head_dim 128, r 16)
CONFIGS = {
    24: _configs(24, 40, 3, 1, 8, 4),
    40: _configs(40, 72, 4, 2, 10, 4),
    96: _configs(96, 160, 3, 1, 32, 4),
    256: _configs(256, 384, 2, 1, 128, 16),
}


def _frozen(hidden: int, dtype) -> dict:
    """The frozen projection weights of the configuration of ``hidden``, in ``dtype``."""
    from jaxgrad.ops.registry import frozen_normal

    cfg, _ = CONFIGS[hidden]
    frozen: dict = {}
    for j, ((g, n), (out_f, in_f)) in enumerate(cfg.projection_shapes.items()):
        w = frozen_normal((out_f, in_f), 10 + j, in_f ** -0.5)
        frozen.setdefault(g, {})[n] = {"weight": jnp.asarray(w, dtype)}
    return frozen


def _make_args(dtype):
    def make_args(key, size):
        """``(x, lora, norms)`` for ``size = (batch, seq, hidden)``: x ~ N(0, 1), A and B uniform as PEFT's
        ``init_lora_weights=False``, norm weights ``1 + N(0, 0.2^2)``."""
        batch, seq, hidden = size
        cfg, lcfg = CONFIGS[hidden]
        keys = iter(jax.random.split(key, 3 + 2 * len(PROJECTIONS)))
        x = jax.random.normal(next(keys), (batch, seq, hidden))
        norms = {n: {"weight": 1 + 0.2 * jax.random.normal(next(keys), (hidden,))}
                 for n in ("input_layernorm", "post_attention_layernorm")}
        lora: dict = {}
        r = lcfg.r
        for (g, n), (out_f, in_f) in cfg.projection_shapes.items():
            a = jax.random.uniform(next(keys), (r, in_f), minval=-1, maxval=1) * in_f ** -0.5
            b = jax.random.uniform(next(keys), (out_f, r), minval=-1, maxval=1) * r ** -0.5
            lora.setdefault(g, {})[n] = {"lora_A": a, "lora_B": b}
        return jax.tree.map(lambda t: t.astype(dtype), (x, lora, norms))
    return make_args


def _fn(backend: str, attention: str):
    def fn(x, lora, norms):
        cfg, lcfg = CONFIGS[x.shape[-1]]
        params = {**_frozen(x.shape[-1], x.dtype), **norms}
        return block(params, lora, x, cfg, lcfg, backend=backend, attention=attention)
    fn.__name__ = f"lora_block_{backend}_{attention}_attention"
    return fn


def _reference(x, lora, norms):
    cfg, lcfg = CONFIGS[x.shape[-1]]
    return block_reference({**_frozen(x.shape[-1], x.dtype), **norms}, lora, x, cfg, lcfg)


def audit_cases():
    """The block on each backend (module docstring)."""
    from jaxgrad.ops.registry import OpAudit

    case = functools.partial(OpAudit, reference=_reference, arg_names=("x", "lora", "norms"))
    small, gpu = ((2, 7, 24), (2, 13, 40)), ((2, 77, 96), (2, 128, 256))
    return (
        case(name="lora_block[xla]", fn=_fn("xla", "xla"), make_args=_make_args(jnp.float32), sizes=small),
        case(name="lora_block[pallas]", fn=_fn("pallas", "pallas"), make_args=_make_args(jnp.float32),
             sizes=small, backend="pallas", interpret_sizes=small[:1]),
        case(name="lora_block[mosaic]", fn=_fn("mosaic", "xla"), make_args=_make_args(jnp.bfloat16), sizes=gpu,
             backend="mosaic"),
        case(name="lora_block[cudnn]", fn=_fn("xla", "cudnn"), make_args=_make_args(jnp.bfloat16), sizes=gpu,
             backend="cudnn"),
    )
