"""Padding masks on every attention path. Any HF ``[batch, seq]`` mask (1 = token, 0 = padding; it masks keys) --
right padding, left padding, gaps, whole rows of padding -- gives the plain reference's output and gradients on every
backend and attention implementation, and a query row that sees no key gives output 0 and zero gradients, never NaN.

* The plain reference (``jaxgrad.ops.attention.attention_reference``) is itself a per-row loop in numpy: query ``i``
  takes the softmax over the keys ``j <= i`` whose mask is 1, and 0 where there is none.
* The attention ops equal it, forward and VJP: ``attention`` (the XLA VJP), ``flash_attention`` (Pallas, interpret
  mode on the CPU) and the cuDNN code path (``jax.nn.dot_product_attention`` as ``attention="cudnn"`` calls it, with
  ``implementation="xla"`` on the CPU) in both of its mask forms: per-row key lengths (only for a concrete
  right-padded mask) and a boolean mask (any other mask, and every mask under ``jit``).
* The LoRA block, forward and every gradient (x, the adapters, the norm weights), equals ``jax.grad`` of the plain
  reference block on backend ``"xla"``, ``"pallas"`` (Pallas RMSNorm / SwiGLU and flash attention, interpret mode),
  ``"reference"`` and the cuDNN code path (custom VJP and reference), with the mask concrete and traced.
* A concrete mask is checked where it enters: 0/1 values (or bool) and ``[batch, seq]``. Under ``jit`` the values
  cannot be checked: there, any non-zero entry is a token.
* On a GPU (``gpu`` marker): the same with real cuDNN in bf16, ops and block.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.block import block, block_reference
from jaxgrad.lora.model import apply
from jaxgrad.ops.attention import attention, attention_reference, right_padded
from jaxgrad.ops.flash_attention import flash_attention
from tests.test_lora_block import CFG, LCFG, _split_norms, make_block

block_mod = importlib.import_module("jaxgrad.lora.block")  # the module (jaxgrad.lora.block is also the function)

B, T = 2, 7  # tests.test_lora_block's shapes: 3 query heads on 1 kv head, head_dim 8
MASKS = {
    "right": [[1] * 7, [1] * 4 + [0] * 3],
    "left": [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]],
    "gaps": [[1, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 1, 0, 1]],
    "right-and-padding-row": [[1, 1, 1, 1, 1, 0, 0], [0] * 7],
    "gaps-and-padding-row": [[0, 1, 0, 0, 1, 1, 0], [0] * 7],
}
RIGHT_PADDED = {"right", "right-and-padding-row"}


def mask_of(name, t=T):
    """MASKS[name] as int32 ``[B, t]``; for ``t > 7`` each row goes on as its last entry (right padding stays right
    padding)."""
    m = np.array(MASKS[name], np.int32)
    return jnp.asarray(np.concatenate([m] + [m[:, -1:]] * (t - T), axis=1))


def qkv(seed, dtype=jnp.float32, t=T, hq=3, hkv=1, d=8):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (B, t, h, d), jnp.float32).astype(dtype) for kk, h in zip(ks, (hq, hkv, hkv))]


def numpy_attention(q, k, v, mask):
    """The definition, one query row at a time in float64: softmax over the visible keys, 0 if there are none."""
    q, k, v, mask = (np.asarray(a, np.float64) for a in (q, k, v, mask))
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    o = np.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                keys = [j for j in range(i + 1) if mask[bi, j] != 0]
                if not keys:
                    continue
                s = np.array([q[bi, i, h] @ k[bi, j, h // g] for j in keys]) / np.sqrt(d)
                p = np.exp(s - s.max())
                o[bi, i, h] = (p / p.sum()) @ v[bi, keys, h // g]
    return o


def no_key_rows(mask):
    """[B, T]: query rows with no visible key (no token at or before them)."""
    return np.cumsum(np.asarray(mask) != 0, axis=1) == 0


def assert_close(got, want, tol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(float(np.max(np.abs(want))), 1e-30), err_msg=what)


# ------------------------------------------------------------------------------------------------ the ops
@pytest.mark.parametrize("name", list(MASKS))
def test_the_reference_is_the_per_row_softmax_over_visible_keys(name):
    q, k, v = qkv(1)
    mask = mask_of(name)
    o = attention_reference(q, k, v, mask)
    assert_close(o, numpy_attention(q, k, v, mask), 2e-6, name)
    assert bool(jnp.all(o[no_key_rows(mask)] == 0))


def _sdpa(key_lengths):
    def f(q, k, v, mask):
        return block_mod._cudnn_attention(q, k, v, mask, "sdpa:xla", key_lengths=key_lengths)
    return f


OPS = {
    "xla": attention,
    "pallas": functools.partial(flash_attention, interpret=True),
    "cudnn-path-mask": _sdpa(False),
    "cudnn-path-key-lengths": _sdpa(True),
}


@pytest.mark.parametrize("op,t", [(op, T) for op in OPS] + [("cudnn-path-mask", 8)],
                         ids=[f"{op}-seq{T}" for op in OPS] + ["cudnn-path-mask-seq8"])
def test_attention_ops_equal_the_reference_forward_and_vjp_for_every_mask(op, t):
    # seq 7 and 8: the cuDNN path's mask form pads an odd length by one masked position (cuDNN's bias needs an even
    # one), an even length goes as it is
    q, k, v = qkv(2, t=t)
    ct = jax.random.normal(jax.random.key(3), q.shape)
    fn = jax.jit(OPS[op])  # the mask is an argument (traced): one compile for every mask
    for name in MASKS:
        if op == "cudnn-path-key-lengths" and name not in RIGHT_PADDED:
            continue  # the key-lengths form is taken for right padding only
        mask = mask_of(name, t)
        o, pull = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        o_ref, pull_ref = jax.vjp(lambda q, k, v: attention_reference(q, k, v, mask), q, k, v)
        assert_close(o, o_ref, 2e-6, f"{op} {name} o")
        none = no_key_rows(mask)
        assert bool(jnp.all(o[none] == 0)), f"{op} {name}: a row with no visible key is not 0"
        grads = pull(ct)
        for n, g, w in zip("qkv", grads, pull_ref(ct)):
            assert_close(g, w, 2e-5, f"{op} {name} d{n}")
        assert bool(jnp.all(grads[0][none] == 0)), f"{op} {name}: dq of a row with no visible key is not 0"
        padding_row = np.all(np.asarray(mask) == 0, axis=1)
        assert all(bool(jnp.all(g[padding_row] == 0)) for g in grads), f"{op} {name}: padding row gradient"


def test_the_cudnn_path_without_a_mask_equals_the_reference_at_an_odd_length():
    q, k, v = qkv(8)  # seq 7: padded to 8 inside, the extra row dropped
    ct = jax.random.normal(jax.random.key(9), q.shape)
    (o, lse), pull = jax.vjp(lambda q, k, v: block_mod._cudnn_attention(q, k, v, None, "sdpa:xla", True), q, k, v)
    o_ref, pull_ref = jax.vjp(attention_reference, q, k, v)
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    assert_close(o, o_ref, 2e-6, "o")
    for n, g, w in zip("qkv", pull((ct, jnp.zeros_like(lse))), pull_ref(ct)):
        assert_close(g, w, 2e-5, f"d{n}")


def test_right_padded_is_true_only_for_a_concrete_right_padded_mask():
    for name in MASKS:
        assert right_padded(mask_of(name)) == (name in RIGHT_PADDED), name
        assert right_padded(np.array(MASKS[name], bool)) == (name in RIGHT_PADDED), name
    assert not right_padded(None)
    seen = []
    jax.jit(lambda m: seen.append(right_padded(m)) or m)(mask_of("right"))  # traced: unknown, so False
    assert seen == [False]


# ------------------------------------------------------------------------------------------------ the block
def _block_fn(path):
    """``f(params, lora, x, mask)``: the block on one backend / attention implementation."""
    if path == "xla":
        return lambda p, l, x, m: block(p, l, x, CFG, LCFG, attention_mask=m)
    if path == "pallas":
        return lambda p, l, x, m: block(p, l, x, CFG, LCFG, attention_mask=m, backend="pallas", attention="pallas",
                                        interpret=True)
    if path == "reference":
        return lambda p, l, x, m: block(p, l, x, CFG, LCFG, attention_mask=m, backend="reference")
    if path == "cudnn-path":
        return lambda p, l, x, m: block_mod._block_sdpa(p, l, x, CFG, LCFG, attention_mask=m)
    if path == "reference-cudnn-path":
        return lambda p, l, x, m: block_mod._block_reference(p, l, x, CFG, LCFG, attention_mask=m,
                                                             attention="sdpa:xla")
    raise AssertionError(path)


def _vjp(f, params, lora, x, ct):
    """(y, dx, dlora, dnorms) of ``f(params, lora, x)``, the frozen projections closed over."""
    frozen, norms = _split_norms(params)
    y, pull = jax.vjp(lambda x, l, n: f({**frozen, **n}, l, x), x, lora, norms)
    return (y, *pull(ct))


def _assert_block_equal(got, want, what):
    for n, g, w in zip(("y", "dx", "dlora", "dnorms"), got, want):
        for gl, wl in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            assert_close(gl, wl, 4e-6 if n == "y" else 2e-5, f"{what} {n}")


@pytest.fixture(scope="module")
def block_case():
    params, lora, x = make_block(21, jnp.float32)
    ct = jax.random.normal(jax.random.key(22), x.shape)
    plain = jax.jit(lambda p, l, x, m: block_reference(p, l, x, CFG, LCFG, attention_mask=m))
    want = {name: _vjp(lambda p, l, x: plain(p, l, x, mask_of(name)), params, lora, x, ct) for name in MASKS}
    return params, lora, x, ct, want


@pytest.mark.parametrize("path", ["xla", "pallas", "reference", "cudnn-path", "reference-cudnn-path"])
def test_block_equals_the_plain_reference_for_every_mask_traced(path, block_case):
    params, lora, x, ct, want = block_case
    f = jax.jit(_block_fn(path))  # the mask is a jit argument: its values are unknown when the block is traced
    for name in MASKS:
        got = _vjp(lambda p, l, x: f(p, l, x, mask_of(name)), params, lora, x, ct)
        _assert_block_equal(got, want[name], f"{path} {name} (traced mask)")


@pytest.mark.parametrize("path", ["cudnn-path", "reference-cudnn-path"])
def test_block_cudnn_path_equals_the_plain_reference_for_every_concrete_mask(path, block_case):
    # a concrete mask picks the cuDNN path's form: key lengths when right-padded, a boolean mask otherwise
    params, lora, x, ct, want = block_case
    for name in MASKS:
        mask = mask_of(name)
        f = jax.jit(lambda p, l, x, f=_block_fn(path), mask=mask: f(p, l, x, mask))  # the mask is a constant
        got = _vjp(f, params, lora, x, ct)
        _assert_block_equal(got, want[name], f"{path} {name} (concrete mask)")


def test_the_cudnn_path_takes_key_lengths_for_a_concrete_right_padded_mask_only(monkeypatch):
    # and every call has an even length: seq 7 goes in as 8 (JAX 0.11's cuDNN training rule refuses odd lengths)
    calls = []
    sdpa = jax.nn.dot_product_attention

    def recording(q, *args, mask=None, key_value_seq_lengths=None, **kw):
        assert q.shape[1] == 8, q.shape
        calls.append(("mask" if mask is not None else "") + ("key lengths" if key_value_seq_lengths is not None
                                                             else ""))
        return sdpa(q, *args, mask=mask, key_value_seq_lengths=key_value_seq_lengths, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    params, lora, x = make_block(27, jnp.float32)

    def forms(f, *args):
        calls.clear()
        jax.eval_shape(lambda *a: jax.vjp(f, *a)[1](jax.vjp(f, *a)[0]), *args)  # forward and backward traced
        return set(calls)

    for name in MASKS:
        f = lambda l, x, m=mask_of(name): block_mod._block_sdpa(params, l, x, CFG, LCFG, attention_mask=m)  # noqa
        assert forms(f, lora, x) == ({"key lengths"} if name in RIGHT_PADDED else {"mask"}), name
    traced = lambda l, x, m: block_mod._block_sdpa(params, l, x, CFG, LCFG, attention_mask=m)  # noqa: E731
    assert forms(traced, lora, x, mask_of("right")) == {"mask"}  # under jit a right-padded mask is not known as one
    assert forms(lambda l, x: block_mod._block_sdpa(params, l, x, CFG, LCFG), lora, x) == {""}  # no mask: neither


def test_block_eager_with_left_padding_equals_the_plain_reference(block_case):
    # no jit at all: block() sees the concrete mask and the custom VJP runs op by op
    params, lora, x, ct, want = block_case
    for path in ("xla", "cudnn-path"):
        got = _vjp(lambda p, l, x: _block_fn(path)(p, l, x, mask_of("left")), params, lora, x, ct)
        _assert_block_equal(got, want["left"], f"{path} left (eager)")


# ------------------------------------------------------------------------------------------------ checks
def test_a_concrete_mask_must_be_zeros_and_ones_of_shape_batch_seq():
    params, lora, x = make_block(23, jnp.float32)
    q, k, v = qkv(4)
    bad = np.array(MASKS["gaps"])
    bad[1, 3] = 2
    ids = jnp.zeros((B, T), jnp.int32)
    from tests.test_lora_model import CFG as MCFG, LCFG as MLCFG, _model
    mparams, mlora = _model(24, jnp.float32)
    calls = {
        "block": lambda m: block(params, lora, x, CFG, LCFG, attention_mask=m),
        "block(cudnn path)": lambda m: block_mod._block_sdpa(params, lora, x, CFG, LCFG, attention_mask=m),
        "block_reference": lambda m: block_reference(params, lora, x, CFG, LCFG, attention_mask=m),
        "apply": lambda m: apply(mparams, mlora, ids, MCFG, MLCFG, attention_mask=m),
        "attention": lambda m: attention(q, k, v, m),
        "attention_reference": lambda m: attention_reference(q, k, v, m),
        "flash_attention": lambda m: flash_attention(q, k, v, m, interpret=True),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=r"'attention_mask' must hold 0 \(padding\) and 1 \(token\) only, got 2 "
                                             r"at \[1, 3\]"):
            call(jnp.asarray(bad))
        with pytest.raises(ValueError, match=r"'attention_mask' must hold 0 \(padding\) and 1 \(token\) only, got "
                                             r"nan at \[0, 0\]"):
            call(jnp.full((B, T), jnp.nan))
        with pytest.raises(ValueError, match=r"'attention_mask' must be \[batch, seq\] = \(2, 7\), got \(2, 1, 7\)"):
            call(jnp.ones((B, 1, T), jnp.int32))
    # bool and float 0/1 masks are masks like int ones
    o = attention(q, k, v, mask_of("gaps"))
    np.testing.assert_array_equal(attention(q, k, v, mask_of("gaps") != 0), o)
    np.testing.assert_array_equal(attention(q, k, v, mask_of("gaps").astype(jnp.float32)), o)


def test_under_jit_the_mask_values_cannot_be_checked_and_non_zero_is_a_token():
    q, k, v = qkv(5)
    twos = mask_of("gaps") * 2
    np.testing.assert_array_equal(jax.jit(attention)(q, k, v, twos), jax.jit(attention)(q, k, v, mask_of("gaps")))


# ------------------------------------------------------------------------------------------------ GPU: real cuDNN
@pytest.mark.gpu
@pytest.mark.parametrize("t", [7, 8], ids=["odd-seq7", "even-seq8"])
def test_gpu_cudnn_attention_equals_the_reference_for_every_mask_bf16(t):
    q, k, v = qkv(6, jnp.bfloat16, t=t)
    ct = jax.random.normal(jax.random.key(7), q.shape).astype(jnp.bfloat16)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731 - the reference from the same bf16 values, in fp32
    for name in MASKS:
        mask = mask_of(name, t)
        forms = [False, True] if name in RIGHT_PADDED else [False]
        for key_lengths in forms:
            f = jax.jit(lambda q, k, v, m, kl=key_lengths: block_mod._cudnn_attention(q, k, v, m, "cudnn",
                                                                                    key_lengths=kl))
            o, pull = jax.vjp(lambda q, k, v: f(q, k, v, mask), q, k, v)
            o_ref, pull_ref = jax.vjp(lambda q, k, v: attention_reference(up(q), up(k), up(v), mask), q, k, v)
            what = f"cudnn {name} seq {t} key_lengths={key_lengths}"
            assert_close(o, o_ref, 2e-2, what + " o")
            assert bool(jnp.all(o[no_key_rows(mask)] == 0)), what
            for n, g, w in zip("qkv", pull(ct), pull_ref(up(ct))):
                assert_close(g, w, 3e-2, f"{what} d{n}")


@pytest.mark.gpu
def test_gpu_block_with_cudnn_equals_the_block_with_xla_attention_for_every_mask_bf16():
    params, lora, x = make_block(25, jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(26), x.shape).astype(jnp.bfloat16)
    xla = jax.jit(lambda p, l, x, m: block(p, l, x, CFG, LCFG, attention_mask=m))
    cudnn = jax.jit(lambda p, l, x, m: block(p, l, x, CFG, LCFG, attention_mask=m, attention="cudnn"))
    for name in MASKS:
        mask = mask_of(name)
        want = _vjp(lambda p, l, x: xla(p, l, x, mask), params, lora, x, ct)
        traced = _vjp(lambda p, l, x: cudnn(p, l, x, mask), params, lora, x, ct)
        concrete = _vjp(jax.jit(lambda p, l, x: block(p, l, x, CFG, LCFG, attention_mask=mask, attention="cudnn")),
                        params, lora, x, ct)
        for what, got in (("traced", traced), ("concrete", concrete)):
            for n, g, w in zip(("y", "dx", "dlora", "dnorms"), got, want):
                for gl, wl in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
                    assert_close(gl, wl, 5e-2, f"cudnn block {name} {what} {n}")


@pytest.mark.parametrize("gap", [60.0, 200.0])
def test_a_masked_key_scoring_far_above_the_visible_ones_changes_nothing(gap):
    # Key 0 belongs to another packed segment and scores `gap` above every visible key. A softmax shifted by the
    # max over all keys underflows the visible terms: at gap 200 the rows' outputs come out 0, at gap 60 the
    # denominator ~e^-60 squares to 0 in float32 and its gradient is NaN. Shifted by the visible max, the rows
    # average their own segment's values, and the gradients are those of the custom VJP.
    rng = np.random.default_rng(0)
    q = np.zeros((1, 3, 2, 4), np.float32)
    k = np.zeros((1, 3, 1, 4), np.float32)
    v = rng.normal(size=(1, 3, 1, 4)).astype(np.float32)
    q[0, :, :, 0] = np.sqrt(gap * 2.0)  # scale 4^-1/2: s[i, 0] = gap, s[i, j > 0] = 0
    k[0, 0, 0, 0] = np.sqrt(gap * 2.0)
    seg = np.array([[1, 2, 2]])
    want = np.stack([v[0, 0, 0], v[0, 1, 0], (v[0, 1, 0] + v[0, 2, 0]) / 2])
    grads = {}
    flash = functools.partial(flash_attention, interpret=True)
    for f in (attention_reference, attention, flash):
        out = np.asarray(f(q, k, v, segment_ids=seg))
        np.testing.assert_allclose(out[0, :, 0], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out[0, :, 1], want, rtol=1e-6, atol=1e-6)
        grads[f] = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, segment_ids=seg))), argnums=(0, 1, 2))(q, k, v)
    for f in (attention_reference, flash):
        for g, g_vjp in zip(grads[f], grads[attention], strict=True):
            assert np.isfinite(np.asarray(g)).all()
            np.testing.assert_allclose(np.asarray(g), np.asarray(g_vjp), rtol=1e-5, atol=1e-6)
