r"""Grouped projections of the LoRA block: projections that read the same input run as one GEMM, the
LoRA ``A`` matrices folded in as extra rows of the frozen weight.

For a group of projections :math:`i = 1..n` on one input :math:`X` ``[N, in]`` (q, k, v on :math:`h_1`; gate, up on
:math:`h_2`; o_proj and down_proj alone), frozen :math:`W_i` ``[out_i, in]`` and, on the targeted ones,
:math:`A_i` ``[r, in]``, :math:`B_i` ``[out_i, r]``, scale :math:`s`:

.. math::

    Z &= X\, [W_1; \dots; W_n; A_{i_1}; \dots; A_{i_k}]^\top
       = [X W_1^\top \,|\, \dots \,|\, X W_n^\top \,|\, U_{i_1} \,|\, \dots \,|\, U_{i_k}]
       \qquad (U_i = X A_i^\top) \\
    Y_i &= Z_{[:, W_i]} + s\, U_i B_i^\top

(one ``dot_general``, accumulated in ``promote_types(dtype, float32)``; the sum and the LoRA term in that type,
:math:`Y_i` rounded once to the block's dtype, as :func:`jaxgrad.ops.lora_linear.lora_linear_fwd` does). Backward,
given :math:`\bar Y_i` (rounded once to the block's dtype), :math:`G_i = \bar Y_i B_i` ``[N, r]``:

.. math::

    \bar X &= [\bar Y_1 \,|\, \dots \,|\, \bar Y_n \,|\, s G_{i_1} \,|\, \dots \,|\, s G_{i_k}]\,
              [W_1; \dots; W_n; A_{i_1}; \dots; A_{i_k}]
            = \textstyle\sum_i \bar Y_i W_i + s \sum_{i\ \mathrm{targeted}} G_i A_i \\
    \bar A_i &= s\, G_i^\top X, \qquad \bar B_i = s\, \bar Y_i^\top U_i

again one ``dot_general`` for :math:`\bar X` (operands in the block's dtype, fp32 accumulation; f64 for f64), the
rank-r gradients as in :func:`jaxgrad.ops.lora_linear.lora_linear_bwd`. :math:`U_i` is the one the block's
recomputed forward already has (its ``Z``); only down_proj, whose forward the backward does not recompute,
forms :math:`U = X A^\top` again.

Why: per projection, the LoRA layer ran :math:`X A^\top` (a GEMM with ``r`` output columns that reads all of
``X``) and :math:`G A` (``r`` contraction, writing an ``[N, in]`` product) beside the base GEMM, and a pass adding
the two ``[N, in]`` products; the H100 profile of the block
(``benchmarks/results/lora-profile-nvidia-h100-80gb-hbm3-bf16-20261125-085340.txt``) has 32 LoRA GEMMs at 1.07 ms of
a 7.05 ms step. Grouped, those skinny GEMMs disappear into the base GEMMs (``r`` extra rows on a weight of 2,048 to
11,264 rows at the benchmark shape), each input is read once per group instead of once per projection and again
for its ``U``, there are fewer launches (forward 4 base GEMMs instead of 7 + 7 skinny), and the :math:`\bar X`
sums of q/k/v and gate/up are the GEMM's own fp32 accumulation instead of separate ``[N, in]`` adds. What remains
per projection is rank-r work: :math:`U B^\top`, :math:`G = \bar Y B` and the two adapter gradients. The price is
stacking the weights (``[W; A]`` is a copy of the frozen base weights per call: 90 MiB written in the forward and
again in the backward at the benchmark shape in bf16, about 0.1 ms of HBM traffic in all on an H100 by the
bandwidth floor, not measured) and the activation cotangents (a concatenation XLA can fuse into the pass that
produces them).

Exact math is unchanged: f32 and f64 blocks compute the same sums (f64 matches ``jax.grad`` of the reference to
~1e-12). In a bf16 block, :math:`s G` is rounded to bf16 before its product with ``A`` (the old path multiplied the
fp32 ``G`` by an fp32 ``A``), and an ``A`` stored in another dtype is rounded to the block's as a row of the
weight.

When grouping does not apply (:func:`groupable`): LoRA dropout (a different mask per projection on the LoRA input,
so :math:`U_i = (m_i \odot X) A_i^\top` is not a product of ``X``), or a projection whose base product comes from
the NF4 Pallas kernels (``backend="pallas"``; there is no dense weight to stack). Those run per projection through
:mod:`jaxgrad.ops.lora_linear`. NF4 weights on the XLA backend are dequantised to a dense array and group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["groupable", "group_fwd", "group_bwd"]


def groupable(kern, weights, dropout: bool) -> bool:
    """Whether a group of projections (their frozen weights, dense or NF4) runs as one GEMM: asked for
    (``block(..., group_projections=True)``: ``kern.group``), no LoRA dropout and no weight whose base product
    comes from the NF4 kernel (``kern.nf4_kernel``)."""
    return kern.group and not dropout and not any(kern.nf4_kernel(w) for w in weights)


def _dot(a, b, ca, cb, cdt):
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=cdt)


def _stack(ws, adapters, dt):
    """``[W_1; ...; W_n; A_i ...]`` in ``dt`` (no copy for a single weight without adapters)."""
    rows = [w.astype(dt) for w in ws] + [a.astype(dt) for a, _ in adapters if a is not None]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


def group_fwd(x, ws, adapters, scale):
    """``(ys, us)``: the projections ``Y_i = X W_i^T + s U_i B_i^T`` (in x's dtype) of one input ``x [..., in]``
    by one GEMM, and their ``U_i = X A_i^T`` (fp32; f64 for f64; ``None`` where untargeted). ``ws``: dense
    ``[out_i, in]`` weights; ``adapters``: ``(A_i, B_i)`` or ``(None, None)`` per weight."""
    dt = x.dtype
    cdt = jnp.promote_types(dt, jnp.float32)
    z = _dot(x, _stack(ws, adapters, dt), x.ndim - 1, 1, cdt)  # Z = X [W; A]^T, fp32 accumulation
    ys, us = [], []
    col = sum(w.shape[0] for w in ws)  # the U columns follow the W columns
    start = 0
    for w, (a, b) in zip(ws, adapters):
        y = z[..., start:start + w.shape[0]]
        start += w.shape[0]
        u = None
        if a is not None:
            u = z[..., col:col + a.shape[0]]
            col += a.shape[0]
            y = y + scale * _dot(u, b.astype(cdt), u.ndim - 1, 1, cdt)  # + s U B^T
        ys.append(y.astype(dt))
        us.append(u)
    return ys, us


def group_bwd(x, ws, adapters, us, scale, douts, dx_dtype):
    """``(dx, grads)`` of :func:`group_fwd`: ``dx = [dY_1 | ... | s G_i ...] [W_1; ...; A_i ...]`` by one GEMM (in
    ``dx_dtype``, unrounded fp32 sums for the block), ``grads[i] = (dA_i, dB_i)`` or ``None`` where untargeted.
    ``us``: the forward's ``U_i`` (``None`` entries are recomputed from ``x``); ``douts``: the ``[..., out_i]``
    cotangents, rounded here once to x's dtype."""
    dt = x.dtype
    cdt = jnp.promote_types(dt, jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    dys = [d.reshape(-1, d.shape[-1]).astype(dt) for d in douts]
    cols, grads = list(dys), []
    for dy, (a, b), u in zip(dys, adapters, us):
        if a is None:
            grads.append(None)
            continue
        g = _dot(dy, b.astype(dt), 1, 0, cdt)  # G = dY B  [N, r]
        u = _dot(x2, a.astype(dt), 1, 1, cdt) if u is None else u.reshape(-1, a.shape[0])
        da = scale * _dot(g.astype(dt), x2, 0, 0, cdt)  # dA = s G^T X
        db = scale * _dot(dy, u.astype(dt), 0, 0, cdt)  # dB = s dY^T U
        grads.append((da.astype(a.dtype), db.astype(b.dtype)))
        cols.append((scale * g).astype(dt))
    lhs = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)
    dx = _dot(lhs, _stack(ws, adapters, dt), 1, 0, cdt)  # sum_i dY_i W_i + s sum_i G_i A_i, fp32 accumulation
    return dx.reshape(*lead, -1).astype(dx_dtype), grads
