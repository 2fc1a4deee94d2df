"""Checks the planted-bug catalogue itself (not the verifier).

* every correct case: forward and VJP of ``fn`` equal those of ``reference`` (float64 to 1e-10; the bf16-inside
  case in float32 to 2e-2, the f32-only case in float64 to 1e-5, the 10^6-row case once in float32);
* every buggy case: forwards agree, some leaf in ``bad_leaves`` differs from the reference gradient by more than
  1e-5 (relative, norm-wise), and every other leaf agrees to 1e-10;
* ``make_args`` is dtype-generic and never returns an all-zero argument.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import planted

CORRECT = planted.correct_cases()
BUGGY = planted.buggy_cases()
EXPECTS = {None, "flip", "transpose", "scale", "zero", "shift"}


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@functools.cache
def _args(make_args, dtype_name, x64):
    """Arguments and a cotangent seed, shared by the cases that share ``make_args`` (fewer CPU compiles)."""
    with jax.enable_x64(x64):
        return make_args(jax.random.key(0), jnp.dtype(dtype_name))


def _vjps(case, dtype):
    """(args, forward fn, forward ref, grads fn, grads ref) at a random cotangent.

    Eager on purpose: the primitives' executables are cached across the cases of one op, which a per-case jit
    would recompile."""
    args = _args(case.make_args, jnp.dtype(dtype).name, jnp.dtype(dtype) == jnp.float64)
    y_f, vjp_f = jax.vjp(case.fn, *args)
    y_r, vjp_r = jax.vjp(case.reference, *args)
    g = jax.random.normal(jax.random.key(1), y_r.shape, dtype=y_r.dtype)
    return args, y_f, y_r, vjp_f(g.astype(y_f.dtype)), vjp_r(g)


def test_catalogue_shape():
    cases = planted.all_cases()
    assert len(cases) == len(CORRECT) + len(BUGGY)
    assert all(not c.buggy and c.bad_leaves == () for c in CORRECT)
    assert all(c.buggy and c.bad_leaves for c in BUGGY)
    assert all(c.expect in EXPECTS for c in cases)
    assert {c.op for c in BUGGY} <= {c.op for c in CORRECT}
    assert {"flip", "transpose", "scale", "zero", "shift", None} <= {c.expect for c in BUGGY}


# one case per distinct make_args (the buggy cases share their op's)
_MAKERS = list({c.make_args: c for c in planted.all_cases() if "large" not in c.tags}.values())


@pytest.mark.parametrize("case", _MAKERS, ids=lambda c: c.op)
def test_make_args_dtype_generic(case):
    for dtype in (jnp.float32, jnp.bfloat16):
        args = case.make_args(jax.random.key(1), dtype)
        assert len(args) == len(case.arg_names)
        assert all(a.dtype == dtype for a in jax.tree.leaves(args))
    with jax.enable_x64(True):
        args = _args(case.make_args, "float64", True)
        leaves = jax.tree.leaves(args)
        assert all(a.dtype == jnp.float64 for a in leaves)
        assert all(bool(jnp.all(a != 0)) for a in leaves), "arguments must be non-zero white noise"


@pytest.mark.parametrize("case", [c for c in CORRECT if not c.tags], ids=lambda c: c.name)
def test_correct_matches_reference_f64(case):
    with jax.enable_x64(True):
        args, y_f, y_r, gf, gr = _vjps(case, jnp.float64)
        assert y_f.dtype == jnp.float64
        assert _rel(y_f, y_r) < 1e-12
        for name, a, b in zip(case.arg_names, gf, gr):
            assert a.dtype == jnp.float64 and a.shape == b.shape
            assert _rel(a, b) < 1e-10, name


def test_bf16_inside_f32():
    (case,) = [c for c in CORRECT if "bf16-inside" in c.tags]
    args, y_f, y_r, gf, gr = _vjps(case, jnp.float32)
    assert y_f.dtype == jnp.float32
    assert _rel(y_f, y_r) < 2e-2
    for name, a, b in zip(case.arg_names, gf, gr):
        assert _rel(a, b) < 2e-2, name
    with jax.enable_x64(True):  # still runs (and still rounds to bf16) in f64
        args, y_f, y_r, gf, gr = _vjps(case, jnp.float64)
        assert y_f.dtype == jnp.float64
        assert 1e-6 < _rel(y_f, y_r) < 2e-2


def test_f32_only_f64():
    (case,) = [c for c in CORRECT if "f32-only" in c.tags]
    with jax.enable_x64(True):
        args, y_f, y_r, gf, gr = _vjps(case, jnp.float64)
        assert y_f.dtype == jnp.float64
        assert _rel(y_f, y_r) < 1e-5
        for name, a, b in zip(case.arg_names, gf, gr):
            assert a.dtype == jnp.float64
            assert _rel(a, b) < 1e-5, name
        assert _rel(y_f, y_r) > 1e-12  # it really computed in f32


def test_long_sum_f32():
    (case,) = [c for c in CORRECT if "large" in c.tags]
    args, y_f, y_r, gf, gr = _vjps(case, jnp.float32)
    assert args[0].shape[0] == 1_000_000
    assert _rel(y_f, y_r) < 1e-6
    for name, a, b in zip(case.arg_names, gf, gr):
        assert _rel(a, b) < 1e-4, name


@pytest.mark.parametrize("case", BUGGY, ids=lambda c: c.name)
def test_buggy_differs_on_bad_leaves_only(case):
    with jax.enable_x64(True):
        args, y_f, y_r, gf, gr = _vjps(case, jnp.float64)
        assert _rel(y_f, y_r) < 1e-12
        errs = {name: _rel(a, b) for name, a, b in zip(case.arg_names, gf, gr)}
        assert all(a.shape == b.shape and a.dtype == jnp.float64 for a, b in zip(gf, gr))
        assert max(errs[n] for n in case.bad_leaves) > 1e-5, errs
        for n in set(case.arg_names) - set(case.bad_leaves):
            assert errs[n] < 1e-10, (n, errs)
        # the planted structure holds exactly, for the diagnoses that name one
        bad = dict(zip(case.arg_names, gf))[case.bad_leaves[0]]
        true = dict(zip(case.arg_names, gr))[case.bad_leaves[0]]
        if case.expect == "zero":
            assert not np.any(np.asarray(bad))
        elif case.expect == "flip":
            assert _rel(bad, jnp.flip(true, (0, 1))) < 1e-10
        elif case.expect == "transpose":
            assert _rel(bad, true.transpose(tuple(reversed(range(true.ndim)))).reshape(true.shape)) < 1e-10
        elif case.expect == "shift":
            assert _rel(bad, jnp.roll(true, 1, axis=1)) < 1e-10
        elif case.expect == "scale":
            ratio = np.asarray(bad) / np.asarray(true)
            assert np.ptp(ratio) < 1e-8 * np.max(np.abs(ratio)), "not a constant factor"
