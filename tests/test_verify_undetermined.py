"""Where rounding is not first order: flips the replicas missed, and inputs a precision cannot resolve.

Specification:
- a ReLU flip that the 16 rounding replicas happened not to take is explained by its kink jump, not called a bug;
- a softmax on logits of size 1/u (a bf16 attention on inputs scaled by 1e3) is *undetermined* at bf16: neither a
  pass nor a bug, and said so;
- a bug at well-conditioned inputs of the same kernel is still a bug, and a leaf whose terms merely cancel is
  judged (not undetermined).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import check_vjp
from jaxgrad.verify.calibration import make_case
from jaxgrad.verify.stats import leaf_statistics

QUIET = dict(float64=False, fd=False, adjoint=False, structural=False)


def _saturated_attention_args(case):
    # logits of ~1e4: a bf16 rounding of q moves them by ~40, so each row's softmax winner is picked by rounding
    return tuple(jnp.asarray((np.asarray(a, np.float64) + 3.0) * 1e3 if j == 0 else a, jnp.float32)
                 for j, a in enumerate(case.args))


def test_a_relu_flip_the_replicas_missed_is_not_a_bug():
    # the configuration of the 500-run sweep that failed the normwise test before the kink jump was allowed for there
    case = make_case("conv_relu", 322, "f16", np.random.default_rng(1212691150))
    rep = check_vjp(case.fn, case.reference, *case.args, precision="f16", seed=150, **QUIET)
    assert rep.passed, rep


def test_a_saturated_bf16_softmax_is_undetermined_not_a_pass_and_not_a_bug():
    case = make_case("attention", 395, "bf16", np.random.default_rng(1967920470))
    rep = check_vjp(case.fn, case.reference, *_saturated_attention_args(case), precision="bf16", seed=470, **QUIET)
    assert not rep.passed and rep.undetermined, rep
    assert "UNDETERMINED" in str(rep) and "no bug was found" in str(rep)
    assert all(lf.undetermined for lf in rep.failures)


def _with_scaled_v_grad(fn, s):
    @jax.custom_vjp
    def f(q, k, v):
        return fn(q, k, v)

    def fwd(q, k, v):
        return jax.vjp(fn, q, k, v)

    def bwd(pb, g):
        dq, dk, dv = pb(g)
        return dq, dk, dv * s

    f.defvjp(fwd, bwd)
    return f


def test_an_undetermined_forward_does_not_pick_the_precision_of_the_gradients():
    # run 40 of the seed-1 CPU false-alarm sweep: a bf16 kernel on f32 arrays behind a saturated softmax.
    # Its forward is undetermined under every hypothesis, so the finest that "agrees" (tf32) was adopted, and dv --
    # determined, correct at bf16 -- failed tf32's scale test: a false alarm. Such a leaf is now undetermined.
    case = make_case("attention", 311, "bf16", np.random.default_rng(1658061678))
    args = _saturated_attention_args(case)
    rep = check_vjp(case.fn, case.reference, *args, seed=678, **QUIET)
    assert not rep.passed and rep.undetermined, rep
    assert rep.leaf("args[2]").undetermined and "BUG" not in rep.leaf("args[2]").verdict, rep
    # (with the scale test gated from beta = 0, dv passes tf32's scale test here and is undetermined by its jumps)
    # an error that bf16 explains but tf32 does not is not called a bug either: the forward cannot tell which of
    # them fn computes in (at this input the leaf is undetermined, "fails at tf32 but agrees with bf16")
    off = check_vjp(_with_scaled_v_grad(case.fn, 1.001), case.reference, *args, seed=678, **QUIET)
    assert not off.passed and off.undetermined and off.leaf("args[2]").undetermined, off
    assert "BUG" not in off.leaf("args[2]").verdict, off
    # a real bug in that leaf is not excused: 10% on dv fails at every hypothesis
    bad = check_vjp(_with_scaled_v_grad(case.fn, 1.1), case.reference, *args, seed=678, **QUIET)
    assert not bad.passed and not bad.undetermined and not bad.leaf("args[2]").undetermined, bad


def test_the_same_kernel_at_ordinary_inputs_is_judged():
    case = make_case("attention", 395, "bf16", np.random.default_rng(3))
    ok = check_vjp(case.fn, case.reference, *case.args, precision="bf16", seed=3, **QUIET)
    assert ok.passed and not ok.undetermined, ok
    # dq 5% too large: well above what bf16 rounding explains at this size
    bad = check_vjp(_with_scaled_q_grad(case.fn, 1.05), case.reference, *case.args, precision="bf16", seed=3, **QUIET)
    assert not bad.passed and not bad.undetermined, bad


def _with_scaled_q_grad(fn, s):
    @jax.custom_vjp
    def f(q, k, v):
        return fn(q, k, v)

    def fwd(q, k, v):
        y, pb = jax.vjp(fn, q, k, v)
        return y, pb

    def bwd(pb, g):
        dq, dk, dv = pb(g)
        return dq * s, dk, dv

    f.defvjp(fwd, bwd)
    return f


def test_a_cancelling_leaf_is_judged_not_undetermined():
    # rounding ten times the leaf's own size, but first order (no jumps): the tests stand, and a bug is a bug
    rng = np.random.default_rng(5)
    g = 1e-3 * rng.standard_normal(400)
    r = 1e-2 * rng.standard_normal((16, 400))
    e = 1e-2 * rng.standard_normal(400)
    st = leaf_statistics(e, r, g, "bf16")
    assert st.passed and not st.undetermined, st.summary()
    assert not leaf_statistics(e + 0.5, r, g, "bf16").passed
