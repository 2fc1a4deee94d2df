r"""Flash attention as Pallas kernels (Triton backend): grouped-query causal attention with a padding mask and
segment ids.

The same function as :mod:`jaxgrad.ops.attention` (read its docstring: layout ``q [B, T, Hq, d]``,
``k, v [B, T, Hkv, d]``, query head ``h`` reads kv head ``h // G``, causal + HF 2-D key padding mask + segment ids
for packed rows, ``lse`` saved in fp32 (f64 for f64), a query row with no visible key gives output 0 and zero
gradients), computed block by block so that no ``T x T`` matrix ever reaches HBM, in the style of JAX's
``pallas/ops/gpu/attention.py``. Kernel, reference (:func:`jaxgrad.ops.attention.attention_reference`) and
``custom_vjp`` are in this one file; kernels are compiled through :mod:`jaxgrad.pallas_backend` (Triton on a GPU,
interpret mode elsewhere, any dtype).

Notation per (batch, q head), :math:`c` = ``scale``,
:math:`M_{ij} = [j \le i] \wedge \mathrm{valid}_j \wedge [\mathrm{seg}_i = \mathrm{seg}_j]` (the segment term only
with ``segment_ids``), blocks :math:`Q_I` (``block_q`` rows) and :math:`K_J, V_J` (``block_k`` rows).

**Segment ids** (packing). With ``segment_ids [B, T]`` every kernel also loads the segment ids of its q rows and of
each kv block it visits and masks :math:`\mathrm{seg}_i \ne \mathrm{seg}_j` like a causal or padding entry, so
packed sequences attend block-diagonally. Without them the kernels take no segment input and do no comparison. The
loops still visit every kv block up to the causal limit (a block wholly in earlier segments contributes exact
zeros); skipping such blocks needs contiguous segments, which the function does not assume.

**Forward** (grid: batch, q head, q block :math:`I`; loop over kv blocks :math:`J` up to the causal limit). The
online softmax keeps per row a running max :math:`m`, a running sum :math:`l` and an unnormalised fp32 output
:math:`A`:

.. math::

    S_{IJ} &= c\, Q_I K_J^\top \ (\text{$-\infty$ where } \neg M), \qquad
    m' = \max(m, \max_j S_{IJ}), \qquad \hat m = (m' \text{ if finite else } 0) \\
    \alpha &= e^{m - \hat m}, \qquad P_{IJ} = e^{S_{IJ} - \hat m}, \qquad
    l' = \alpha\, l + \textstyle\sum_j P_{IJ}, \qquad A' = \alpha A + P_{IJ} V_J \\
    O_I &= A / l, \qquad \ell_I = \hat m + \log l \qquad (l = 0:\ O_I = 0,\ \ell_I = -\infty)

:math:`\hat m` keeps :math:`-\infty - (-\infty)` out of the arithmetic while a row has seen no visible key
(``exp(-inf) = 0`` then does the masking); a row that never sees one ends with :math:`l = 0`, output 0 and
:math:`\ell = -\infty`, exactly what :func:`~jaxgrad.ops.attention.attention_fwd` returns for it. ``O`` is written
in the input dtype, :math:`\ell` in fp32 ``[B, Hkv, G, T]`` (``attention_fwd``'s layout).

**Backward** recomputes :math:`P_{IJ} = M\, e^{S_{IJ} - \ell_I}` (0 on rows with :math:`\ell = -\infty`) from the
saved :math:`\ell`, with :math:`\bar P = \bar O V^\top`:

.. math::

    D_i = \textstyle\sum_j P_{ij} \bar P_{ij}, \qquad \bar S = P \odot (\bar P - D), \qquad
    \bar Q_I = c \textstyle\sum_J \bar S_{IJ} K_J, \qquad
    \bar K_J = c \textstyle\sum_{g} \sum_{I} \bar S_{g,IJ}^\top Q_{g,I}, \qquad
    \bar V_J = \textstyle\sum_{g} \sum_{I} P_{g,IJ}^\top \bar O_{g,I}

with :math:`g` over the ``G`` query heads of the kv head (the GQA terms) and :math:`I \ge J` (causal).

* **dQ kernel** (grid: batch, q head, q block), two passes over the kv blocks up to the causal limit: the first
  accumulates :math:`D_I = \sum_J \mathrm{rowsum}(P_{IJ} \odot \bar P_{IJ})`, the second
  :math:`\bar Q_I`. It also writes :math:`D` (fp32, ``[B, Hkv, G, T]``) for the next kernel.
* **dK/dV kernel** (grid: batch, kv head, kv block): loops over the ``G`` query heads of the group and, for each,
  over the q blocks at or after the diagonal, accumulating :math:`\bar K_J` and :math:`\bar V_J` in fp32; no
  ``repeat`` of k/v and no per-q-head partial sums in HBM.

*Why D is computed from P in the kernel.* :math:`D_i = \sum_d \bar O_{id} O_{id}` needs ``O`` at the precision of
the fp32 ``P``: the saved output is rounded to the input dtype, and a bf16-rounded ``O`` puts a 2^-8-relative error
into every :math:`D_i` that :math:`\bar P - D` amplifies where it cancels (``jaxgrad.verify`` flagged that at 69
rounding standard deviations for the XLA attention). The options were (a) a second, fp32 ``O`` output of the
forward (2x the residual memory of ``O`` in bf16, or a changed forward in the block, which only keeps ``lse``) and
(b) :math:`D = \mathrm{rowsum}(P \odot \bar P)` from the backward's own recomputed fp32 ``P`` and ``dP``, as
:func:`~jaxgrad.ops.attention.attention_bwd` does. We take (b): the residuals stay ``q, k, v, lse`` (what
``attention_fwd`` saves), and :math:`D` is consistent with the very ``P`` the backward uses, so
:math:`\sum_j \bar S_{ij} = 0` holds to fp32 rounding. The price is the first pass of the dQ kernel: two more
block products (:math:`Q K^\top` and :math:`\bar O V^\top`) per visible block, 9 instead of 7 in the backward.

*Precision.* Scores :math:`Q K^\top` take the input dtype's operands with an fp32 accumulator (bf16 products are
exact in fp32). ``P``, ``dP``, :math:`\bar S` and the other operands of the products with them are fp32 (f64 for
f64 input); nothing but the outputs is rounded to the input dtype, the numerics of ``attention.py`` (on a GPU
Triton's default fp32 products are TF32, like XLA's). JAX's kernel instead rounds ``P`` and :math:`\bar S` to the
input dtype for bf16 tensor-core products: faster, not measured here.

*Odd sizes.* ``T`` need not be a multiple of the blocks and ``d`` need not be a power of two: blocks are powers of
two (:func:`jaxgrad.pallas_backend.block_size`), whole-sequence refs are padded to a multiple of the block in their
``BlockSpec`` and every load and store is masked (:func:`~jaxgrad.pallas_backend.masked_load` /
:func:`~jaxgrad.pallas_backend.masked_store`), rows and keys past ``T`` counting as not visible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.ops.attention import _check, attention_reference
from jaxgrad.ops.dtypes import compute_dtype

__all__ = ["flash_attention", "flash_attention_fwd", "flash_attention_bwd", "attention_reference"]

DEFAULT_BLOCK = 64  # upper bound of block_q / block_k when not given (clipped to the sequence)


def _blocks(t, d, block_q, block_k):
    """(bq, bk, bd): powers of two; the blocks at most the (padded) sequence, >= 16 (Triton's dot minimum)."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1)):
            raise ValueError(f"flash_attention: '{name}' must be a power of two >= 16, got {b!r}")
    bq = pb.block_size(t, block_q or DEFAULT_BLOCK)
    bk = pb.block_size(t, block_k or DEFAULT_BLOCK)
    bd = pb.block_size(d, 2 * d)  # the whole head_dim, padded to a power of two
    return bq, bk, bd


def _warps(bd):
    return 4 if bd <= 64 else 8


def _row_mask(start, n, seq):
    """Positions ``start .. start+n-1`` and whether each lies inside the sequence."""
    idx = start + jnp.arange(n, dtype=jnp.int32)
    return idx, idx < seq


def _q_block(q_ref, seq: int, head_dim: int):
    """The prologue of a kernel over (batch, q head, q block ``i``): ``(cdt, i, rows, row_in, dmask, q)`` -- the
    accumulation dtype, the block's row positions and which lie inside the sequence, the mask of the real head-dim
    columns (the block is padded to a power of two) and the q block loaded under both masks."""
    bq, bd = q_ref.shape
    i = pl.program_id(2)
    rows, row_in = _row_mask(i * bq, bq, seq)
    dmask = (jnp.arange(bd, dtype=jnp.int32) < head_dim)[None, :]
    return compute_dtype(q_ref.dtype), i, rows, row_in, dmask, pb.masked_load(q_ref, row_in[:, None] & dmask)


def _div(a, b: int):
    """``a // b`` of a traced int32 (``lax.div``, which wants one dtype also under ``jax_enable_x64``)."""
    return lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def _kv_blocks(i, bq, bk, seq):
    """Causal limit of q block ``i``: the number of kv blocks up to key ``min((i+1) bq, T) - 1``."""
    return _div(jnp.minimum((i + 1) * bq, seq) + bk - 1, bk)


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------------------
def _segments(refs, segmented: bool):
    """``(segq_ref, segk_ref, rest)``: a kernel's two segment-id inputs (the q rows' and the keys') when it has them
    (``segmented``), else ``None, None``; ``rest`` are its outputs."""
    return (refs[0], refs[1], refs[2:]) if segmented else (None, None, refs)


def _same_segment(seg_rows, segk_ref, start, n, col_in):
    """``[rows, n]``: whether key ``start + c`` is in the segment of each row (``None`` without segment ids)."""
    if seg_rows is None:
        return None
    seg_cols = pb.masked_load(segk_ref.at[pl.ds(start, n)], col_in, other=0)
    return seg_rows[:, None] == seg_cols[None, :]


def _visible(rows, cols, col_in, valid, same):
    """``M`` of one (q block, kv block): causal, a valid key inside the sequence, (``same``) in the row's segment."""
    visible = (cols[None, :] <= rows[:, None]) & (valid & col_in)[None, :]
    return visible if same is None else visible & same


def _fwd_kernel(q_ref, k_ref, v_ref, valid_ref, *refs, seq, head_dim, scale, block_k, segmented):
    """One (batch, q head, q block): online softmax over the kv blocks up to the causal limit."""
    (bq, bd), bk = q_ref.shape, block_k
    segq_ref, segk_ref, (o_ref, lse_ref) = _segments(refs, segmented)
    cdt, i, rows, row_in, dmask, q = _q_block(q_ref, seq, head_dim)
    seg_rows = None if segq_ref is None else pb.masked_load(segq_ref, row_in, other=0)

    def body(j, carry):
        acc, m, l = carry
        cols, col_in = _row_mask(j * bk, bk, seq)
        kv_mask = col_in[:, None] & dmask
        k = pb.masked_load(k_ref.at[pl.ds(j * bk, bk), :], kv_mask)
        v = pb.masked_load(v_ref.at[pl.ds(j * bk, bk), :], kv_mask).astype(cdt)
        valid = pb.masked_load(valid_ref.at[pl.ds(j * bk, bk)], col_in, other=0) != 0
        # S = c Q K^T (fp32 accumulator), -inf where not visible (causal, padding, past T, another segment)
        s = scale * jnp.dot(q, k.T, preferred_element_type=cdt)
        visible = _visible(rows, cols, col_in, valid, _same_segment(seg_rows, segk_ref, j * bk, bk, col_in))
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_hat = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no (-inf) - (-inf) while a row has seen nothing
        alpha = jnp.exp(m - m_hat)
        p = jnp.exp(s - m_hat[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p, v, preferred_element_type=cdt)
        return acc, m_new, l

    n_kv = _kv_blocks(i, bq, bk, seq)  # causal limit: no later key is visible to a row of this block
    init = (jnp.zeros((bq, bd), cdt), jnp.full((bq,), -jnp.inf, cdt), jnp.zeros((bq,), cdt))
    acc, m, l = lax.fori_loop(0, n_kv, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    # O = A / l (0 for a row with no visible key); lse = m + log l (-inf for such a row, as attention_fwd)
    pb.masked_store(o_ref, acc / l_safe[:, None], row_in[:, None] & dmask)
    m_hat = jnp.where(seen, m, 0.0)
    pb.masked_store(lse_ref, jnp.where(seen, m_hat + jnp.log(l_safe), -jnp.inf), row_in)


def _valid(attention_mask, b, t):
    """The key mask as int32 ``[B, T]`` (all ones without a mask)."""
    if attention_mask is None:
        return jnp.ones((b, t), jnp.int32)
    return (jnp.asarray(attention_mask) != 0).astype(jnp.int32)


def _segment_inputs(segment_ids):
    """The kernels' segment ids: integers of up to 32 bits as int32 (a bijection, so equality is kept), wider ones
    as they are; ``()`` without segment ids."""
    if segment_ids is None:
        return ()
    seg = jnp.asarray(segment_ids)
    return (seg.astype(jnp.int32) if seg.dtype.itemsize <= 4 else seg,)


def flash_attention_fwd(q, k, v, attention_mask=None, scale=None, *, interpret=None, block_q=None, block_k=None,
                        segment_ids=None):
    """``(o, lse)`` as :func:`jaxgrad.ops.attention.attention_fwd`: ``o [B, T, Hq, d]`` in q's dtype, ``lse
    [B, Hkv, G, T]`` in fp32 (f64 for f64), ``-inf`` on rows with no visible key. Pallas kernel, no ``T x T``."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    bq, bk, bd = _blocks(t, d, block_q, block_k)
    tk = pl.cdiv(t, bk) * bk  # the whole-sequence k/v block, padded to a multiple of bk (masked)
    seg = _segment_inputs(segment_ids)
    seg_specs = [pl.BlockSpec((None, bq), lambda bi, h, i: (bi, i)),  # segment ids of the q rows
                 pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0))] if seg else []  # and of the keys
    call = pb.pallas_call(
        functools.partial(_fwd_kernel, seq=t, head_dim=d, scale=scale, block_k=bk, segmented=bool(seg)),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hkv, g, t), compute_dtype(q.dtype))],
        grid=(b, hq, pl.cdiv(t, bq)),
        in_specs=[
            pl.BlockSpec((None, bq, None, bd), lambda bi, h, i: (bi, i, h, 0)),  # q: this head's block I
            pl.BlockSpec((None, tk, None, bd), lambda bi, h, i: (bi, 0, h // g, 0)),  # k: kv head h // G, all T
            pl.BlockSpec((None, tk, None, bd), lambda bi, h, i: (bi, 0, h // g, 0)),  # v
            pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0)),  # key validity
        ] + seg_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, bd), lambda bi, h, i: (bi, i, h, 0)),
            pl.BlockSpec((None, None, None, bq), lambda bi, h, i: (bi, h // g, h % g, i)),
        ],
        name="flash_attention_fwd",
        interpret=interpret,
        num_warps=_warps(bd),
    )
    o, lse = call(q, k, v, _valid(attention_mask, b, t), *(seg * 2))
    return o, lse


# ---------------------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------------------
def _probs(q, k, lse, rows, row_in, cols, col_in, valid, scale, cdt, same=None):
    """``P = M exp(S - lse)`` of one (q block, kv block), recomputed; 0 where not visible or ``lse = -inf``."""
    s = scale * jnp.dot(q, k.T, preferred_element_type=cdt)
    row_ok = row_in & (lse != -jnp.inf)
    lse_safe = jnp.where(row_ok, lse, 0.0)
    visible = _visible(rows, cols, col_in, valid, same) & row_ok[:, None]
    return jnp.where(visible, jnp.exp(s - lse_safe[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, valid_ref, lse_ref, do_ref, *refs, seq, head_dim, scale, block_k, segmented):
    """One (batch, q head, q block): first loop D = rowsum(P dP), second loop dQ = c sum_J P (dP - D) K_J."""
    (bq, bd), bk = q_ref.shape, block_k
    segq_ref, segk_ref, (dq_ref, dd_ref) = _segments(refs, segmented)
    cdt, i, rows, row_in, dmask, q = _q_block(q_ref, seq, head_dim)
    seg_rows = None if segq_ref is None else pb.masked_load(segq_ref, row_in, other=0)
    do = pb.masked_load(do_ref, row_in[:, None] & dmask).astype(cdt)
    lse = pb.masked_load(lse_ref, row_in, other=-jnp.inf)

    def block(j):
        cols, col_in = _row_mask(j * bk, bk, seq)
        kv_mask = col_in[:, None] & dmask
        k = pb.masked_load(k_ref.at[pl.ds(j * bk, bk), :], kv_mask)
        v = pb.masked_load(v_ref.at[pl.ds(j * bk, bk), :], kv_mask).astype(cdt)
        valid = pb.masked_load(valid_ref.at[pl.ds(j * bk, bk)], col_in, other=0) != 0
        same = _same_segment(seg_rows, segk_ref, j * bk, bk, col_in)
        p = _probs(q, k, lse, rows, row_in, cols, col_in, valid, scale, cdt, same)
        dp = jnp.dot(do, v.T, preferred_element_type=cdt)  # dP = dO V^T
        return k, p, dp

    def pass_d(j, dd):  # D_i = sum_j P_ij dP_ij, from the fp32 P (not from the rounded O)
        _, p, dp = block(j)
        return dd + jnp.sum(p * dp, axis=1)

    n_kv = _kv_blocks(i, bq, bk, seq)
    dd = lax.fori_loop(0, n_kv, pass_d, jnp.zeros((bq,), cdt))

    def pass_dq(j, dq):  # dS = P (dP - D); dQ += dS K
        k, p, dp = block(j)
        ds = p * (dp - dd[:, None])
        return dq + jnp.dot(ds, k.astype(cdt), preferred_element_type=cdt)

    dq = lax.fori_loop(0, n_kv, pass_dq, jnp.zeros((bq, bd), cdt))
    pb.masked_store(dq_ref, scale * dq, row_in[:, None] & dmask)
    pb.masked_store(dd_ref, dd, row_in)


def _dkv_kernel(q_ref, k_ref, v_ref, valid_ref, lse_ref, dd_ref, do_ref, *refs, seq, head_dim, scale, block_q,
                groups, segmented):
    """One (batch, kv head, kv block J): dK_J = c sum_g sum_{I >= J} dS^T Q, dV_J = sum_g sum_{I >= J} P^T dO."""
    bk, bd = k_ref.shape
    bq = block_q
    segq_ref, segk_ref, (dk_ref, dv_ref) = _segments(refs, segmented)  # segq: every q row; segk: block J's keys
    cdt = compute_dtype(q_ref.dtype)
    j = pl.program_id(2)
    cols, col_in = _row_mask(j * bk, bk, seq)
    dmask = (jnp.arange(bd, dtype=jnp.int32) < head_dim)[None, :]
    kv_mask = col_in[:, None] & dmask
    k = pb.masked_load(k_ref, kv_mask)
    v = pb.masked_load(v_ref, kv_mask).astype(cdt)
    valid = pb.masked_load(valid_ref, col_in, other=0) != 0
    seg_cols = None if segk_ref is None else pb.masked_load(segk_ref, col_in, other=0)
    first_q = _div(j * bk, bq)  # the first q block with a row >= j bk (causal: earlier ones see none of J)
    n_q = pl.cdiv(seq, bq)

    def head(g, carry):
        def q_block(i, carry):
            dk, dv = carry
            rows, row_in = _row_mask(i * bq, bq, seq)
            qd_mask = row_in[:, None] & dmask
            q = pb.masked_load(q_ref.at[pl.ds(i * bq, bq), g, :], qd_mask)
            do = pb.masked_load(do_ref.at[pl.ds(i * bq, bq), g, :], qd_mask).astype(cdt)
            lse = pb.masked_load(lse_ref.at[g, pl.ds(i * bq, bq)], row_in, other=-jnp.inf)
            dd = pb.masked_load(dd_ref.at[g, pl.ds(i * bq, bq)], row_in)
            same = None if seg_cols is None else \
                pb.masked_load(segq_ref.at[pl.ds(i * bq, bq)], row_in, other=0)[:, None] == seg_cols[None, :]
            p = _probs(q, k, lse, rows, row_in, cols, col_in, valid, scale, cdt, same)
            dp = jnp.dot(do, v.T, preferred_element_type=cdt)  # dP = dO V^T
            ds = p * (dp - dd[:, None])  # dS = P (dP - D)
            dv = dv + jnp.dot(p.T, do, preferred_element_type=cdt)  # dV += P^T dO
            dk = dk + jnp.dot(ds.T, q.astype(cdt), preferred_element_type=cdt)  # dK += dS^T Q
            return dk, dv

        return lax.fori_loop(first_q, n_q, q_block, carry)

    init = (jnp.zeros((bk, bd), cdt), jnp.zeros((bk, bd), cdt))
    dk, dv = lax.fori_loop(0, groups, head, init)  # the G query heads of this kv head: the GQA sum
    pb.masked_store(dk_ref, scale * dk, kv_mask)
    pb.masked_store(dv_ref, dv, kv_mask)


def flash_attention_bwd(q, k, v, lse, do, attention_mask=None, scale=None, *, interpret=None, block_q=None,
                        block_k=None, segment_ids=None):
    """``(dq, dk, dv)`` as :func:`jaxgrad.ops.attention.attention_bwd`, from the saved ``lse`` (``P`` recomputed
    block by block); ``do`` is read in its own dtype (the block passes fp32 gradient sums)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    bq, bk, bd = _blocks(t, d, block_q, block_k)
    tq, tk = pl.cdiv(t, bq) * bq, pl.cdiv(t, bk) * bk  # whole-sequence blocks, padded (masked)
    valid = _valid(attention_mask, b, t)
    cdt = compute_dtype(q.dtype)
    lse = lse.astype(cdt)
    seg = _segment_inputs(segment_ids)

    # dQ and D: grid over (batch, q head, q block), as the forward
    dq, dd = pb.pallas_call(
        functools.partial(_dq_kernel, seq=t, head_dim=d, scale=scale, block_k=bk, segmented=bool(seg)),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hkv, g, t), cdt)],
        grid=(b, hq, pl.cdiv(t, bq)),
        in_specs=[
            pl.BlockSpec((None, bq, None, bd), lambda bi, h, i: (bi, i, h, 0)),  # q
            pl.BlockSpec((None, tk, None, bd), lambda bi, h, i: (bi, 0, h // g, 0)),  # k
            pl.BlockSpec((None, tk, None, bd), lambda bi, h, i: (bi, 0, h // g, 0)),  # v
            pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0)),  # key validity
            pl.BlockSpec((None, None, None, bq), lambda bi, h, i: (bi, h // g, h % g, i)),  # lse
            pl.BlockSpec((None, bq, None, bd), lambda bi, h, i: (bi, i, h, 0)),  # dO
        ] + ([pl.BlockSpec((None, bq), lambda bi, h, i: (bi, i)),  # segment ids of the q rows
              pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0))] if seg else []),  # and of the keys
        out_specs=[
            pl.BlockSpec((None, bq, None, bd), lambda bi, h, i: (bi, i, h, 0)),  # dq
            pl.BlockSpec((None, None, None, bq), lambda bi, h, i: (bi, h // g, h % g, i)),  # D
        ],
        name="flash_attention_dq",
        interpret=interpret,
        num_warps=_warps(bd),
    )(q, k, v, valid, lse, do, *(seg * 2))

    # dK, dV: grid over (batch, kv head, kv block); the G heads of the group are the block's head axis
    dk, dv = pb.pallas_call(
        functools.partial(_dkv_kernel, seq=t, head_dim=d, scale=scale, block_q=bq, groups=g, segmented=bool(seg)),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(b, hkv, pl.cdiv(t, bk)),
        in_specs=[
            pl.BlockSpec((None, tq, g, bd), lambda bi, h, j: (bi, 0, h, 0)),  # q: heads h G .. h G + G - 1
            pl.BlockSpec((None, bk, None, bd), lambda bi, h, j: (bi, j, h, 0)),  # k: block J
            pl.BlockSpec((None, bk, None, bd), lambda bi, h, j: (bi, j, h, 0)),  # v
            pl.BlockSpec((None, bk), lambda bi, h, j: (bi, j)),  # key validity of block J
            pl.BlockSpec((None, None, g, tq), lambda bi, h, j: (bi, h, 0, 0)),  # lse of the group
            pl.BlockSpec((None, None, g, tq), lambda bi, h, j: (bi, h, 0, 0)),  # D of the group
            pl.BlockSpec((None, tq, g, bd), lambda bi, h, j: (bi, 0, h, 0)),  # dO of the group
        ] + ([pl.BlockSpec((None, tq), lambda bi, h, j: (bi, 0)),  # segment ids of every q row
              pl.BlockSpec((None, bk), lambda bi, h, j: (bi, j))] if seg else []),  # and of block J's keys
        out_specs=[
            pl.BlockSpec((None, bk, None, bd), lambda bi, h, j: (bi, j, h, 0)),
            pl.BlockSpec((None, bk, None, bd), lambda bi, h, j: (bi, j, h, 0)),
        ],
        name="flash_attention_dkv",
        interpret=interpret,
        num_warps=_warps(bd),
    )(q, k, v, valid, lse, dd, do, *(seg * 2))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------------------------
def _flash_impl(q, k, v, attention_mask, segment_ids, scale, interpret, block_q, block_k):
    return flash_attention_fwd(q, k, v, attention_mask, scale, interpret=interpret, block_q=block_q,
                               block_k=block_k, segment_ids=segment_ids)[0]


_flash = jax.custom_vjp(_flash_impl, nondiff_argnums=(5, 6, 7, 8))


def _fwd(q, k, v, attention_mask, segment_ids, scale, interpret, block_q, block_k):
    o, lse = flash_attention_fwd(q, k, v, attention_mask, scale, interpret=interpret, block_q=block_q,
                                 block_k=block_k, segment_ids=segment_ids)
    return o, (q, k, v, lse, attention_mask, segment_ids)  # as attention.py: no O, no P saved


def _bwd(scale, interpret, block_q, block_k, res, do):
    q, k, v, lse, attention_mask, segment_ids = res
    dq, dk, dv = flash_attention_bwd(q, k, v, lse, do, attention_mask, scale, interpret=interpret,
                                     block_q=block_q, block_k=block_k, segment_ids=segment_ids)
    return dq, dk, dv, None, None  # the mask and the segment ids are not differentiated


_flash.defvjp(_fwd, _bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, attention_mask: jax.Array | None = None,
                    scale: float | None = None, *, interpret: bool | None = None, block_q: int | None = None,
                    block_k: int | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention as Pallas flash-attention kernels with a hand-written VJP (saves the fp32 ``lse``).

    Same function and arguments as :func:`jaxgrad.ops.attention.attention` (``segment_ids`` included: packed rows
    attend block-diagonally), plus:
      interpret: Pallas interpret mode (``None``: on unless JAX's default backend is a GPU).
      block_q, block_k: upper bounds of the q and kv blocks (powers of two >= 16; default 64, clipped to the
        sequence). ``T`` need not be a multiple of either.
    """
    _check(q, k, v, attention_mask, segment_ids)
    _blocks(q.shape[1], q.shape[3], block_q, block_k)  # argument errors now, not inside a trace
    return _flash(q, k, v, attention_mask, segment_ids, None if scale is None else float(scale),
                  None if interpret is None else bool(interpret), block_q, block_k)


def audit_cases():
    """Cases for ``jaxgrad audit``: the kernels (16-row blocks, so several q and kv blocks and a partial last one)
    on the inputs, padding and packed rows (segment ids) of :func:`jaxgrad.ops.attention.audit_cases`."""
    from jaxgrad.ops.attention import (audit_make_qkv, audit_padding_mask, audit_segment_ids, masked_reference,
                                       packed_reference)
    from jaxgrad.ops.registry import OpAudit

    def fn(q, k, v):
        return flash_attention(q, k, v, audit_padding_mask(q.shape[0], q.shape[1]), block_q=16, block_k=16)

    def packed(q, k, v):
        return flash_attention(q, k, v, segment_ids=audit_segment_ids(q.shape[0], q.shape[1]), block_q=16,
                               block_k=16)

    sizes = ((2, 7, 3, 1, 8), (2, 29, 4, 2, 16), (2, 77, 4, 2, 32))
    return (OpAudit("flash_attention[pallas]", fn, masked_reference, audit_make_qkv, sizes,
                    arg_names=("q", "k", "v"), backend="pallas", interpret_sizes=sizes[:2]),
            OpAudit("flash_attention[pallas] packed", packed, packed_reference, audit_make_qkv, sizes,
                    arg_names=("q", "k", "v"), backend="pallas", interpret_sizes=sizes[:2]))
