r"""The attention core of the LoRA block on each implementation, with padding masks and segment ids.

Every implementation computes :func:`jaxgrad.ops.attention.attention_reference`'s function of ``q [B, T, Hq, d]``,
``k, v [B, T, Hkv, d]`` (after RoPE) with the mask

.. math::

    M_{ij} = [j \le i] \wedge \mathrm{valid}_j \wedge [\mathrm{seg}_{b,i} = \mathrm{seg}_{b,j}]

(``valid`` from HF's ``attention_mask``, ``seg`` from ``segment_ids``; each term only when given). A query row with
no visible key gets output 0 and adds nothing to any gradient. How each implementation takes the mask:

* ``"xla"``: the ``[B, Hq, T, T]`` scores are masked (:mod:`jaxgrad.ops.attention`); the block's VJP saves the fp32
  ``lse`` and recomputes ``P``.
* ``"pallas"``: each flash-attention kernel loads its kv block's key validity and, with segment ids, the segment ids
  of its q rows and kv block (:mod:`jaxgrad.ops.flash_attention`).
* ``"cudnn"`` (and ``"sdpa:<implementation>"``, the same code path with another ``jax.nn.dot_product_attention``
  implementation, run on a CPU by the tests): :func:`cudnn_attention`. Without segment ids a concrete right-padded
  mask goes in as per-row key lengths (no mask tensor); otherwise -- any other padding, every mask under ``jit``,
  and every call with segment ids -- as the boolean ``[B, 1, T, T]`` mask
  :math:`[\mathrm{seg}_i = \mathrm{seg}_j] \wedge \mathrm{valid}_j` (cuDNN's ``is_causal`` adds :math:`j \le i`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrad.ops.attention import attention_bwd, attention_fwd, attention_out_from_lse, attention_reference
from jaxgrad.ops.flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd

__all__ = ["attention_core_bwd", "attention_core_fwd", "attention_core_reference", "cudnn_attention"]


def _key_mask(attention_mask, segment_ids, b, t):
    """``[B, T, T]`` boolean: key ``j`` is a token (``valid_j``) in query ``i``'s segment; causality is left to
    cuDNN's ``is_causal``."""
    seg = jnp.asarray(segment_ids)
    allowed = seg[:, :, None] == seg[:, None, :]
    if attention_mask is not None:
        allowed = allowed & (jnp.asarray(attention_mask) != 0)[:, None, :]
    return jnp.broadcast_to(allowed, (b, t, t))


def cudnn_attention(q, k, v, attention_mask, attn, return_residual=False, key_lengths=False, segment_ids=None):
    r"""Causal GQA attention through ``jax.nn.dot_product_attention``, honouring any ``[B, T]`` padding mask and
    segment ids.

    ``attn``: "cudnn", or "sdpa:<implementation>" (the same path with another implementation: the block's private
    ``_block_sdpa``, ``_block_reference`` and :func:`jaxgrad.lora.model._apply` reach it on a CPU).
    ``return_residual``: ``(O, lse)``, cuDNN's training-mode forward (see :func:`attention_core_fwd`).

    The mask, in one of two forms (the caller picks; both give
    :func:`jaxgrad.ops.attention.attention_reference`'s function):

    * ``key_lengths=True``, only for a mask known to be right padding (a concrete one,
      :func:`jaxgrad.ops.attention.right_padded`) and no segment ids: per-row key lengths
      (``key_value_seq_lengths``, cuDNN's padding-causal mask: no mask tensor). A row of padding only gets length 1
      (its output is zeroed below).
    * otherwise (left padding, gaps, any mask under ``jit``, segment ids): a boolean ``[B, 1, T, T]`` mask,
      ``valid_j`` and, with segment ids, :math:`\mathrm{seg}_i = \mathrm{seg}_j` (``mask=``; cuDNN adds it as a bias
      of 0 / a large negative number, in training and in its backward, with no bias gradient for a boolean mask):
      packed sequences attend block-diagonally.

    Query rows with no visible key (no token at or before them in their segment) get output 0 (``where``: their
    cotangent is 0, so they add nothing to any gradient), as in the reference; in either form cuDNN gives such a
    row a finite, uniform softmax over masked keys, never NaN.

    An odd ``T`` is padded by one position, with or without a mask: JAX 0.11's cuDNN training rule refuses odd
    lengths ("Unsupported sequence length Q 77, KV 77": its bias check counts the empty placeholder it passes when
    there is no bias). The extra key comes after every real query (causal: none sees it; it is padding in the mask
    form and beyond every key length) and the extra query row is dropped, so the result is unchanged."""
    implementation = attn.split(":", 1)[1] if attn.startswith("sdpa:") else attn
    b, t = q.shape[:2]
    pad = t % 2
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 1), (0, 0), (0, 0))) for a in (q, k, v))
    sdpa = functools.partial(jax.nn.dot_product_attention, q, k, v, is_causal=True, implementation=implementation,
                             return_residual=return_residual)
    valid = None if attention_mask is None else jnp.asarray(attention_mask) != 0  # [B, T]: the keys
    if segment_ids is not None:
        allowed = _key_mask(attention_mask, segment_ids, b, t)  # [B, T, T]: valid_j and seg_i = seg_j
        out = sdpa(mask=jnp.pad(allowed, ((0, 0), (0, pad), (0, pad)))[:, None])  # the extra row and key: masked
    elif valid is None:
        out = sdpa()
    elif key_lengths:
        out = sdpa(key_value_seq_lengths=jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(jnp.int32))
    else:
        valid_p = jnp.pad(valid, ((0, 0), (0, pad)))  # the extra key (odd T) is padding
        out = sdpa(mask=jnp.broadcast_to(valid_p[:, None, None, :], (b, 1, t + pad, t + pad)))
    if pad:
        out = tuple(a[:, :t] for a in out) if return_residual else out[:, :t]
    if valid is None and segment_ids is None:
        return out
    o, res = out if return_residual else (out, None)
    if segment_ids is None:
        seen = jnp.cumsum(valid.astype(jnp.int32), axis=-1) > 0  # [B, T]: the query row sees at least one key
    else:
        seen = jnp.any(allowed & jnp.tril(jnp.ones((t, t), bool)), axis=-1)  # a visible key j <= i in the segment
    o = jnp.where(seen[:, :, None, None], o, jnp.zeros((), o.dtype))
    return (o, res) if return_residual else o


def attention_core_reference(attention, q, k, v, attention_mask=None, segment_ids=None, key_lengths=False):
    """The attention of the plain reference block (differentiated by ``jax.grad``): the plain attention (``"xla"``),
    the flash-attention kernels with their own VJP (``"pallas"``) or :func:`cudnn_attention` (else)."""
    if attention == "xla":
        return attention_reference(q, k, v, attention_mask, segment_ids=segment_ids)
    if attention == "pallas":
        return flash_attention(q, k, v, attention_mask, segment_ids=segment_ids)
    return cudnn_attention(q, k, v, attention_mask, attention, key_lengths=key_lengths, segment_ids=segment_ids)


def attention_core_fwd(attn, q, k, v, attention_mask, segment_ids, lse, kern):
    """``(o, lse, pullback)`` of the block's VJP: in the forward (``lse=None``) and in the backward's recompute (the
    saved ``lse``). ``pullback`` is cuDNN's (``"cudnn"`` / ``"sdpa:..."``), else ``None``."""
    if attn == "pallas":
        # the flash-attention kernel: in the backward's recompute it runs again for O (lse is the saved one)
        o, lse_new = flash_attention_fwd(q, k, v, attention_mask, interpret=kern.interpret, segment_ids=segment_ids)
        return o, (lse_new if lse is None else lse), None
    if attn != "xla":
        # one cuDNN forward per step: its pullback (cuDNN's saved output and softmax statistics) serves the
        # backward, which does not run the forward again. It is cuDNN's training-mode forward (return_residual: O
        # and the softmax statistics) in the forward too, where the pullback is unused: without return_residual JAX
        # would run the inference-mode call there, a custom call other than the recompute's, and XLA could not
        # merge the two; identical calls are merged (CSE) when both are in one program
        (o, cudnn_lse), pull = jax.vjp(
            lambda q, k, v: cudnn_attention(q, k, v, attention_mask, attn, True, kern.cudnn_key_lengths,
                                            segment_ids), q, k, v)
        return o, lse, lambda do: pull((do, jnp.zeros_like(cudnn_lse)))  # O's cotangent only
    if lse is None:
        o, lse = attention_fwd(q, k, v, attention_mask, segment_ids=segment_ids)
        return o, lse, None
    return attention_out_from_lse(q, k, v, lse, attention_mask, segment_ids=segment_ids).astype(q.dtype), lse, None


def attention_core_bwd(attn, q, k, v, lse, do, attention_mask, segment_ids, kern, pullback):
    """``(dq, dk, dv)`` of the block's attention core, from the recompute (:func:`attention_core_fwd`)."""
    if attn == "pallas":
        # the same equations as attention_bwd in Pallas kernels (D = rowsum(P dP) from the fp32 P, in the dQ kernel)
        return flash_attention_bwd(q, k, v, lse, do, attention_mask, interpret=kern.interpret,
                                   segment_ids=segment_ids)
    if attn != "xla":
        return pullback(do.astype(q.dtype))
    # dS = P (dP - rowsum(P dP)), dQ = c dS K, dK = c sum_g dS^T Q, dV = sum_g P^T dO
    return attention_bwd(q, k, v, lse, do, attention_mask, segment_ids=segment_ids)
