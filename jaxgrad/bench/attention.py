r"""The LoRA block's attention core alone, fwd+bwd (issue #13 item 2: "where cuDNN attention measures faster than
ours, use it behind the same custom VJP and say so with numbers").

``value_and_grad`` of ``sum(attention(q, k, v) * cot)`` with respect to ``q, k, v``: causal, GQA, bf16, at the
block's shape (batch 4, seq 2048, 16 q / 8 kv heads, head dim 128; ``small``: batch 1, seq 256, 4 / 2 heads, head
dim 64). Variants:

* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` and its cuDNN backward (GPU only) -- what
  ``block(attention="cudnn")`` runs; ``cudnn, kv repeated (MHA)``: the same with ``K``, ``V`` repeated to the q
  heads (what GQA costs cuDNN's kernels);
* ``pallas flash``: :func:`jaxgrad.ops.flash_attention.flash_attention` (our Triton-backend Pallas kernels: forward
  with the fp32 ``lse``, a dQ kernel, a dK/dV kernel; ``P``, ``dP``, ``dS`` in fp32) -- ``block(attention="pallas")``;
* ``xla (our VJP)``: :func:`jaxgrad.ops.attention.attention` (``T x T`` scores in HBM) -- ``block(attention="xla")``;
* ``jax.grad(reference)``: ``jax.grad`` of :func:`jaxgrad.ops.attention.attention_reference`.

FLOPs: the block's convention (:func:`jaxgrad.bench.lora_block.block_flops`): forward ``4 B H_q P d`` with ``P = T (T +
1) / 2`` causal pairs, backward twice that (no recomputation of ``Q K^T`` counted).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxgrad.bench import harness as bm

__all__ = ["ATTENTION_SIZES", "attention_flops", "suite_attention"]

ATTENTION_SIZES = {"small": dict(batch=1, seq=256, heads=4, kv_heads=2, head_dim=64),
                   "full": dict(batch=4, seq=2048, heads=16, kv_heads=8, head_dim=128),
                   "long": dict(batch=1, seq=8192, heads=16, kv_heads=8, head_dim=128)}


def attention_flops(batch, seq, heads, kv_heads, head_dim) -> float:
    """Causal fwd + bwd: ``(4 + 8) B H_q P d``, ``P = T (T + 1) / 2``."""
    return 12.0 * batch * heads * seq * (seq + 1) / 2 * head_dim


def _variants(on_gpu: bool) -> dict[str, Callable]:
    from jaxgrad.ops.attention import attention, attention_reference
    from jaxgrad.ops.flash_attention import flash_attention

    def fwd_bwd(f):
        def loss(q, k, v, cot):
            return jnp.sum(f(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))

    v = {"pallas flash": fwd_bwd(flash_attention),
         "xla (our VJP)": fwd_bwd(attention),
         "jax.grad(reference)": fwd_bwd(attention_reference)}
    if on_gpu:
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                             implementation="cudnn")

        def cudnn_mha(q, k, v):  # K and V repeated to the q heads: what GQA costs cuDNN (dK, dV summed by XLA)
            g = q.shape[2] // k.shape[2]
            return cudnn(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))

        v = {"cudnn": fwd_bwd(cudnn), "cudnn, kv repeated (MHA)": fwd_bwd(cudnn_mha), **v}
    return v


def suite_attention(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """Causal GQA attention fwd+bwd in bf16 at the block's shape: cuDNN, our Pallas flash kernels, our XLA VJP and
    ``jax.grad`` of the reference, timed one after the other in this process (module doc)."""
    s = ATTENTION_SIZES[sizes]
    b, t, hq, hkv, d = s["batch"], s["seq"], s["heads"], s["kv_heads"], s["head_dim"]
    keys = jax.random.split(jax.random.key(t + hq + d), 4)
    q, k, v, cot = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                    for kk, h in zip(keys, (hq, hkv, hkv, hq)))
    # bytes: q, k, v, O, dO read / written once each way, dQ, dK, dV written (bf16): the memory floor, far below
    bytes_moved = 2.0 * (3 * b * t * hq * d + 5 * b * t * hkv * d)
    return bm.run_variants("attention", _variants(jax.default_backend() == "gpu"), (q, k, v, cot), sizes=dict(s),
                           flops=attention_flops(**s), bytes_moved=bytes_moved, precision=precision,
                           floor_precision="tf32", warmup=warmup, repeats=repeats)
