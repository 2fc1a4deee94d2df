"""Every custom VJP the package ships, under ``chex.variants`` (jitted, not jitted, arguments placed on a device):
its output and its VJP equal the float64 ``jax.vjp`` of its plain reference, entry by entry, to the tolerance of
the verifier's error model (:func:`jaxgrad.verify.assert_tree_matches_reference`: the float64 bound times each
entry's sum of |terms|), in float64 at small odd sizes; Pallas kernels run in interpret mode off-GPU.

The ops are the audit registry's cases (``jaxgrad.ops.registry.all_audit_cases``: a new op with ``audit_cases()``
is picked up here; ``tests/test_audit_registry.py`` proves that every custom VJP of the package is reached by a
case) at their smallest size, plus what the audit cannot check in float32 (``EXTRA``): LoRA dropout (its mask's
bits depend on the x64 mode) and left padding in attention (an exact zero gradient after it).

The reference (and its tolerances) is computed once per op and shared by the three variants."""

import functools
import math
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxgrad.ops.registry import all_audit_cases
from jaxgrad.verify import assert_tree_matches_reference, assert_vjp_matches, reference_bounds, value_and_vjp
from jaxgrad.verify.chex_helpers import LooseToleranceWarning, default_precision
from jaxgrad.verify.precision import F64_FLOOR

pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")


def _normal(rng, shape, std=1.0):
    return jnp.asarray(std * rng.standard_normal(shape), jnp.float64)


# ---------------------------------------------------------------------------------------------------------------
# Beyond the audit: name -> builder; builder(rng, dtype) -> (fn, ref, args), dtype: the one the op will run in
# (float64 here, float32 on the GPU), where the inputs depend on it
# ---------------------------------------------------------------------------------------------------------------
B, T, HQ, HKV, D, H, R = 2, 7, 3, 1, 8, 24, 4


def _qkv(rng):
    return _normal(rng, (B, T, HQ, D)), _normal(rng, (B, T, HKV, D)), _normal(rng, (B, T, HKV, D))


def _attention(rng, dtype=None):  # left padding: rows that see no key, and a first row with one key
    from jaxgrad.ops.attention import attention, attention_reference
    mask = jnp.array([[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]])  # right- and left-padded rows
    return (functools.partial(attention, attention_mask=mask),
            functools.partial(attention_reference, attention_mask=mask), _qkv(rng))


def _flash_attention(rng, dtype=None):  # the Pallas kernels (interpret mode on the CPU), same mask as above
    from jaxgrad.ops.attention import attention_reference
    from jaxgrad.ops.flash_attention import flash_attention
    mask = jnp.array([[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
    return (functools.partial(flash_attention, attention_mask=mask, block_q=16, block_k=16),
            functools.partial(attention_reference, attention_mask=mask), _qkv(rng))


def _lora_linear(rng, dtype=jnp.float64):
    from jaxgrad.ops.lora_linear import dropout_keep_scale, lora_linear, lora_linear_reference
    x, w = _normal(rng, (B, T, H)), _normal(rng, (40, H), H ** -0.5)
    a, b = _normal(rng, (R, H), H ** -0.5), _normal(rng, (40, R), R ** -0.5)
    key = jax.random.key(7)
    # the op regenerates its mask from the key, and jax.random's bits depend on the x64 mode (bernoulli draws in the
    # default float type): the reference's mask is drawn as the op will draw it, and evaluated in float64
    with jax.enable_x64(jnp.dtype(dtype) == jnp.float64):
        keep = dropout_keep_scale(key, 0.3, x.shape, dtype)
    fn = lambda x, a, b: lora_linear(x, w.astype(x.dtype), a, b, scale=0.5, dropout_rate=0.3,  # noqa: E731
                                     dropout_key=key)
    ref = lambda x, a, b: lora_linear_reference(x, w.astype(x.dtype), a, b, 0.5, keep.astype(x.dtype))  # noqa: E731
    return fn, ref, (x, a, b)


EXTRA = {
    "attention_left_padded": _attention,
    "flash_attention_left_padded": _flash_attention,
    "lora_linear_dropout": _lora_linear,
}


def _registry_case(case):
    def build(rng, dtype=None):  # the op's own audit inputs at its smallest audit size (make_args jitted: one compile)
        args = jax.jit(case.make_args, static_argnums=1)(jax.random.key(0), tuple(case.sizes[0]))
        return case.fn, case.reference, jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), args)
    # cases that differ only in fn (backends) share their inputs, reference and tolerances
    return build, (id(case.reference), id(case.make_args), tuple(case.sizes[0]))


# xla and pallas cases (Mosaic and cuDNN run bf16 only; the block's Pallas path is its kernels, here one by one,
# and tests/test_lora_block_pallas.py)
CASES = {c.name: _registry_case(c) for c in all_audit_cases()
         if c.backend in ("xla", "pallas") and c.name != "lora_block[pallas]"} | {
    name: (build, name) for name, build in EXTRA.items()}
_IDS = [(re.sub(r"\W+", "_", name).strip("_"), name) for name in CASES]
_REFERENCES, _CASES = {}, {}


def _case(name):
    """(fn, args, cotangent, bounds), built once per op; the float64 reference and its tolerances once per
    reference and inputs."""
    if name not in _CASES:
        build, key = CASES[name]
        with jax.enable_x64(True):
            fn, ref, args = build(np.random.default_rng(len(name)))
            if key not in _REFERENCES:
                # the low mantissa bits filled (as check_vjp's float64 re-run does): a kernel that computes in f32
                # cannot pass as float64 on inputs whose products happen to be exact in f32
                rng = np.random.default_rng(1)
                args = jax.tree.map(lambda a: a * (1 + 2.0 ** -26 * rng.standard_normal(a.shape)), args)
                ct = jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape), jnp.float64),
                                  jax.eval_shape(fn, *args))
                with warnings.catch_warnings():  # loose leaves (the LoRA block) get the normwise gate below
                    warnings.simplefilter("ignore", LooseToleranceWarning)
                    bounds = reference_bounds(value_and_vjp(ref), args, ct, precision="f64")
                _REFERENCES[key] = args, ct, bounds
        _CASES[name] = (fn, *_REFERENCES[key])
    return _CASES[name]


class OpVariantsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True, with_device=True)
    @parameterized.named_parameters(*_IDS)
    def test_value_and_vjp_match_float64_reference(self, name):
        fn, args, ct, bounds = _case(name)
        with jax.enable_x64(True):
            got = self.variant(value_and_vjp(fn))(args, ct)
            chex.assert_trees_all_equal_dtypes(got, (jax.eval_shape(fn, *args), args))  # float64 in and out
        bounds.assert_close(got, name=name)
        # Normwise too, at the float64 floor of the model: where sum|terms| grows through a long nonlinear chain
        # (the LoRA block: kappa ~1e126, see tests/test_lora_block.py) the per-entry tolerance admits anything.
        for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(bounds.expected)):
            err = float(np.linalg.norm(np.asarray(a) - e))
            assert err <= F64_FLOOR * float(np.linalg.norm(e)), f"{name} {jax.tree_util.keystr(path)}: {err:.2e}"


_GPU_CASES = {}


def _gpu_case(name):
    """The same ops in float32 on the GPU (Pallas: the compiled kernels), judged at the precision the run may have
    there (TF32 under JAX's default matmul precision: ``default_precision``)."""
    if name not in _GPU_CASES:
        build, _ = CASES[name]
        with jax.enable_x64(True):
            fn, ref, args = build(np.random.default_rng(len(name)), jnp.float32)
        rng = np.random.default_rng(1)
        args = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), args), jax.devices("gpu")[0])
        ct = jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape), jnp.float32), jax.eval_shape(fn, *args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LooseToleranceWarning)
            bounds = reference_bounds(value_and_vjp(ref), args, ct, precision=default_precision(args))
        _GPU_CASES[name] = fn, ref, args, ct, bounds
    return _GPU_CASES[name]


@pytest.mark.gpu
class OpVariantsGPUTest(chex.TestCase):
    """The chex suite on a GPU: every op jitted, not jitted and device-placed, in float32, against the float64
    reference to its rounding bound; and the verifier itself on chex variants of a Pallas kernel (docs/chex.md)."""

    @chex.variants(with_jit=True, without_jit=True, with_device=True)
    @parameterized.named_parameters(*_IDS)
    def test_value_and_vjp_match_float64_reference_on_gpu(self, name):
        fn, _, args, ct, bounds = _gpu_case(name)
        got = self.variant(value_and_vjp(fn))(args, ct)
        chex.assert_trees_all_equal_dtypes(got, (jax.eval_shape(fn, *args), args))
        bounds.assert_close(got, name=f"{name} on {jax.devices('gpu')[0].device_kind}")

    @chex.variants(with_jit=True, without_jit=True, with_device=True)
    def test_assert_vjp_matches_on_a_variant_of_the_swiglu_kernel(self):
        from jaxgrad.ops.swiglu import swiglu, swiglu_reference
        rng = np.random.default_rng(5)
        gate, up = (jnp.asarray(rng.standard_normal((33, 257)), jnp.float32) for _ in range(2))
        report = assert_vjp_matches(self.variant(functools.partial(swiglu, backend="pallas")), swiglu_reference,
                                    gate, up, arg_names=("gate", "up"))
        assert report.precision.precision == "f32"  # elementwise: no TF32 dots, judged (and passing) as f32


# ---------------------------------------------------------------------------------------------------------------
# The helper itself: it passes a correct op and fails a planted error at f32
# ---------------------------------------------------------------------------------------------------------------
def _swiglu_f32():
    from jaxgrad.ops.swiglu import swiglu, swiglu_reference
    rng = np.random.default_rng(3)
    a, u, ct = (jnp.asarray(rng.standard_normal((7, 13)), jnp.float32) for _ in range(3))
    return functools.partial(swiglu, backend="xla"), swiglu_reference, (a, u), ct


def test_tree_helper_passes_a_correct_f32_op_and_fails_a_planted_1e3_error():
    fn, ref, args, ct = _swiglu_f32()
    y, (ga, gu) = jax.jit(value_and_vjp(fn))(args, ct)
    assert default_precision((y, (ga, gu)), args, ct) == "f32"
    bounds = assert_tree_matches_reference((y, (ga, gu)), value_and_vjp(ref), args, ct)
    assert bounds.model.precision == "f32" and all(r <= 1 for _, r in bounds.errors((y, (ga, gu))))
    bad = (y, (ga, gu.at[3, 5].multiply(1 + 1e-3)))  # one entry of d(up) off by 1e-3, relative
    with pytest.raises(AssertionError, match=r"(?s)swiglu: .*beyond f32 rounding.*\[1\]\[1\] \(7, 13\): 1/91 entries "
                                             r"outside; worst at \(3, 5\)"):
        bounds.assert_close(bad, name="swiglu")
    # the same error passes at bf16, whose rounding (2^-8) is larger than 1e-3: the precision sets the tolerance
    assert_tree_matches_reference(bad, value_and_vjp(ref), args, ct, precision="bf16")
    with pytest.raises(AssertionError, match="tree structures differ"):
        bounds.assert_close((y, ga))
    with pytest.raises(ValueError, match="precision must be one of"):
        reference_bounds(ref, *args, precision="fp8")


def test_tree_helper_tolerance_scales_with_sum_of_terms_not_the_value():
    """A cancelling sum: the entry's value is ~0 but its terms are O(1), so its tolerance is u * sum|terms|."""
    x = jnp.asarray([1.0, 1e-3, -1.0], jnp.float32)
    bounds = reference_bounds(lambda x: jnp.sum(x * jnp.asarray([1.0, 1.0, 1.0], x.dtype)), x, precision="f32")
    np.testing.assert_allclose(bounds.expected, 1e-3, rtol=1e-6)
    assert math.isclose(float(bounds.tolerance), bounds.model.bound(bounds.terms[0]) * 2.001, rel_tol=1e-6)
    assert bounds.kappa[0] > 1000


def test_tree_helper_warns_where_the_tolerance_admits_any_error():
    x = jnp.asarray([1.0, 1.0 - 2.0 ** -20], jnp.float32)  # x0 - x1: 1e-6 of terms of size 1 (kappa ~2e6)
    with pytest.warns(LooseToleranceWarning, match="per-entry gate cannot fail"):
        bounds = reference_bounds(lambda x: x[0] - x[1], x, precision="bf16")
    assert [p for p, _ in bounds.loose_leaves()] == [""]
    assert not reference_bounds(lambda x: x[0] - x[1], x, precision="f64").loose_leaves()
