"""Padding-free packing: segment ids on every attention implementation and block backend.

``segment_ids [batch, seq]`` (integers): query ``i`` sees key ``j`` iff ``j <= i``, ``valid_j`` (the HF
``attention_mask``, if given) and ``segment_ids[b, i] == segment_ids[b, j]``. The specification, in float64:

* ops: attention with segment ids -- the plain reference, the hand-written VJP, the Pallas flash kernels (interpret
  mode) and the cuDNN code path (``jax.nn.dot_product_attention``'s ``"xla"`` implementation on the CPU) -- equals
  running each segment alone, output and ``dq, dk, dv``; the VJP's gradients equal ``jax.grad`` of the reference.
  A row whose segment has no token at or before it gives output 0 and zero gradients.
* model: a packed row (segments of 5, 9 and 3 tokens and 2 of padding in a row of 19; another row of 7 and 12),
  positions restarting at 0 per segment, labels ``-100`` at each segment's first token, gives each segment's logits
  and the LoRA gradients of the summed loss equal to running each segment alone, on backend ``reference``, ``xla``
  and ``pallas`` (interpret) with attention ``xla``, ``pallas`` and the cuDNN code path where the combination exists.
* bad segment ids (wrong shape, float or bool dtype) are refused by name everywhere they enter.

Sizes: GQA 4 query heads on 2 kv heads, head_dim 8, hidden 24, 2 layers, LoRA r 4 on all 7 projections with random
non-zero A and B. Tolerance: 1e-10 of each array's largest entry (float64 rounding over these sizes is ~1e-15).
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import IGNORE_INDEX, _apply, apply, causal_lm_loss, count_items, init, init_lora, loss_fn
from jaxgrad.ops.attention import attention, attention_reference
from jaxgrad.ops.flash_attention import flash_attention

block_mod = importlib.import_module("jaxgrad.lora.block")

TOL = 1e-10  # of each array's largest entry; float64 rounding is ~1e-15 here
# the cuDNN code path on the CPU is jax.nn.dot_product_attention's XLA implementation, whose softmax is float32 for
# any input dtype: its probabilities carry float32 rounding, u = 2^-24, however the segments are run
SDPA_TOL = 64 * 2.0 ** -24
T = 19
# row 0: segments 1, 2, 3 of 5, 9, 3 tokens, then 2 of padding (segment 0, masked); row 1: 7 and 12 tokens
SEGMENTS = np.array([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 2,
                     [5] * 7 + [6] * 12])
MASK = (SEGMENTS != 0).astype(np.int32)
CFG = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rms_norm_eps=1e-5, max_position_embeddings=32, vocab_size=13, num_hidden_layers=2)
LCFG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # B random, non-zero


def segments_of(seg, mask=None):
    """``[(row, positions)]`` of every segment that holds a token (padding-only segments are not sequences)."""
    out = []
    for b in range(seg.shape[0]):
        for s in dict.fromkeys(seg[b].tolist()):
            idx = np.nonzero(seg[b] == s)[0]
            if mask is None or mask[b, idx].any():
                out.append((b, idx))
    return out


def positions_of(seg):
    """RoPE positions restarting at 0 in every segment: ``[batch, seq]``."""
    pos = np.zeros(seg.shape, np.int32)
    for b, idx in segments_of(seg):
        pos[b, idx] = np.arange(len(idx))
    return pos


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-300))


# ------------------------------------------------------------------------------------------------ the ops
def qkv(seed, b=2, t=T, hq=4, hkv=2, d=8):
    """Fresh N(0, 1) float64 q, k, v and an output cotangent."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float64) for kk, h in zip(ks, (hq, hkv, hkv)))
    return q, k, v, jax.random.normal(ks[3], q.shape, jnp.float64)


def cudnn_path(q, k, v, mask=None, segment_ids=None):
    return block_mod._cudnn_attention(q, k, v, mask, "sdpa:xla", segment_ids=segment_ids)


OPS = {
    "reference": lambda q, k, v, m, s: attention_reference(q, k, v, m, segment_ids=s),
    "xla-vjp": lambda q, k, v, m, s: attention(q, k, v, m, segment_ids=s),
    "pallas": lambda q, k, v, m, s: flash_attention(q, k, v, m, segment_ids=s, interpret=True, block_q=16,
                                                    block_k=16),
    "cudnn-path": lambda q, k, v, m, s: cudnn_path(q, k, v, m, s),
}
# row 1's second segment starts with a padding token: that row sees no key (output 0, zero gradients)
OP_MASK = MASK.copy()
OP_MASK[1, 7] = 0


@jax.jit
def _reference_vjp(q, k, v, ct, mask):
    o, pull = jax.vjp(lambda q, k, v: attention_reference(q, k, v, mask), q, k, v)
    return (o, *pull(ct))


def alone(q, k, v, ct, mask):
    """Output and ``dq, dk, dv`` with every segment run as its own sequence (the plain reference)."""
    o, dq, dk, dv = (np.zeros(a.shape) for a in (q, q, k, v))
    for b, idx in segments_of(SEGMENTS):
        cut = [a[b:b + 1, idx] for a in (q, k, v, ct)]
        for out, val in zip((o, dq, dk, dv), _reference_vjp(*cut, jnp.asarray(mask[b:b + 1, idx]))):
            out[b, idx] = val[0]
    return o, dq, dk, dv


@pytest.fixture(scope="module")
def op_case():
    with jax.enable_x64(True):
        q, k, v, ct = qkv(1)
        return (q, k, v, ct), alone(q, k, v, ct, OP_MASK)


@pytest.mark.parametrize("op", list(OPS))
def test_attention_with_segment_ids_equals_each_segment_alone(op, op_case):
    (q, k, v, ct), want = op_case
    with jax.enable_x64(True):
        fn = jax.jit(OPS[op])  # mask and segment ids traced
        o, pull = jax.vjp(lambda q, k, v: fn(q, k, v, jnp.asarray(OP_MASK), jnp.asarray(SEGMENTS)), q, k, v)
        got = (o, *pull(ct))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.float64
        assert rel_err(g, w) < (SDPA_TOL if op == "cudnn-path" else TOL), (op, name, rel_err(g, w))
    # the row with no visible key: output and dq exactly 0
    assert not np.any(np.asarray(got[0])[1, 7]) and not np.any(np.asarray(got[1])[1, 7])


def test_the_vjp_with_segment_ids_equals_jax_grad_of_the_reference(op_case):
    (q, k, v, ct), _ = op_case
    with jax.enable_x64(True):
        seg, mask = jnp.asarray(SEGMENTS), jnp.asarray(OP_MASK)
        want = jax.vjp(lambda q, k, v: attention_reference(q, k, v, mask, segment_ids=seg), q, k, v)[1](ct)
        for op in ("xla-vjp", "pallas"):
            got = jax.vjp(lambda q, k, v, op=op: OPS[op](q, k, v, mask, seg), q, k, v)[1](ct)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert rel_err(g, w) < 1e-13, (op, name, rel_err(g, w))


def test_segment_ids_change_the_result_and_need_not_be_sorted(op_case):
    # the test can fail: without the segment term the packed row is one long sequence; and only equality counts
    (q, k, v, _), (want, *_) = op_case
    with jax.enable_x64(True):
        unsegmented = attention(q, k, v, jnp.asarray(OP_MASK))
        assert rel_err(unsegmented, want) > 1e-2
        relabelled = np.where(SEGMENTS == 2, -7, np.where(SEGMENTS == 5, 2**31 - 1, SEGMENTS))
        for op in ("xla-vjp", "pallas"):
            got = OPS[op](q, k, v, jnp.asarray(OP_MASK), jnp.asarray(relabelled))
            assert rel_err(got, want) < TOL, op


# ------------------------------------------------------------------------------------------------ the model
def model_inputs(seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), init(k1, CFG, std=0.3))
    lora = jax.tree.map(lambda a: a.astype(jnp.float64), init_lora(k2, CFG, LCFG))
    ids = np.asarray(jax.random.randint(k3, SEGMENTS.shape, 0, CFG.vocab_size))
    labels = np.where(MASK != 0, ids, IGNORE_INDEX)
    for b, idx in segments_of(SEGMENTS):
        labels[b, idx[0]] = IGNORE_INDEX  # predicted from the previous segment's last token: no loss across
    return params, lora, ids, labels


# (backend, attention): every combination that runs on the CPU ("sdpa:xla" is the cuDNN code path; mosaic is
# GPU-only, and off a GPU it is the xla backend bit for bit)
COMBOS = [("reference", "xla"), ("reference", "pallas"), ("reference", "sdpa:xla"),
          ("xla", "xla"), ("xla", "pallas"), ("xla", "sdpa:xla"),
          ("pallas", "xla"), ("pallas", "pallas")]


def packed_loss(lora, params, ids, labels, n, backend, attention, segment_ids, positions, mask):
    logits = _apply(params, lora, ids, CFG, LCFG, attention_mask=mask, positions=positions,
                    segment_ids=segment_ids, backend=backend, attention=attention)
    return causal_lm_loss(logits, labels, n), logits


@pytest.fixture(scope="module")
def model_case():
    """The packed batch and what running each segment alone gives: its logits in the packed layout, the summed loss
    (each segment's sum of token losses over the packed batch's ``n_items``) and its LoRA gradient."""
    with jax.enable_x64(True):
        params, lora, ids, labels = model_inputs(2)
        n = count_items(labels)
        logits = np.zeros(SEGMENTS.shape + (CFG.vocab_size,))
        loss, grads = 0.0, None
        def f(lora, ids, labels):
            out = apply(params, lora, ids, CFG, LCFG, backend="reference")  # positions 0, 1, ...
            return causal_lm_loss(out, labels, n), out
        vg = jax.jit(jax.value_and_grad(f, has_aux=True))
        for b, idx in segments_of(SEGMENTS, MASK):
            (lb, out), gb = vg(lora, ids[b:b + 1, idx], labels[b:b + 1, idx])
            logits[b, idx] = out[0]
            loss += float(lb)
            grads = gb if grads is None else jax.tree.map(jnp.add, grads, gb)
        return (params, lora, ids, labels, n), (logits, loss, grads)


@pytest.mark.parametrize("backend,attention", COMBOS, ids=[f"{b}-{a}" for b, a in COMBOS])
def test_a_packed_row_equals_each_segment_alone_logits_and_lora_gradients(backend, attention, model_case):
    (params, lora, ids, labels, n), (want_logits, want_loss, want_grads) = model_case
    with jax.enable_x64(True):
        vg = jax.jit(jax.value_and_grad(packed_loss, has_aux=True), static_argnums=(5, 6))
        (loss, logits), grads = vg(lora, params, jnp.asarray(ids), jnp.asarray(labels), n, backend, attention,
                                   jnp.asarray(SEGMENTS), jnp.asarray(positions_of(SEGMENTS)), jnp.asarray(MASK))
    tol = SDPA_TOL if attention.startswith("sdpa:") else TOL
    real = MASK != 0  # padding positions are no segment's tokens
    assert rel_err(np.asarray(logits)[real], want_logits[real]) < tol
    assert abs(float(loss) - want_loss) < tol * abs(want_loss)
    errs = jax.tree.map(rel_err, grads, want_grads)
    assert len(jax.tree.leaves(errs)) == 2 * 7 * 2 and max(jax.tree.leaves(errs)) < tol, errs


def test_loss_fn_takes_segment_ids_without_them_the_row_differs_and_positions_are_per_row(model_case):
    # the comparison above can fail: without the segment term the row is one sequence. RoPE's scores depend on
    # i - j only, so inside a segment any positions p_i = i + c_b give the same function (restarting at 0 is what a
    # segment alone has, and keeps positions small); positions that are not a shift within a segment change it:
    # the [batch, seq] positions reach every row's RoPE
    (params, lora, ids, labels, n), (want_logits, want_loss, _) = model_case
    real = MASK != 0
    with jax.enable_x64(True):
        packed = loss_fn(lora, params, ids, labels, n, CFG, LCFG, attention_mask=MASK, positions=positions_of(SEGMENTS),
                         segment_ids=SEGMENTS)  # the training objective passes segment ids on to apply
        assert abs(float(packed) - want_loss) < TOL * abs(want_loss)
        plain = apply(params, lora, ids, CFG, LCFG, attention_mask=MASK, positions=positions_of(SEGMENTS))
        assert rel_err(np.asarray(plain)[real], want_logits[real]) > 1e-3
        shifted = apply(params, lora, ids, CFG, LCFG, attention_mask=MASK, segment_ids=SEGMENTS)  # positions 0..18
        assert rel_err(np.asarray(shifted)[real], want_logits[real]) < TOL
        gap = positions_of(SEGMENTS)
        gap[1, 10:] += 3  # a gap inside row 1's second segment
        gapped = np.asarray(apply(params, lora, ids, CFG, LCFG, attention_mask=MASK, positions=gap,
                                  segment_ids=SEGMENTS))
        assert rel_err(gapped[0][real[0]], want_logits[0][real[0]]) < TOL  # row 0 untouched
        assert rel_err(gapped[1, 10:], want_logits[1, 10:]) > 1e-3


def test_block_with_segment_ids_concrete_equals_the_reference_on_every_backend():
    # block() called eagerly (concrete segment ids, the cuDNN path's mask form chosen on the host)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: a.astype(jnp.float64), init(jax.random.key(3), CFG, std=0.3))["layers"][0]
        lora = jax.tree.map(lambda a: a.astype(jnp.float64), init_lora(jax.random.key(4), CFG, LCFG))["layers"][0]
        x = jax.random.normal(jax.random.key(5), (2, T, CFG.hidden_size), jnp.float64)
        kw = dict(positions=positions_of(SEGMENTS), attention_mask=MASK, segment_ids=SEGMENTS)
        want = block_reference(params, lora, x, CFG, LCFG, **kw)
        sdpa = block_mod._block_sdpa(params, lora, x, CFG, LCFG, **kw)
        for got in (block(params, lora, x, CFG, LCFG, **kw),
                    block(params, lora, x, CFG, LCFG, backend="pallas", attention="pallas", interpret=True, **kw),
                    sdpa):
            assert rel_err(got, want) < (SDPA_TOL if got is sdpa else TOL), rel_err(got, want)


def test_the_cudnn_path_takes_the_boolean_mask_with_segment_ids_never_key_lengths(monkeypatch):
    # a concrete right-padded mask alone goes to cuDNN as key lengths; with segment ids the block-diagonal mask
    # [B, 1, T, T] (seg_i == seg_j and valid_j) is the only form that describes it
    calls = []
    sdpa = jax.nn.dot_product_attention

    def recording(q, *args, mask=None, key_value_seq_lengths=None, **kw):
        calls.append("key lengths" if key_value_seq_lengths is not None else
                     f"mask {tuple(mask.shape)}" if mask is not None else "")
        return sdpa(q, *args, mask=mask, key_value_seq_lengths=key_value_seq_lengths, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    params = init(jax.random.key(8), CFG, std=0.3)["layers"][0]
    lora = init_lora(jax.random.key(9), CFG, LCFG)["layers"][0]
    x = jax.random.normal(jax.random.key(10), (2, T, CFG.hidden_size))
    right = np.ones((2, T), np.int32)
    right[0, 17:] = 0
    for seg, form in ((None, "key lengths"), (SEGMENTS, f"mask {(2, 1, T + 1, T + 1)}")):  # odd T: padded by one
        calls.clear()
        f = lambda l, x, seg=seg: block_mod._block_sdpa(params, l, x, CFG, LCFG, attention_mask=right,  # noqa: E731
                                                         segment_ids=seg)
        jax.eval_shape(lambda l, x: jax.vjp(f, l, x)[1](jax.vjp(f, l, x)[0]), lora, x)  # forward and backward
        assert set(calls) == {form}, (seg, calls)


# ------------------------------------------------------------------------------------------------ checks
def test_bad_segment_ids_are_refused_by_name(model_case):
    (params, lora, ids, _, _), _ = model_case  # refused before anything is computed
    bparams, blora = params["layers"][0], lora["layers"][0]
    x = jnp.zeros((2, T, CFG.hidden_size))
    q, k, v = jnp.zeros((2, T, 4, 8)), jnp.zeros((2, T, 2, 8)), jnp.zeros((2, T, 2, 8))
    calls = {
        "attention": lambda s: attention(q, k, v, segment_ids=s),
        "attention_reference": lambda s: attention_reference(q, k, v, segment_ids=s),
        "flash_attention": lambda s: flash_attention(q, k, v, segment_ids=s, interpret=True),
        "block": lambda s: block(bparams, blora, x, CFG, LCFG, segment_ids=s),
        "block_reference": lambda s: block_reference(bparams, blora, x, CFG, LCFG, segment_ids=s),
        "block(cudnn path)": lambda s: block_mod._block_sdpa(bparams, blora, x, CFG, LCFG, segment_ids=s),
        "apply": lambda s: apply(params, lora, ids, CFG, LCFG, segment_ids=s),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=r"'segment_ids' must be \[batch, seq\] = \(2, 19\) .*got \(19,\)"):
            call(jnp.asarray(SEGMENTS[0]))
        with pytest.raises(ValueError, match=r"'segment_ids' must be \[batch, seq\] = \(2, 19\) .*got \(2, 1, 19\)"):
            call(jnp.asarray(SEGMENTS[:, None]))
        with pytest.raises(TypeError, match=r"'segment_ids' must be an integer array .*got dtype float32"):
            call(jnp.asarray(SEGMENTS, jnp.float32))
        with pytest.raises(TypeError, match=r"'segment_ids' must be an integer array .*got dtype bool"):
            call(jnp.asarray(SEGMENTS) != 0)
    # shape and dtype are known under jit too
    with pytest.raises(TypeError, match="'segment_ids' must be an integer array"):
        jax.jit(functools.partial(attention, q, k, v))(segment_ids=jnp.asarray(SEGMENTS, jnp.float32))
