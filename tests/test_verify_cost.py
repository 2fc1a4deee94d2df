"""What a verdict costs: ``check_vjp`` reports its time per stage, and the work it compiles stays bounded.

The cost of a verdict on a GPU is mostly XLA compilation (several times slower per program than on the CPU), so the
number of programs a ``check_vjp`` compiles is what these tests pin down (docs/verify.md, "The cost of a verdict";
``python -m jaxgrad.bench verify_cost`` measures the yardstick block).
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from jaxgrad.verify import check_vjp, magnitudes
from jaxgrad.verify.emulate import at_precision, perturb_host
from jaxgrad.verify.hypothesis import float64_oracle


def _op(x, w):
    return jnp.tanh(x @ w) * 2.0


def _args(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((6, 5)), dtype), jnp.asarray(rng.standard_normal((5, 3)), dtype))


def test_the_report_says_where_the_time_went():
    report = check_vjp(_op, _op, *_args())
    assert report.passed
    t = report.timings
    for stage in ("setup", "as called", "magnitudes", "replicas", "replicas' float64 oracle",
                  "precision and statistics", "float64 re-run", "finite differences", "adjoint", "structural",
                  "total"):
        assert stage in t and t[stage] >= 0.0, stage
    # the stages are disjoint parts of the call (the kink pass, where it runs, is one of them)
    parts = sum(v for k, v in t.items() if k != "total")
    assert parts <= t["total"] * 1.001 + 1e-3
    assert parts >= 0.9 * t["total"]
    assert str(report).splitlines()[-1].startswith("  time (s, compilation included): setup ")


class _Compiles:
    """Counts the XLA compilations inside the block (JAX's backend-compile event)."""

    def __enter__(self):
        self.n = 0
        self._listener = lambda event, duration, **_: self._count(event)
        monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def _count(self, event):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listener)


@jax.custom_vjp
def _scaled_tanh(x, w):
    return jnp.tanh(x @ w) * 2.0


def _scaled_tanh_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y * 2.0, (x, w, y)


def _scaled_tanh_bwd(res, g):
    x, w, y = res
    dz = g * 2.0 * (1 - y * y)
    return dz @ w.T, x.T @ dz


_scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def _random_primitives(jaxpr) -> set[str]:
    found = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if "random" in name or "threefry" in name or name == "sort":
            found.add(name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= _random_primitives(sub)
    return found


def test_the_replicas_summation_orders_are_drawn_on_the_host():
    # One compiled program serves every replica: the orders are arguments, drawn with NumPy from the replica's seed
    # (a random permutation drawn inside the program made it the largest compilation of a verdict: threefry and a
    # sort for every contraction).
    x, w = _args(jnp.bfloat16)
    emulated, _ = at_precision(lambda a, b: jnp.tanh(a @ b).sum(axis=0), "bf16", x, w, reorder=True)
    assert emulated.sizes == (5, 6)  # the contraction of the product, then the sum's axis
    np.testing.assert_array_equal(emulated.orders(7)[0], emulated.orders(7)[0])  # a seed is one order
    assert sorted(emulated.orders(7)[0].tolist()) == list(range(5))
    assert _random_primitives(emulated.jaxpr(x, w).jaxpr) == set()
    points = [(x, w)] * 5
    with _Compiles() as c:
        runs = [emulated(seed, x, w) for seed in range(5)]
        replicas = emulated.replicas(range(5), points)
    assert c.n <= 1
    # each replica is the unbatched program (a vmap would make a convolution a grouped one, which XLA accumulates
    # differently from the convolution under test)
    for k in range(5):
        np.testing.assert_array_equal(replicas[0][k], np.asarray(runs[k][0], np.float64))


def test_the_replicas_of_a_convolution_round_as_its_own_program_does():
    # A vmap over the replicas turns a convolution into a grouped one, which XLA accumulates differently: on the CPU
    # the input gradient of this f32 conv came out ~7x more accurate than under any summation order of the unbatched
    # conv, and the planted catalogue's correct conv2d failed its entry test (8.3 sigma). Each replica is the program
    # the reference runs, orders aside.
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def fwd_and_vjp(a, c):
        y, pullback = jax.vjp(conv, *a)
        return y, pullback(c)

    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.standard_normal((2, 9, 7, 3)), jnp.float32), jnp.asarray(rng.standard_normal((3, 5, 3, 4)),
                                                                                      jnp.float32)
    ct = jnp.asarray(rng.standard_normal((2, 9, 7, 4)), jnp.float32)
    emulated, _ = at_precision(fwd_and_vjp, "f32", (x, w), ct, reorder=True)
    points = [(perturb_host((x, w), "f32", rng), perturb_host(ct, "f32", rng)) for _ in range(32)]
    replicas = emulated.replicas(range(32), points)
    for k in (0, 17, 31):
        one = emulated(k, *points[k])
        for j in range(3):
            np.testing.assert_array_equal(replicas[j][k], np.asarray(one[j], np.float64))


def test_magnitudes_their_kink_pass_and_the_oracle_share_one_compilation():
    def fwd_and_vjp(a, c):  # as check_vjp hands the reference to both
        y, pullback = jax.vjp(lambda x, w: jax.nn.relu(x @ w), *a)
        return y, pullback(c)

    x, w = (np.asarray(a, np.float64) for a in _args())
    ct = np.random.default_rng(1).standard_normal((6, 3))
    with jax.enable_x64(True), jax.default_matmul_precision("highest"), _Compiles() as c:  # check_vjp's setting
        plain = magnitudes(fwd_and_vjp, (x, w), ct)
        loose = magnitudes(fwd_and_vjp, (x, w), ct, kink_bound=lambda n: 1e-2)
        tight = magnitudes(fwd_and_vjp, (x, w), ct, kink_bound=lambda n: 1e-6)
        values = float64_oracle(fwd_and_vjp)((x, w), ct)
    assert c.n == 1
    assert plain.kinks is None and "gt" in plain.rounded_comparisons
    for a, b, d, v in zip(plain.values, loose.values, tight.values, values, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, d)
        np.testing.assert_array_equal(np.asarray(a), v)
    for a, b in zip(plain.magnitudes, tight.magnitudes, strict=True):
        np.testing.assert_array_equal(a, b)
    # the radii are arguments of the one program, not constants of its first call
    assert loose.uncertain_comparisons > tight.uncertain_comparisons
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        fresh = magnitudes(lambda a, c: fwd_and_vjp(a, c), (x, w), ct, kink_bound=lambda n: 1e-6)
    assert fresh.uncertain_comparisons == tight.uncertain_comparisons
    for a, b in zip(fresh.kinks, tight.kinks, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_verifier_compiles_its_own_programs_at_level_0_on_the_cpu_except_those_that_convolve(monkeypatch):
    # level 0 compiles fast and runs a GEMM (a library call) as fast; a convolution is emitted as loops, which level
    # 0 leaves about ten times slower, and the magnitude program runs once per replica as the float64 oracle
    from jaxgrad.verify import cost, magnitude

    assert cost.options("cpu") == {"xla_backend_optimization_level": 0}
    assert cost.options("cpu", convolves=True) == {"xla_backend_optimization_level": cost.CONVOLVING_CPU_LEVEL}
    assert cost.CONVOLVING_CPU_LEVEL > 0
    assert "xla_backend_optimization_level" not in cost.options("gpu", convolves=True)

    seen = []
    monkeypatch.setattr(cost, "jit", lambda fun, *, convolves=False, **kw: seen.append(convolves) or jax.jit(fun))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 5, 5, 2)), rng.standard_normal((3, 3, 2, 3))
    with jax.enable_x64(True):
        magnitude._Program(lambda x, w: jax.nn.relu(conv(x, w)), (x, w))
        magnitude._Program(lambda x, w: jax.jit(conv)(x, w), (x, w))  # inside a nested jaxpr
        magnitude._Program(lambda x, w: jnp.tanh(x.reshape(5, 10) @ w.reshape(2, 27)[:, :10].T), (x, w))
    assert seen == [True, True, False]


def test_a_verdict_compiles_a_handful_of_programs():
    # fn's VJP as called (read again for its precision), the magnitude program (which is also the float64 oracle),
    # the emulated replicas (all of them in one program), fn's float64 VJP, the finite differences' loss and the
    # adjoint test's JVP; everything else runs on the host. (An eager jnp operation per leaf made it ~150 programs.)
    x, w = _args(jnp.bfloat16)
    with _Compiles() as c:
        report = check_vjp(_scaled_tanh, _op, x, w)
    assert report.passed, str(report)
    assert c.n <= 8, c.n


@jax.custom_vjp
def _tanh_in_f32(x, w):
    return jnp.tanh(x.astype(jnp.float32) @ w.astype(jnp.float32))


def _tanh_in_f32_fwd(x, w):
    y = _tanh_in_f32(x, w)
    return y, (x, w, y)


def _tanh_in_f32_bwd(res, g):
    x, w, y = res
    dz = (g * (1 - y * y)).astype(jnp.float32)
    return (dz @ w.astype(jnp.float32).T).astype(x.dtype), (x.astype(jnp.float32).T @ dz).astype(w.dtype)


_tanh_in_f32.defvjp(_tanh_in_f32_fwd, _tanh_in_f32_bwd)


def test_a_forward_that_returns_float32_for_float64_inputs_is_not_compiled_again():
    # its output dtypes say so without compiling: no float64 re-run program (the report says why, as before)
    x, w = _args()
    counts = {}
    for float64 in (True, False):
        with _Compiles() as c:
            report = check_vjp(_tanh_in_f32, lambda a, b: jnp.tanh(a @ b), x, w, float64=float64)
        counts[float64] = c.n
        assert report.passed, str(report)
    assert report.float64_status == "disabled (float64=False)"
    with _Compiles():
        report = check_vjp(_tanh_in_f32, lambda a, b: jnp.tanh(a @ b), x, w)
    assert report.float64_status == "fn returns lower precision for float64 inputs"
    assert counts[True] == counts[False], counts
