r"""The LM head and its causal cross-entropy, fused: the summed token loss of ``h W^T`` without ``[tokens, vocab]``
logits -- reference and chunked custom VJP side by side.

Shapes: ``h [B, T, H]`` (the final-normed hidden states), ``W [V, H]`` (the LM head, or the tied embedding),
``labels [B, T]`` with Hugging Face's shift: the logits at position ``t`` predict ``labels[:, t + 1]``; the last
position of a row predicts nothing. Over the token rows :math:`i` (every ``(b, t)`` with ``t < T - 1``), target
:math:`y_i = \text{labels}[b, t + 1]` and :math:`c_i = [y_i \ne \text{ignore\_index}]`:

.. math::

    z_i &= W h_i \in \mathbb{R}^V, \qquad
    \mathrm{lse}_i = \log \sum_v e^{z_{iv}}, \qquad
    L = \sum_i c_i\, (\mathrm{lse}_i - z_{i y_i}) \\
    \frac{\partial L}{\partial z_i} &= c_i\, (\operatorname{softmax}(z_i) - e_{y_i}), \qquad
    \bar h_i = \bar L\, \Bigl(\frac{\partial L}{\partial z_i}\Bigr) W, \qquad
    \bar W = \bar L \sum_i \Bigl(\frac{\partial L}{\partial z_i}\Bigr)^{\!\top} h_i

:func:`lm_head_loss` computes this ``chunk_tokens`` token rows at a time (``jax.lax.scan``), and within a chunk
``chunk_vocab`` vocabulary rows of ``W`` at a time with an online log-sum-exp (``m' = max(m, max_v z_v)``,
``s' = s e^{m - m'} + \sum_v e^{z_v - m'}``, ``lse = m + log s``). The forward saves ``h``, ``W``, the targets
and, per token, the log-sum-exp's max ``m`` and sum ``s`` (``[tokens]`` fp32 each) -- never the logits; the
backward recomputes each chunk's logits, forms ``dZ = (exp(Z - m) / s - onehot(y)) * c * L_bar`` and
accumulates ``dh_chunk = dZ W`` and ``dW += dZ^T h_chunk`` in fp32 (``promote_types(dtype, float32)``), so the
largest temporary is one ``[chunk_tokens, chunk_vocab]`` block (a few of them: ``Z``, its softmax, ``dZ``), not
``[tokens, vocab]``. (``exp(Z - lse)`` would put ``lse``'s absolute rounding, ``u |lse|``, into a whole row of
the softmax as one relative error; ``exp(Z - m) / s`` puts only ``s``'s relative rounding ``u`` there.)

Precision: the logits accumulate in ``promote_types(dtype, float32)`` (``preferred_element_type``, as the model's
head einsum does) and stay there for the log-sum-exp: unlike :func:`jaxgrad.lora.model.apply`, whose logits are
rounded once to the activation dtype before the loss upcasts them, neither function here rounds them (for float32
and float64 the two are the same). ``dZ`` is rounded to the inputs' dtype for its two products (tensor-core
operands; exact for float32 and float64), which accumulate in fp32.

**A frozen head** (``head_grad=False``: LoRA, whose head and tied embedding are constants) is the function of
``stop_gradient(W)``: its ``dW`` is zero, and the whole gradient is ``dh``, which needs only the forward's quantities.
So the forward forms it there, Liger-Kernel's way: per token chunk, ``Z`` (once), ``m``, ``s``, then ``dZ / L_bar =
c (exp(Z - m) / s - onehot(y))`` and ``dh_chunk / L_bar = (dZ / L_bar) W``, saved ``[tokens, hidden]`` in
``promote_types(dtype, float32)``; the backward only scales it by ``L_bar`` (and rounds once to ``h``'s dtype). Two
``[tokens, vocab, hidden]`` products instead of three; with vocabulary chunks the forward makes two passes over
them (the log-sum-exp first, then ``dZ``), so the logits are still formed twice there.

Token chunks that do not divide the ``B * T`` rows: the last chunk is the last ``chunk_tokens`` rows, and the rows
it shares with the previous chunk count as ignored there (their loss and their ``dh`` were taken in their own
chunk): no copy of ``h`` is padded. Vocabulary chunks the same way: the columns of the last chunk that the previous
one covered are masked out of its log-sum-exp and its ``dZ``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.ops import lm_head_loss_mgpu
from jaxgrad.ops.dtypes import compute_dtype

__all__ = ["BACKENDS", "DEFAULT_CHUNK_TOKENS", "backend_beside", "lm_head_loss", "lm_head_loss_reference",
           "shifted_targets"]

#: Token rows per chunk by default: at vocabulary 128,256 one chunk's fp32 logits are 1024 x 128,256 x 4 B = 525 MB
#: (the plain loss holds 8.4 GB of fp32 logits and their gradient for 8192 tokens).
DEFAULT_CHUNK_TOKENS = 1024
#: ``xla``: the chunked custom VJP on XLA's ops; ``mosaic``: its frozen-head path with the logits' Mosaic GPU kernel
#: (:mod:`jaxgrad.ops.lm_head_loss_mgpu`; Hopper, 16-bit operands, ``head_grad=False``, ``chunk_vocab=None``)
BACKENDS = ("xla", "mosaic")


# ---------------------------------------------------------------------------------------------------------------
# Checks (named arguments; the label range where the labels are concrete)
# ---------------------------------------------------------------------------------------------------------------
def _check_inputs(h, w, labels, ignore_index, where: str) -> None:
    for name, x, ndim, shape in (("h", h, 3, "[batch, seq, hidden]"), ("w", w, 2, "[vocab, hidden]")):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{where}: '{name}' must be a floating-point array {shape}, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim != ndim:
            raise ValueError(f"{where}: '{name}' must be {shape}, got shape {x.shape}")
    if w.shape[1] != h.shape[2]:
        raise ValueError(f"{where}: 'w' must be [vocab, hidden] with hidden = h.shape[2] = {h.shape[2]}, got shape "
                         f"{w.shape}")
    if w.shape[0] < 1:
        raise ValueError(f"{where}: 'w' must have at least one vocabulary row, got shape {w.shape}")
    if h.dtype != w.dtype:
        raise TypeError(f"{where}: 'h' and 'w' must have the same dtype, got {h.dtype} and {w.dtype}")
    if np.shape(labels) != h.shape[:2]:
        raise ValueError(f"{where}: 'labels' must be [batch, seq] = {h.shape[:2]} (h's first two axes), got shape "
                         f"{np.shape(labels)}")
    if not jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer):
        raise TypeError(f"{where}: 'labels' must be integers, got {jnp.asarray(labels).dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"{where}: 'ignore_index' must be an int, got {ignore_index!r}")
    check_label_range(labels, w.shape[0], ignore_index, where)


def check_label_range(labels, vocab: int, ignore_index: int, where: str, vocab_from: str = "the rows of 'w'"
                      ) -> None:
    """Labels in ``[0, vocab)`` or ``ignore_index``, checked on the host where they are concrete (as PyTorch's
    cross-entropy raises); traced labels cannot be, and an out-of-range one makes the loss NaN. ``vocab_from``
    says where the vocabulary size comes from, for the message."""
    if isinstance(labels, jax.core.Tracer):
        return
    lab = np.asarray(labels)
    bad = ((lab < 0) | (lab >= vocab)) & (lab != ignore_index)
    if bad.any():
        at = [int(i) for i in np.argwhere(bad)[0]]
        raise ValueError(f"{where}: 'labels' must lie in [0, {vocab}) (the vocabulary size: {vocab_from}) or be "
                         f"{ignore_index} (ignored), got {lab[tuple(at)].item()} at {at}")


def backend_beside(block_backend: str, dtype, head_grad: bool, chunk_vocab: int | None = None) -> str:
    """The head's backend beside a model whose blocks run on ``block_backend``: ``"mosaic"`` where those run Mosaic
    GPU kernels (on a GPU) and the head qualifies (frozen, the whole vocabulary per chunk, bf16 or f16), else
    ``"xla"``. On the H100 the Mosaic kernel takes 0.91x XLA's time at the 1B head and 0.96x at the 8B one
    (``benchmarks/results/lm_head-nvidia-h100-80gb-hbm3-bf16-20261127-041452.json``)."""
    qualifies = (block_backend == "mosaic" and not head_grad and chunk_vocab is None
                 and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
                 and jax.default_backend() == "gpu")
    return "mosaic" if qualifies else "xla"


def _check_backend(backend, h, w, head_grad, chunk_vocab, where: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{where}: 'backend' must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return
    if head_grad:
        raise ValueError(f"{where}: backend='mosaic' computes a frozen head's loss; it needs head_grad=False")
    if chunk_vocab is not None:
        raise ValueError(f"{where}: backend='mosaic' takes the whole vocabulary per chunk; it needs chunk_vocab=None, "
                         f"got {chunk_vocab!r}")
    why = lm_head_loss_mgpu.supported(h.reshape(-1, h.shape[-1]), w)
    if why is not None:
        raise ValueError(f"{where}: backend='mosaic': {why}")


def _check_chunk(value, name: str, where: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: '{name}' must be an int >= 1{' or None' if optional else ''}, got {value!r}")


def shifted_targets(labels, ignore_index: int = -100) -> jax.Array:
    """``[B, T]`` targets of the token rows: ``labels[:, t + 1]`` at ``t < T - 1`` and ``ignore_index`` at each
    row's last position (HF's shift, without dropping a column of ``h``)."""
    labels = jnp.asarray(labels)
    pad = jnp.full((labels.shape[0], 1), ignore_index, labels.dtype)
    return jnp.concatenate([labels[:, 1:], pad], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# Reference: the whole [tokens, vocab] logits, differentiated by jax.grad
# ---------------------------------------------------------------------------------------------------------------
def lm_head_loss_reference(h, w, labels, *, ignore_index: int = -100):
    """``(sum of the token losses, number of counted labels)``: plain JAX over the whole ``[B, T - 1, V]`` logits,
    the oracle of :func:`lm_head_loss` (the same token losses as :func:`jaxgrad.lora.model.token_losses` of
    ``einsum("bth,vh->btv", h, w)``).

    The sum is in ``promote_types(dtype, float32)`` (float32 for bf16 and f32, float64 for f64), the count an
    int32. A label outside ``[0, vocab)`` other than ``ignore_index`` is a ``ValueError`` naming ``labels`` where
    the labels are concrete; traced (under ``jit``) its token's loss is NaN, never another class's."""
    _check_inputs(h, w, labels, ignore_index, "lm_head_loss_reference")
    cdt = compute_dtype(h.dtype)
    z = jnp.einsum("bth,vh->btv", h[:, :-1], w, preferred_element_type=cdt)
    target = jnp.asarray(labels)[:, 1:]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < w.shape[0])
    safe = jnp.where(valid & in_range, target, 0)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    loss = jnp.where(in_range, lse - picked, jnp.nan)
    return jnp.sum(jnp.where(valid, loss, 0.0)), jnp.sum(valid, dtype=jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# The chunked custom VJP over rows h2 [N, H] (N = B * T), targets [N]
# ---------------------------------------------------------------------------------------------------------------
def _chunks(total: int, size: int) -> tuple[int, int]:
    """``(size, count)``: chunks of ``min(size, total)`` covering ``total`` rows, the last one clamped to end at
    ``total``."""
    size = min(size, total)
    return size, -(-total // size)


def _start(i, size: int, total: int):
    """First row of chunk ``i``: ``i * size``, except that the last chunk ends at ``total`` (and so overlaps its
    predecessor, whose rows it then treats as already done)."""
    return jnp.minimum(i * size, total - size)


def _token_chunk(h2, targets, i, ct: int, ignore_index: int):
    """Rows, targets, ``valid`` (counted and not done by an earlier chunk) and ``in_range`` of token chunk ``i``."""
    n = h2.shape[0]
    start = _start(i, ct, n)
    hc = jax.lax.dynamic_slice_in_dim(h2, start, ct, axis=0)
    yc = jax.lax.dynamic_slice_in_dim(targets, start, ct, axis=0)
    fresh = start + jnp.arange(ct) >= i * ct
    valid = fresh & (yc != ignore_index)
    return start, hc, yc, valid, fresh


def _vocab_logits(hc, w, j, cv: int, cdt):
    """Logits of vocabulary chunk ``j`` ``[chunk, cv]``, the columns an earlier chunk covered set to ``-inf``; and
    the chunk's first column."""
    v = w.shape[0]
    vstart = _start(j, cv, v)
    wj = jax.lax.dynamic_slice_in_dim(w, vstart, cv, axis=0)
    z = jnp.einsum("ch,vh->cv", hc, wj, preferred_element_type=cdt)
    fresh = vstart + jnp.arange(cv) >= j * cv
    return jnp.where(fresh[None, :], z, -jnp.inf), vstart, wj


def _chunk_lse_and_target(hc, w, yc, ct: int, cv: int, nv: int, cdt):
    """``(m, s, z_target)``, each ``[ct]``, of one token chunk (``lse = m + log s``), online over the vocabulary
    chunks."""
    def step(carry, j):
        m, s, picked = carry
        z, vstart, _ = _vocab_logits(hc, w, j, cv, cdt)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
        local = yc - vstart
        mine = (local >= j * cv - vstart) & (local < cv)  # the target's column is a fresh column of this chunk
        at = jnp.take_along_axis(z, jnp.clip(local, 0, cv - 1)[:, None], axis=-1)[:, 0]
        return (m_new, s, jnp.where(mine, at, picked)), None

    init = (jnp.full((ct,), -jnp.inf, cdt), jnp.zeros((ct,), cdt), jnp.zeros((ct,), cdt))
    (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(nv))
    return m, s, picked


def _forward(h2, w, targets, ignore_index: int, chunk_tokens: int, chunk_vocab: int):
    cdt = compute_dtype(h2.dtype)
    n, v = h2.shape[0], w.shape[0]
    ct, nt = _chunks(n, chunk_tokens)
    cv, nv = _chunks(v, chunk_vocab)

    def step(total, i):
        _, hc, yc, valid, _ = _token_chunk(h2, targets, i, ct, ignore_index)
        m, s, picked = _chunk_lse_and_target(hc, w, yc, ct, cv, nv, cdt)
        in_range = (yc >= 0) & (yc < v)
        loss = jnp.where(valid, jnp.where(in_range, m + jnp.log(s) - picked, jnp.nan), 0.0)
        return total + jnp.sum(loss), (m, s)

    total, stats = jax.lax.scan(step, jnp.zeros((), cdt), jnp.arange(nt))
    return total, stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _lm_head_loss(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab):
    return _forward(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab)[0]


def _fwd(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab):
    total, stats = _forward(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab)
    return total, (h2, w, targets, stats)


def _bwd(ignore_index, chunk_tokens, chunk_vocab, residuals, g):
    h2, w, targets, (m_all, s_all) = residuals
    cdt = compute_dtype(h2.dtype)
    n, v = h2.shape[0], w.shape[0]
    ct, nt = _chunks(n, chunk_tokens)
    cv, nv = _chunks(v, chunk_vocab)
    g = g.astype(cdt)

    def token_step(carry, i):
        dh, dw = carry
        start, hc, yc, valid, fresh = _token_chunk(h2, targets, i, ct, ignore_index)
        m, s = m_all[i], s_all[i]
        in_range = (yc >= 0) & (yc < v)
        # per row: 0 where not counted, NaN where the label is out of range (the loss is NaN there), else g
        row = jnp.where(valid, jnp.where(in_range, g, jnp.nan), 0.0)

        def vocab_step(carry, j):
            dhc, dw = carry
            z, vstart, wj = _vocab_logits(hc, w, j, cv, cdt)
            onehot = (yc - vstart)[:, None] == jnp.arange(cv)[None, :]
            dz = (jnp.exp(z - m[:, None]) / s[:, None] - onehot) * row[:, None]
            dz = jnp.where(jnp.isneginf(z), 0.0, dz).astype(h2.dtype)  # columns of an earlier chunk: done there
            dhc = dhc + jnp.einsum("cv,vh->ch", dz, wj, preferred_element_type=cdt)
            dwj = jnp.einsum("cv,ch->vh", dz, hc, preferred_element_type=cdt)
            dw = jax.lax.dynamic_update_slice_in_dim(
                dw, jax.lax.dynamic_slice_in_dim(dw, vstart, cv, axis=0) + dwj, vstart, axis=0)
            return (dhc, dw), None

        (dhc, dw), _ = jax.lax.scan(vocab_step, (jnp.zeros(hc.shape, cdt), dw), jnp.arange(nv))
        old = jax.lax.dynamic_slice_in_dim(dh, start, ct, axis=0)
        dh = jax.lax.dynamic_update_slice_in_dim(dh, jnp.where(fresh[:, None], dhc.astype(dh.dtype), old), start,
                                                 axis=0)
        return (dh, dw), None

    init = (jnp.zeros(h2.shape, h2.dtype), jnp.zeros(w.shape, cdt))
    (dh, dw), _ = jax.lax.scan(token_step, init, jnp.arange(nt))
    return dh, dw.astype(w.dtype), None


_lm_head_loss.defvjp(_fwd, _bwd)


def _chunk_loss_and_dh(hc, w, yc, valid, v: int, cv: int, nv: int, cdt, dtype, backend: str = "xla"):
    """``(loss [ct], dh / L_bar [ct, H])`` of one token chunk: the loss rows (0 where not counted, NaN where the label
    is out of range) and the unscaled input gradient ``c (exp(Z - m) / s - onehot(y)) W``. With one vocabulary chunk
    the logits are formed once; with several, a first pass takes the log-sum-exp and a second forms ``dZ``; with
    ``backend="mosaic"`` the logits' kernel writes ``exp(Z - m_tile)`` and the tiles' statistics instead of ``Z``.
    """
    in_range = (yc >= 0) & (yc < v)
    row = jnp.where(valid, jnp.where(in_range, 1.0, jnp.nan), 0.0).astype(cdt)

    def dz_of(z, m, s, vstart):
        onehot = (yc - vstart)[:, None] == jnp.arange(z.shape[1])[None, :]
        dz = (jnp.exp(z - m[:, None]) / s[:, None] - onehot) * row[:, None]
        return jnp.where(jnp.isneginf(z), 0.0, dz).astype(dtype)  # columns of an earlier chunk: done there

    if backend == "mosaic":
        # the Mosaic kernel's P and per-tile (m, s) (lm_head_loss_mgpu's doc): softmax = P e^{m_tile - m} / s
        p, m_tiles, s_tiles = lm_head_loss_mgpu.lm_head_softmax_tiles_mgpu(hc, w)
        m, s, factor = lm_head_loss_mgpu.row_statistics(m_tiles, s_tiles)
        ct, tiles = factor.shape
        probs = (p.reshape(ct, tiles, -1) * factor[:, :, None]).reshape(ct, -1)[:, :v]
        onehot = yc[:, None] == jnp.arange(v)[None, :]
        dz = ((probs - onehot) * row[:, None]).astype(dtype)
        picked = jnp.einsum("ch,ch->c", hc, jnp.take(w, jnp.clip(yc, 0, v - 1), axis=0), preferred_element_type=cdt)
        dhc = jnp.einsum("cv,vh->ch", dz, w, preferred_element_type=cdt)
    elif nv == 1:
        z = jnp.einsum("ch,vh->cv", hc, w, preferred_element_type=cdt)
        m = jnp.max(z, axis=-1)
        s = jnp.sum(jnp.exp(z - m[:, None]), axis=-1)
        picked = jnp.take_along_axis(z, jnp.clip(yc, 0, v - 1)[:, None], axis=-1)[:, 0]
        dhc = jnp.einsum("cv,vh->ch", dz_of(z, m, s, 0), w, preferred_element_type=cdt)
    else:
        m, s, picked = _chunk_lse_and_target(hc, w, yc, hc.shape[0], cv, nv, cdt)

        def vocab_step(dhc, j):
            z, vstart, wj = _vocab_logits(hc, w, j, cv, cdt)
            return dhc + jnp.einsum("cv,vh->ch", dz_of(z, m, s, vstart), wj, preferred_element_type=cdt), None

        dhc, _ = jax.lax.scan(vocab_step, jnp.zeros(hc.shape, cdt), jnp.arange(nv))
    loss = jnp.where(valid, jnp.where(in_range, m + jnp.log(s) - picked, jnp.nan), 0.0)
    return loss, dhc


def _forward_frozen_head(h2, w, targets, ignore_index: int, chunk_tokens: int, chunk_vocab: int, backend: str):
    """``(total, dh / L_bar)``: the summed loss and its gradient w.r.t. ``h2`` (``promote_types(dtype, float32)``),
    chunk by chunk; the head is a constant."""
    cdt = compute_dtype(h2.dtype)
    n, v = h2.shape[0], w.shape[0]
    ct, nt = _chunks(n, chunk_tokens)
    cv, nv = _chunks(v, chunk_vocab)

    def step(carry, i):
        total, dh = carry
        start, hc, yc, valid, fresh = _token_chunk(h2, targets, i, ct, ignore_index)
        loss, dhc = _chunk_loss_and_dh(hc, w, yc, valid, v, cv, nv, cdt, h2.dtype, backend)
        old = jax.lax.dynamic_slice_in_dim(dh, start, ct, axis=0)
        dh = jax.lax.dynamic_update_slice_in_dim(dh, jnp.where(fresh[:, None], dhc, old), start, axis=0)
        return (total + jnp.sum(loss), dh), None

    (total, dh), _ = jax.lax.scan(step, (jnp.zeros((), cdt), jnp.zeros(h2.shape, cdt)), jnp.arange(nt))
    return total, dh


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _lm_head_loss_frozen_head(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab, backend):
    return _forward_frozen_head(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab, backend)[0]


def _fwd_frozen_head(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab, backend):
    total, dh = _forward_frozen_head(h2, w, targets, ignore_index, chunk_tokens, chunk_vocab, backend)
    return total, (dh, jnp.zeros((0,), h2.dtype))  # the empty array carries h's dtype


def _bwd_frozen_head(ignore_index, chunk_tokens, chunk_vocab, backend, residuals, g):
    # d/dh (g L) = g (dZ/L_bar) W, formed in the forward; w enters as stop_gradient(w): its cotangent is zero
    dh, like_h = residuals
    return (g.astype(dh.dtype) * dh).astype(like_h.dtype), None, None


_lm_head_loss_frozen_head.defvjp(_fwd_frozen_head, _bwd_frozen_head)


def lm_head_loss(h, w, labels, *, ignore_index: int = -100, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 chunk_vocab: int | None = None, head_grad: bool = True, backend: str = "xla"):
    """``(sum of the token losses, number of counted labels)`` of the logits ``h W^T`` under HF's shift, computed
    ``chunk_tokens`` rows at a time with a hand-written VJP: equal to :func:`lm_head_loss_reference`, without its
    ``[B, T - 1, V]`` logits (see the module docstring for the equations and what is saved).

    Args:
      h: ``[B, T, H]`` hidden states (floating point; the final-normed activations of the model).
      w: ``[V, H]`` the LM head (or the tied embedding), of ``h``'s dtype. With ``head_grad`` its gradient is
        returned (full fine-tuning, a trained tied embedding).
      labels: ``[B, T]`` integers; ``labels[:, t + 1]`` is the target of position ``t``; ``ignore_index`` is not
        counted. Concrete labels outside ``[0, V)`` (other than ``ignore_index``) are a ``ValueError`` naming
        ``labels``; traced ones make the loss NaN (and the gradient: their row of ``dZ`` is NaN).
      ignore_index: the label that is not counted (HF's ``-100``).
      chunk_tokens: token rows (of the ``B * T``) per chunk, ``>= 1``; need not divide ``B * T``.
      chunk_vocab: vocabulary rows of ``w`` per inner chunk (online log-sum-exp), ``>= 1``; ``None``: all of them
        (one ``[chunk_tokens, V]`` logits block per step).
      head_grad: ``True``: differentiable in ``h`` and ``w`` (the backward recomputes each chunk's logits).
        ``False``: the function of ``stop_gradient(w)`` (a frozen head: LoRA): ``w``'s gradient is zero by
        definition, and ``dh`` is formed in the forward from its own logits (two ``[tokens, vocab, hidden]``
        products instead of three; saves ``[B * T, H]`` in fp32 instead of ``m`` and ``s``).
      backend: ``"xla"`` (any device and dtype) or ``"mosaic"``: the frozen head's logits by the Mosaic GPU kernel of
        :mod:`jaxgrad.ops.lm_head_loss_mgpu`, which writes ``exp(Z - m_tile)`` and each vocabulary tile's maximum
        and sum instead of ``Z`` (two fewer passes over each chunk's fp32 logits); it needs ``head_grad=False``,
        ``chunk_vocab=None``, bf16 or f16 inputs and a Hopper GPU.

    Returns:
      the summed loss (``promote_types(dtype, float32)``: fp32 for bf16 and f32, f64 for f64) and the int32 count
      of counted labels; divide by the window's item count for the model's loss.
    """
    where = "lm_head_loss"
    _check_inputs(h, w, labels, ignore_index, where)
    _check_chunk(chunk_tokens, "chunk_tokens", where)
    _check_chunk(chunk_vocab, "chunk_vocab", where, optional=True)
    if not isinstance(head_grad, (bool, np.bool_)):
        raise TypeError(f"{where}: 'head_grad' must be a bool, got {head_grad!r}")
    _check_backend(backend, h, w, head_grad, chunk_vocab, where)
    b, t, hidden = h.shape
    targets = shifted_targets(labels, ignore_index)
    count = jnp.sum(targets != ignore_index, dtype=jnp.int32)
    if b * t == 0:
        return jnp.zeros((), compute_dtype(h.dtype)), count
    chunk_vocab = w.shape[0] if chunk_vocab is None else int(chunk_vocab)
    args = (h.reshape(b * t, hidden), w, targets.reshape(b * t), int(ignore_index), int(chunk_tokens), chunk_vocab)
    if head_grad:
        total = _lm_head_loss(*args)
    else:
        total = _lm_head_loss_frozen_head(*args[:1], jax.lax.stop_gradient(w), *args[2:], backend)
    return total, count


# ---------------------------------------------------------------------------------------------------------------
# jaxgrad audit
# ---------------------------------------------------------------------------------------------------------------
def audit_labels(batch: int, seq: int, vocab: int) -> np.ndarray:
    """The audit's labels ``[batch, seq]``: fixed random classes, every fourth one ignored (``-100``) and the first
    row's last four (a whole chunk of the audit's 4-token chunks, at the first size) ignored."""
    rng = np.random.default_rng([7, batch, seq, vocab])
    labels = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    labels.reshape(-1)[::4] = -100
    labels[0, -4:] = -100
    return labels


def audit_make_args(key, size):
    """``(h [B, T, H], w [V, H])`` for ``size = (B, T, H, V)``: ``h ~ N(0, 1)`` (a normed hidden state),
    ``w ~ N(0, 1/H)`` (logits of unit scale)."""
    b, t, hidden, vocab = size
    kh, kw = jax.random.split(key)
    return jax.random.normal(kh, (b, t, hidden)), jax.random.normal(kw, (vocab, hidden)) * hidden ** -0.5


def audit_cases():
    """Cases for ``jaxgrad audit``: the summed loss as a function of ``(h, w)`` (labels fixed per size,
    :func:`audit_labels`), at sizes whose tokens and vocabulary no chunk divides; token chunks only, and token and
    vocabulary chunks (online log-sum-exp); and the frozen head (``head_grad=False``, ``dh`` formed in the forward)
    as a function of ``h`` alone, the head a fixed draw of each size; and the frozen head on the Mosaic kernel
    (bf16, GPU only) at sizes its tiles do not divide."""
    from jaxgrad.ops.registry import OpAudit

    def labels_of(h, w):
        return audit_labels(h.shape[0], h.shape[1], w.shape[0])

    def fused(chunk_vocab):
        def fn(h, w):
            return lm_head_loss(h, w, labels_of(h, w), chunk_tokens=4, chunk_vocab=chunk_vocab)[0]
        return fn

    def reference(h, w):
        return lm_head_loss_reference(h, w, labels_of(h, w))[0]

    sizes = ((2, 7, 12, 37), (2, 13, 20, 61), (3, 11, 24, 101))
    gpu_sizes = ((2, 77, 96, 1000), (2, 128, 256, 2051))  # the Mosaic kernel's tiles (256 rows, 128 columns) too
    vocab_of = {hidden: vocab for _, _, hidden, vocab in sizes + gpu_sizes}

    def frozen_head(hidden, dtype):
        """The frozen head of a size: a constant of ``h``, the same values whatever the dtype of the call
        (:func:`~jaxgrad.ops.registry.frozen_normal`), so that the verifier's float64 re-run is the same function
        (a ``jax.random`` draw in the default dtype is another draw under x64)."""
        from jaxgrad.ops.registry import frozen_normal

        return jnp.asarray(frozen_normal((vocab_of[hidden], hidden), 11, hidden ** -0.5), dtype)

    def frozen(h):
        w = frozen_head(h.shape[2], h.dtype)
        return lm_head_loss(h, w, labels_of(h, w), chunk_tokens=4, head_grad=False)[0]

    def frozen_reference(h):
        w = frozen_head(h.shape[2], h.dtype)
        return lm_head_loss_reference(h, w, labels_of(h, w))[0]

    def frozen_make_args(key, size):
        return audit_make_args(key, size)[:1]

    def frozen_mosaic(h):
        w = frozen_head(h.shape[2], h.dtype)
        return lm_head_loss(h, w, labels_of(h, w), chunk_tokens=64, head_grad=False, backend="mosaic")[0]

    def bf16_make_args(key, size):
        return (audit_make_args(key, size)[0].astype(jnp.bfloat16),)

    return (OpAudit("lm_head_loss[xla]", fused(None), reference, audit_make_args, sizes, arg_names=("h", "w")),
            OpAudit("lm_head_loss[xla] vocab chunks", fused(16), reference, audit_make_args, sizes,
                    arg_names=("h", "w")),
            OpAudit("lm_head_loss[xla] frozen head", frozen, frozen_reference, frozen_make_args, sizes,
                    arg_names=("h",)),
            OpAudit("lm_head_loss[mosaic] frozen head", frozen_mosaic, frozen_reference, bf16_make_args, gpu_sizes,
                    arg_names=("h",), backend="mosaic"))
