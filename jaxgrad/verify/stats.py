r"""The statistical verdict: is ``fn``'s error distributed like rounding at the precision it computes in?

Rounding error is nearly independent of the true value and from entry to entry; a bug is systematic. So the error
``e = g - g*`` of the run under test (``g*``: the float64 oracle) is compared with :math:`K` independent samples of
the error the computation *should* have, ``r_k = g_p(x_k) - g*(x_k)``: the reference run at precision ``p``
(:mod:`jaxgrad.verify.emulate`) at the same point perturbed by a few ulps (new rounding, same math), each against
its own float64 oracle. Four tests, each with a threshold derived from the model and a false-alarm rate
:math:`\alpha` (the model: ``e`` and every ``r_k`` are independent zero-mean Gaussian vectors, entries independent,
``e`` at most ``IMPLEMENTATION_FACTOR`` (:math:`c`) times the RMS of ``r_k``):

1. **Normwise.** :math:`R = \|e_\perp\|^2 / \overline{\|r_{k\perp}\|^2}` (components orthogonal to ``g*``, so a
   scale error does not count twice) is :math:`F(d, Kd)`-distributed with ``d`` effective degrees of freedom
   (the participation ratio of the per-entry variances, or fewer where the replicas' norms vary more, as correlated
   entries make them); it fails above :math:`c^2 F^{-1}_{1-\alpha}(d, Kd)`. Where a rounded comparison may flip
   (kink jump :math:`\kappa_i`, below), ``e`` and every ``r_k`` are first shrunk by it,
   :math:`\mathrm{sign}(e_i)\max(|e_i| - \kappa_i, 0)`: a flip the K replicas happened not to take is explained, and
   what no flip explains is still judged.
2. **Scale / sign bias.** The weighted (generalised least-squares) estimate of a scale error,
   :math:`\beta = \langle e, w\rangle / \langle g^*, w\rangle` with :math:`w_i = g^*_i / v'_i` (a gradient
   ``(1+s) g*`` gives ``beta = s``): entries are weighted by their precision, so a leaf whose rounding is uneven
   (softmax rows, kink jumps, rows of different scale) is judged by its precise entries, not diluted by its noisy
   ones. With independent entries its spread is :math:`1/\sqrt{\sum_i g_i^{*2}/v_i}`, the Cramer-Rao bound: no
   unbiased estimate of a scale error does better. :math:`v'_i = \max(v_i, q\,g_i^{*2})` caps an entry's
   relative precision at ``WEIGHT_CAP`` times the leaf's median (:math:`q` = median of :math:`v_i/g_i^{*2}` over
   ``WEIGHT_CAP``), so a few entries the replicas happened to compute almost exactly cannot carry the estimate.
   Its rounding spread :math:`\sigma_\beta` is the larger of the replicas' RMS ``beta_k`` (each replica weighted
   by the variance of the *other* K - 1, so it is judged like ``e``, by weights it did not shape; this sees
   correlated errors) and :math:`\sqrt{\sum_i w_i^2 v_i} / \langle g^*, w\rangle` (independent entries), times
   :math:`\rho` (below); it fails when :math:`|\beta| > \max(t^{-1}_{K,1-\alpha/2}\,\sigma_\beta, \delta_p)`.
   (With weights :math:`w = g^*` a bf16 attention leaf of 64 entries caught only a 3% scale error, not 1%, while
   its Cramer-Rao floor is 0.4%.)
   **Kink jumps are gated, not assumed.** The jump :math:`\kappa_i` of an entry fed by a rounded comparison is a
   worst case (every uncertain comparison flipped, all jumps of one sign): behind a conv's ReLU it measured ~100x
   the replicas' own spread at 98% of a bf16 ``dx``'s entries, so as a standard deviation it swamped the weights
   and the spread (bf16 conv+ReLU at 16,640 entries caught 3%, not 1%). A flip is a rare, large event and the
   replicas (the reference at ``p``) take flips at the rate rounding causes them, so the weights use
   :math:`v^0_i` (``v`` without :math:`\kappa_i^2`), and an entry whose residual :math:`e_i - \beta g^*_i` exceeds
   ``FLIP_GATE`` standard deviations (:math:`\rho\sqrt{v^{0\prime}_i}`) where a flip can explain it
   (:math:`\kappa_i > 0`) gets :math:`v^{0\prime}_i + \kappa_i^2` instead (iterated with :math:`\beta`; a scale
   error moves every entry and is absorbed into :math:`\beta`, not gated). Each replica is gated the same way
   (by the other K - 1), so the null spread contains the flips the gate lets through and those it catches.
   :math:`\delta_p = u_p / 8` is the systematic bias a correct unit may carry (e.g. truncated alignment in a
   tensor core's adder tree); a TF32 conversion that truncates instead of rounding (about :math:`-1.4 u_p` per
   product) is above it and is reported.
3. **Entries.** :math:`z_i^2 = e_i^2 / (\rho^2 v_i)` with the per-entry variance
   :math:`v_i = \overline{r_{ki}^2} + \kappa_i^2 + u_{f32}^2 (g_i^{*2} + \mathrm{rms}(g^*)^2/16)` (replicas, the
   kink jump :math:`\kappa_i` where a rounded comparison may flip, and one f32 rounding of the result and of a
   quarter of the leaf's RMS, for entries every replica computed exactly; behind kinks :math:`\rho` scales the
   rounding part only, :math:`z_i^2 = e_i^2 / (\rho^2 v^0_i + \kappa_i^2)`);
   :math:`e_i^2/\overline{r_{ki}^2}` is :math:`F(1, K)`, so the largest fails above
   :math:`F^{-1}_{1-\alpha/n}(1, K)` (Bonferroni over the ``n`` entries).
4. **Slices.** For every axis of a leaf with two or more axes, and every index along it (a row, a column, a
   channel, a border): :math:`T = \sum_{i \in S} z_i^2`. With independent entries it is a sum of ``n_S``
   :math:`F(1, K)` terms; but the entries of a slice share rounded operands (a row of ``x^T g`` shares the rounding
   of one ``x`` column), so the null distribution is matched to the replicas' own slice sums (each replica judged
   with the variance of the other ``K - 1``): a scaled :math:`\chi^2` with their mean and variance over the axis,
   and, since slices differ (a peaked softmax row is one correlated unit, a flat one many), each slice against its
   own K replica sums, :math:`T / \bar T_k \sim F(d_S, K d_S)` with :math:`d_S` from their spread. It fails above
   the largest of these :math:`1 - \alpha / n_{\text{slices}}` quantiles and that of the independent-entry sum
   (bulk :math:`\chi^2` and the heavy tail of one large term). The part of a slice's spread beyond that of
   independent entries is rounding shared by the slice (a row statistic such as RMSNorm's rstd or a softmax's lse,
   rounded once for the whole row); a correct kernel computes it in its own order and formula, so ``fn`` may carry
   up to ``SHARED_FACTOR`` (:math:`c_s = 2`, amplitude) times the replicas' shared part: its variance is scaled by
   :math:`c_s^4` and its mean by :math:`c_s^2` before the own-replica quantile. Slices of independent entries keep
   their limit. ``fn``'s rounding *level* may also differ from the reference's along an axis (our attention VJP
   recomputes :math:`P = e^{S - \mathrm{lse}}`, which puts the lse's rounding into every entry of a row; the
   reference's softmax rounds P relatively: its dV slice sums measured 1.3-2.9x the reference's while the entries'
   median ratio :math:`\rho` was 0.65). Along an axis of at least ``SLICE_LEVEL_MIN`` slices with rounding, that
   level is :math:`\lambda = \mathrm{median}_S(T_S / \bar T_S) / \lambda_0`, with :math:`\lambda_0` the same median
   of the replicas' own sums (a bug confined to a few slices does not move a median), and every slice's limit is
   scaled by :math:`\min(\max(1, \lambda), c^2/\rho_s^2)` (the whole allowance, with :math:`\rho`, is ``c``). An
   error confined to a border row, a stale column or a ragged last block stands out here even when the leaf's
   norm hides it.

:math:`\rho`, how much more ``fn`` rounds than the emulated reference, is estimated robustly from the median of
:math:`e_{\perp i}^2 / v^0_i` (the rounding variance without the kink jumps: a worst-case jump is no measure of how
much fn rounds; behind kinks, against the replicas' own median of that ratio, since an entry's error is then a
mixture of rounding and flips; the error orthogonal to ``g*``, so a scale bug does not inflate the spread that judges
it; the median, so a bug confined to a few entries does not either) and used as :math:`\min(\max(1, \rho), c)` in 2-4
(beyond ``c`` the normwise test fails anyway);
test 1 bounds it. :math:`\alpha` is split evenly over the four tests of a leaf (``FALSE_ALARM_RATE`` per leaf).

**Undetermined leaves.** The model is first order. Where an entry is fed by a saturated exp (a softmax on logits so
large that its rounded run picks each row's winner by rounding: :mod:`jaxgrad.verify.magnitude` gives it a jump of
:math:`e^{60}` times its value, so :math:`\|\kappa\| \ge e^{30}\|g^*\|`), the value is not determined by the inputs
at that precision and the Gaussian model does not hold: such a leaf is reported *undetermined* (neither right nor
wrong) with the four tests still shown. ReLU-type flips do not make a leaf undetermined: their jumps are judged.
A leaf whose terms merely cancel is not undetermined: its rounding is first order, however large against the leaf.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats as sps

__all__ = ["FALSE_ALARM_RATE", "FLIP_GATE", "IMPLEMENTATION_FACTOR", "REPLICAS", "SHARED_FACTOR", "SLICE_LEVEL_MIN",
           "SMALL_LEAF", "SMALL_LEAF_REPLICAS", "replicas_for", "LeafNull", "LeafStatistics", "bias_floor",
           "entry_variance", "leaf_null", "leaf_statistics"]

REPLICAS = 16  # K: rounding realisations of the reference at the hypothesis precision
# K for a function whose leaves (gradients and outputs) all have at most SMALL_LEAF entries. An error confined to 1%
# of a leaf of n entries is n / 100 entries: below a few thousand entries too few for the slice test, so the entry
# test must see one entry at 10 modelled sigma, i.e. 10 / rho_s with rho_s up to ~1.2 (a median of few ratios). The
# entry test's Bonferroni limit sqrt(F^-1_{1 - alpha/(4n)}(1, K)) is, with K = 16, 8.2 sigma at 64 entries and 10.1
# at 1024 (measured: 16-20/20 at 63-80 entries, 18-19/20 for attention TF32 at 1024); with K = 32 it is 6.4 at 64,
# 7.3 at 1024 and 7.8 at 4096 (20/20 in every 63-80-entry cell). Above 4096 the 1% is >= 41 entries and
# the slice test catches it (20/20 from 16,384 entries). Twice the replica cost, for small, cheap functions.
SMALL_LEAF_REPLICAS = 32
SMALL_LEAF = 4096


def replicas_for(largest_leaf: int) -> int:
    """K for a function whose largest gradient or output leaf has ``largest_leaf`` entries (see SMALL_LEAF)."""
    return SMALL_LEAF_REPLICAS if largest_leaf <= SMALL_LEAF else REPLICAS


FALSE_ALARM_RATE = 1e-4  # per leaf, under the model: split evenly over the four tests
# c: a correct kernel may round more than the reference run at its precision (fused vs separate casts, blocking,
# bf16 intermediates): correct VJPs of the planted catalogue measured <= 2.1x their reference (CPU, f32 and bf16).
IMPLEMENTATION_FACTOR = 4.0
# A leaf is undetermined when its jumps ||K|| reach this multiple of its norm: only entries fed by a saturated exp
# (K = |exp a| e^60, kinks.SATURATED_JUMP) get there; a rounded comparison's jump is the difference of two
# first-order branches, which the four tests model (its flips are judged, not excused).
UNDETERMINED_SPREAD = float(np.exp(30.0))
# A statistic shared by a slice (a row's rstd or mean(x * g) in RMSNorm, a softmax row's lse) is one rounding shared
# by every entry of the slice, and a correct kernel computes it in its own order and formula: the RMSNorm kernel's
# row coefficients measured 2.1x the variance of the XLA reference's (1.45x amplitude; tests/test_rmsnorm_kernel.py).
# The slice test allows fn up to this amplitude factor on the part of a slice's spread that is shared (module doc).
SHARED_FACTOR = 2.0
# fn's rounding level may differ from slice to slice (where its formula differs from the reference's: our attention
# VJP recomputes P = exp(S - lse), which carries lse's rounding into a whole row; the reference's softmax rounds P
# relatively). Along an axis of at least this many slices, the median of T_S / mean_k T_kS over the slices measures
# fn's typical level (a bug confined to a few slices does not move it) and scales every slice's limit (module doc).
SLICE_LEVEL_MIN = 3
# The weighted scale test (module doc, test 2) trusts no entry's relative precision (g*_i^2 / v_i) beyond this
# multiple of the leaf's median: a few entries that every replica computed almost exactly cannot carry the estimate.
WEIGHT_CAP = 100.0
# The scale test gates kink jumps (module doc, test 2): an entry with kappa_i > 0 whose residual exceeds this many of
# its modelled standard deviations is taken as a branch flip and weighted by v0' + kappa^2. Under the Gaussian model
# a flip-free entry passes the gate with probability 1 - 6e-5; a gated one only loses weight (it is not judged here).
FLIP_GATE = 4.0
_UNIT = {"f64": 2.0**-53, "f32": 2.0**-24, "tf32": 2.0**-11, "f16": 2.0**-11, "bf16": 2.0**-8}


def bias_floor(precision: str) -> float:
    """delta_p = u_p / 8: a relative scale bias below this is within what correct hardware may do."""
    return _UNIT[precision] / 8


@dataclasses.dataclass(frozen=True)
class LeafStatistics:
    """The four tests of one leaf (module doc); every threshold is printed with the value it judges."""

    n: int
    replicas: int
    alpha: float
    rho: float  # robust estimate of fn's rounding / the emulated reference's
    norm_ratio: float  # sqrt(R): ||e_perp|| / RMS ||r_k,perp||
    norm_limit: float
    dof: float  # effective degrees of freedom of the normwise test
    beta: float  # the weighted scale estimate <e, w> / <g*, w>, w = g* / v' (module doc, test 2)
    beta_sigma: float
    beta_limit: float
    entry_z: float  # largest |z_i|
    entry_limit: float
    entry_index: tuple[int, ...]
    slice_ratio: float  # largest T / its limit (> 1 fails)
    slice_where: str  # "axis 0 index 12" of the worst slice
    failed: tuple[str, ...]
    # ||K|| / ||g*||: the branch flips and saturated exps the rounding may cause, relative to the leaf
    kink_spread: float = 0.0
    # ||shrink(e, K)|| / RMS_k ||shrink(r_k, K)||: the error no branch flip explains over the replicas' same part (not
    # projected: a scale error counts); ||e|| / RMS ||r_k|| without kinks. The audit's size trend compares it across
    # sizes (a flip is a whole term, not rounding that grows with the problem)
    flip_free_ratio: float = math.nan

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def undetermined(self) -> bool:
        """Fed by a saturated exp (a softmax row whose winner the rounding picks; module doc): at this point and
        precision the value is not determined by the inputs, and the first-order model behind the
        four tests does not hold, so no error smaller than the value can be told from rounding. Such a leaf is neither
        right nor wrong; the tests are still run and reported. (A leaf whose terms merely cancel is judged: its
        rounding is first order, however large against the leaf.)"""
        return self.kink_spread >= UNDETERMINED_SPREAD

    def summary(self) -> str:
        return (f"rho {self.rho:.2g}; norm {self.norm_ratio:.2g} (limit {self.norm_limit:.2g}); scale "
                f"{self.beta:+.2e} (limit {self.beta_limit:.1e} = max(t*{self.beta_sigma:.1e}, u_p/8)); entry "
                f"|z| {self.entry_z:.1f} (limit {self.entry_limit:.1f}); worst slice {self.slice_ratio:.2g} of its "
                f"limit ({self.slice_where})" + (f"; jumps ||K|| {self.kink_spread:.2g}x ||g*||"
                                                  if self.kink_spread > 0 else ""))

    def undetermined_text(self) -> str:
        return ("it is fed by an exp whose argument's rounding moves it by a factor e or more (a softmax whose rounded "
                "run picks each row's winner by rounding): at these inputs it is not determined at this precision")

    def failure_text(self) -> str:
        what = {
            "norm": f"its error is {self.norm_ratio:.2g}x the rounding of the reference at this precision "
                    f"(limit {self.norm_limit:.2g})",
            "scale": f"it is scaled by {1 + self.beta:.6g} (a {self.beta:+.2e} relative bias; rounding allows "
                     f"{self.beta_limit:.1e})",
            "entry": f"entry {self.entry_index} is {self.entry_z:.1f} rounding standard deviations off (limit "
                     f"{self.entry_limit:.1f})",
            "slice": f"the error is concentrated in {self.slice_where} ({self.slice_ratio:.3g}x the limit of a "
                     "slice's rounding)",
        }
        return "; ".join(what[f] for f in self.failed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def entry_variance(replicas: np.ndarray, g_ref: np.ndarray, kink: np.ndarray | None = None) -> np.ndarray:
    """v_i: the modelled rounding variance of every entry -- the replicas' mean square, the kink jump squared (one
    standard deviation where a rounded comparison may flip) and one f32 rounding of the result itself and of a quarter
    of the leaf's RMS (so an entry that every replica computed exactly, an exact zero say, is not judged against
    zero)."""
    r = np.asarray(replicas, np.float64)
    g = np.asarray(g_ref, np.float64)
    # one f32 rounding of the result, and of a quarter of the leaf's RMS (an exactly-zero entry, e.g. a masked row)
    v = np.mean(r * r, axis=0) + (2.0**-24 * g) ** 2 + (2.0**-26 * float(np.sqrt(np.mean(g * g)) if g.size else 0)) ** 2
    if kink is not None:
        v = v + np.asarray(kink, np.float64) ** 2
    return np.maximum(v, 1e-300)


def _perp(v: np.ndarray, g: np.ndarray, gg: float) -> np.ndarray:
    return v - (np.vdot(v, g) / gg) * g if gg > 0 else v


def _f_moments(k: int) -> tuple[float, float]:
    """Mean and variance of F(1, k): an entry's z^2 judged against k replicas."""
    return k / (k - 2), 2 * k * k * (k - 1) / ((k - 2) ** 2 * (k - 4))


def _sum_of_f_quantile(n: int, k: int, p_exceed: float) -> float:
    """Upper quantile of a sum of n independent F(1, k) variables: the larger of a moment-matched scaled chi-square
    (the bulk) and the one-big-term tail of a heavy-tailed sum, P(S > x) ~ n P(F > x - (n - 1) mean)."""
    m1, v1 = _f_moments(k)
    scale = v1 / (2 * m1)
    dof = n * 2 * m1 * m1 / v1
    bulk = float(scale * sps.chi2.isf(p_exceed, dof))
    tail = (n - 1) * m1 + float(sps.f.isf(p_exceed / n, 1, k))
    return max(bulk, tail)


def _gated_scale(e: np.ndarray, g: np.ndarray, v0: np.ndarray, kink: np.ndarray | None, q: float, sd: float,
                 iterations: int = 4, from_zero: bool = False) -> tuple[float, np.ndarray, np.ndarray]:
    """``(beta, w, v_f)``: the weighted scale estimate of ``e`` (flat) with its kink jumps gated (module doc, test
    2). ``v_f = max(v0, q g^2)`` plus ``kappa^2`` where the residual ``e - beta g`` exceeds ``FLIP_GATE * sd``
    standard deviations and a flip can explain it; ``w = g / v_f``. Re-weighted until the gated set settles,
    starting from the ungated estimate, or with ``from_zero`` from ``beta = 0`` (the gate first judges ``e`` itself:
    the fixed point "no scale error, these entries flipped", where one exists)."""
    with np.errstate(over="ignore"):  # q g^2 = inf where q is (no finite precision cap): that entry weighs 0
        vv = np.maximum(v0, np.where(g != 0, q * g * g, 0.0))
    w = g / vv
    if not float(g @ w) > 0:  # every g_i^2 / v_i underflows (replicas of e^60-size jumps): the leaf tells no scale
        return 0.0, np.zeros_like(w), vv
    beta = float(e @ w) / float(g @ w)
    if kink is None or not np.any(kink > 0):
        return beta, w, vv
    flag = np.zeros(g.shape, bool)
    vf = vv
    if from_zero:
        beta = 0.0
    for it in range(iterations):
        res = e - beta * g
        new = (kink > 0) & (res * res > (FLIP_GATE * sd) ** 2 * vv)
        if it > 0 and np.array_equal(new, flag):
            break
        flag = new
        vf = np.where(flag, vv + kink * kink, vv)
        w = g / vf
        if not float(g @ w) > 0:
            return 0.0, np.zeros_like(w), vf
        beta = float(e @ w) / float(g @ w)
    return beta, w, vf


def _shrink(x: np.ndarray, kink: np.ndarray) -> np.ndarray:
    """sign(x) max(|x| - K, 0): the error left once a possible branch flip of size K is allowed for."""
    kk = np.asarray(kink, np.float64)
    return np.sign(x) * np.maximum(np.abs(x) - kk, 0.0)


@dataclasses.dataclass(frozen=True)
class LeafNull:
    """The part of a leaf's four tests that depends on the replicas only: variances and limits."""

    v: np.ndarray  # per-entry modelled variance (entry_variance), kink jumps included
    v0: np.ndarray  # the same without the kink jumps: the rounding the replicas show (weights of the scale test)
    gg: float  # ||g*||^2
    den: float  # mean ||r_k,perp||^2 (replicas shrunk by the kink jumps)
    den_full: float  # mean ||r_k||^2, shrunk the same way, not projected (the flip-free ratio's yardstick)
    dof: float
    norm_limit: float
    beta_spread: float  # the replicas' RMS beta_k (each gated by the other K - 1); times rho, part of sigma_beta
    beta_q: float  # q: the cap on an entry's relative precision in the scale test's weights (module doc, test 2)
    rho_median: float  # what median(e_perp^2 / v0) is for a correct run: F(1, K)'s median, or the replicas' own
    beta_t: float  # t quantile of the scale test
    entry_limit: float
    slice_limits: dict  # axis -> per-slice limit of sum z_i^2
    slice_means: dict  # axis -> the replicas' mean slice sums (the yardstick of fn's slice level)
    slice_level_median: dict  # axis -> what median_S(T_S / mean_k T_kS) is for a correct run (the replicas' own)
    kink_spread: float


def leaf_null(replicas: np.ndarray, g_ref: np.ndarray, precision: str, kink: np.ndarray | None = None,
              alpha: float = FALSE_ALARM_RATE, factor: float = IMPLEMENTATION_FACTOR) -> LeafNull:
    """The replica-only part of :func:`leaf_statistics` (module doc), computed once per leaf and model."""
    r = np.asarray(replicas, np.float64)
    g = np.asarray(g_ref, np.float64)
    k = r.shape[0]
    n = max(g.size, 1)
    a4 = alpha / 4
    v = entry_variance(r, g, kink)
    v0 = v if kink is None else entry_variance(r, g, None)
    gg = float(np.vdot(g, g))
    kink_sq = float(np.sum(np.asarray(kink, np.float64) ** 2)) if kink is not None else 0.0
    kink_spread = math.sqrt(kink_sq / gg) if gg > 0 else (0.0 if kink_sq == 0 else math.inf)

    # 1. normwise. Where a rounded comparison may flip, the part of an entry's error up to its jump K is what a flip
    # can explain (the 16 replicas may not have had that flip): it is taken out of e and of the replicas alike (soft
    # threshold), so the norm judges what no flip explains.
    r_n = r if kink is None else _shrink(r, kink)
    r_perp = np.stack([_perp(rk.ravel(), g.ravel(), gg) for rk in r_n])
    norms = np.sum(r_perp * r_perp, axis=1)
    full = np.sum(r_n.reshape(k, -1) ** 2, axis=1)
    if kink is not None and np.any(full == 0):  # the same yardstick rule as the norm's, below
        full = np.sum(r.reshape(k, -1) ** 2, axis=1)
    den_full = float(np.mean(full))
    if kink is not None and np.any(norms == 0):
        # the shrink took a replica's whole error (every entry within its jump: a small leaf behind kinks, a conv's
        # bias). Those replicas no longer sample the rounding that e's residual carries where fn flips and they did
        # not, so the yardstick is the unshrunk replicas: |shrink(e, K)| <= |e's rounding part| entry by entry when
        # fn's flips are within K, whose mean square the replicas' own (rounding plus their flips) bounds. Seen on
        # the H100: a 6-entry bias whose replicas all shrank to 0 judged e's float64-roundoff excess
        # over K against den = 1e-300 sum(v) -- a norm ratio of 4.4e141.
        r_perp = np.stack([_perp(rk.ravel(), g.ravel(), gg) for rk in r])
        norms = np.sum(r_perp * r_perp, axis=1)
    den = float(np.mean(norms)) + float(np.sum(v)) * 1e-300
    dof = float(np.sum(v) ** 2 / np.sum(v * v)) if np.sum(v * v) > 0 else 1.0  # independent entries
    if np.var(norms) > 0:  # correlated entries have fewer effective degrees of freedom: the replicas show how many
        dof = min(dof, 2 * float(np.mean(norms)) ** 2 / float(np.var(norms)))
    dof = max(1.0, min(dof, float(n)))
    norm_limit = factor * math.sqrt(float(sps.f.isf(a4, dof, k * dof)))

    # 2. scale: the replicas' RMS beta_k, each weighted by the other K - 1 (leave one out: weights it did not shape,
    # as e's are) and with its kink jumps gated like e's (module doc); the independent-entry spread is e's own
    # (leaf_statistics), since its gated entries are e's.
    # rho's yardstick, from the same replicas: for Gaussian entries median(e_perp^2 / v0) is F(1, K)'s median; behind
    # kinks an entry's error is a mixture (a flip or not), so the replicas' own medians say what it is (each replica
    # as leaf_statistics treats e: minus its gated scale, against the other K - 1)
    beta_spread, q, rho_median = 0.0, 0.0, float(sps.f.median(1, k))
    if gg > 0:
        gf, v0f = g.ravel(), v0.ravel()
        g2 = gf * gf  # g_i^2 may underflow where g_i != 0 (a saturated softmax's leaf): those entries weigh 0
        with np.errstate(over="ignore"):  # v0 / g^2 beyond the float64 range (a subnormal g^2): inf, a weight of 0
            q = float(np.median(v0f[g2 > 0] / g2[g2 > 0])) / WEIGHT_CAP if np.any(g2 > 0) else math.inf
        kf = None if kink is None else np.asarray(kink, np.float64).ravel()
        rf = r.reshape(k, -1)
        s2, floor = np.sum(rf * rf, axis=0), v0f - np.mean(rf * rf, axis=0)
        beta_k, meds = np.empty(k), []
        for j in range(k):
            v0j = np.maximum((s2 - rf[j] ** 2) / (k - 1) + floor, 1e-300)
            beta_k[j] = _gated_scale(rf[j], gf, v0j, kf, q, 1.0)[0]
            if kf is not None:
                with np.errstate(over="ignore"):  # an entry the other K - 1 computed exactly: inf, harmless here
                    meds.append(float(np.median((rf[j] - beta_k[j] * gf) ** 2 / v0j)))
        beta_spread = float(np.sqrt(np.mean(beta_k * beta_k)))
        if meds:
            rho_median = max(float(np.median(meds)), 1e-300)

    # 4. slices along every axis (leaves of two or more axes). Errors within a slice can be correlated (a rounded
    # operand shared by a whole row of an outer product), so a slice sum is not a sum of independent F(1, K) terms:
    # its distribution is taken from the replicas' own slice sums (each judged with the variance of the others).
    axes = [ax for ax in range(g.ndim) if g.shape[ax] > 1] if g.ndim >= 2 else []
    n_slices = sum(g.shape[ax] for ax in axes)
    slice_limits, slice_means, slice_level_median = {}, {}, {}
    if axes:
        extra = v - np.mean(r * r, axis=0)  # kink and floor terms
        z2_rep = np.stack([r[j] ** 2 / np.maximum((np.sum(r * r, axis=0) - r[j] ** 2) / (k - 1) + extra, 1e-300)
                           for j in range(k)])
    for ax in axes:
        length = g.shape[ax]
        t_rep = np.sum(np.moveaxis(z2_rep, ax + 1, 1).reshape(k, length, -1), axis=2)  # [K, length]
        p_slice = a4 / n_slices
        lim = np.full(length, _sum_of_f_quantile(n // length, k, p_slice))
        mean_t, var_t = float(np.mean(t_rep)), float(np.var(t_rep))
        if var_t > 0 and mean_t > 0:  # scaled chi-square matched to all the replicas' slice sums of this axis
            dof_t = max(2 * mean_t * mean_t / var_t, 0.5)
            lim = np.maximum(lim, var_t / (2 * mean_t) * float(sps.chi2.isf(p_slice, dof_t)))
        # slices differ (a peaked softmax row is one correlated unit, a flat one many): each slice also against its
        # own replicas, T / mean_k T_k ~ F(d_S, K d_S) with d_S from their spread. The spread beyond that of
        # independent entries is rounding shared by the slice (a row's rstd, a softmax's lse), which fn may carry up
        # to SHARED_FACTOR times (amplitude) more than the reference: its variance is scaled by SHARED_FACTOR^2 and
        # its mean (one shared component: E = sqrt(Var / 2)) by SHARED_FACTOR^2 too.
        m_s, v_s = np.mean(t_rep, axis=0), np.var(t_rep, axis=0, ddof=1)
        v_ind = (n // length) * _f_moments(k)[1]
        v_sh = np.maximum(v_s - v_ind, 0.0)
        lam = SHARED_FACTOR**2
        m_fn = m_s + (lam - 1.0) * np.sqrt(v_sh / 2)
        v_fn = np.minimum(v_s, v_ind) + lam * lam * v_sh
        d_s = np.clip(2 * m_fn * m_fn / np.maximum(v_fn, 1e-300), 1.0, n // length)
        slice_limits[ax] = np.maximum(lim, m_fn * sps.f.isf(p_slice, d_s, k * d_s))
        # fn's typical slice level (leaf_statistics): the replicas' own median over slices of T_kS / mean T_S
        # (axes of at least SLICE_LEVEL_MIN slices with rounding: a median of fewer would follow a bug)
        live = m_s > 0
        if int(np.sum(live)) >= SLICE_LEVEL_MIN:
            lm = float(np.median(np.median(t_rep[:, live] / m_s[live], axis=1)))
            if lm > 0:  # 0 where most slices round in only a few replicas (exact sums): no level to measure
                slice_means[ax], slice_level_median[ax] = m_s, lm
    return LeafNull(v=v, v0=v0, gg=gg, den=den, den_full=den_full, dof=dof, norm_limit=norm_limit, beta_spread=beta_spread, beta_q=q,
                    rho_median=rho_median,
                    beta_t=float(sps.t.isf(a4 / 2, k)), entry_limit=math.sqrt(float(sps.f.isf(a4 / n, 1, k))),
                    slice_limits=slice_limits, slice_means=slice_means, slice_level_median=slice_level_median,
                    kink_spread=kink_spread)


def leaf_statistics(e: np.ndarray, replicas: np.ndarray, g_ref: np.ndarray, precision: str,
                    kink: np.ndarray | None = None, alpha: float = FALSE_ALARM_RATE,
                    factor: float = IMPLEMENTATION_FACTOR, null: LeafNull | None = None) -> LeafStatistics:
    """Judge one leaf's error ``e`` (shape S) against ``replicas`` (shape [K, *S]) of the modelled rounding error.

    Args:
      e: ``g - g*`` of the run under test, float64.
      replicas: ``r_k``, K rounding-error samples of the reference at ``precision``.
      g_ref: the float64 oracle ``g*``.
      precision: the hypothesis (sets the bias floor).
      kink: the absolute jump of entries fed by uncertain comparisons, or None.
      null: :func:`leaf_null` of the same replicas, oracle, precision, kink, alpha and factor, to judge several
        errors against one leaf's model without recomputing it (the replica-only part is most of the cost).
    """
    e = np.asarray(e, np.float64)
    r = np.asarray(replicas, np.float64)
    g = np.asarray(g_ref, np.float64)
    k = r.shape[0]
    if k < 8:
        raise ValueError(f"leaf_statistics: need at least 8 replicas (the slice test uses F(1, K) moments), got {k}")
    n = max(e.size, 1)
    a4 = alpha / 4
    if not np.all(np.isfinite(e)):
        bad = tuple(int(i) for i in np.unravel_index(int(np.argmax(~np.isfinite(e))), e.shape)) if e.size else ()
        return LeafStatistics(n, k, alpha, math.inf, math.inf, 0.0, 0.0, math.nan, math.inf, 0.0, math.inf, 0.0,
                              bad, math.inf, "non-finite entries", ("norm", "entry"))
    if not np.all(np.isfinite(r)):
        # the hypothesis itself overflows here (f16's range ends at 65504): it cannot be the precision fn runs in
        return LeafStatistics(n, k, alpha, math.inf, math.inf, 0.0, 0.0, math.nan, math.inf, 0.0, math.inf, 0.0,
                              (), math.inf, f"the reference at {precision} (it overflows: non-finite values)",
                              ("slice",))
    nl = null if null is not None else leaf_null(r, g, precision, kink, alpha, factor)
    v, gg = nl.v, nl.gg
    ratio = e * e / v
    # rho from the error orthogonal to g* (a scale bug must not inflate the spread that judges it), by the median (a
    # bug confined to a few entries must not either) and against the rounding without kink jumps (a worst-case jump
    # says nothing of how much fn rounds)
    e_orth = e - (float(np.vdot(e.ravel(), g.ravel())) / gg) * g if gg > 0 else e
    if kink is not None and gg > 0:  # behind kinks the plain projection follows the flips: use the gated estimate
        beta0 = _gated_scale(e.ravel(), g.ravel(), nl.v0.ravel(), np.asarray(kink, np.float64).ravel(), nl.beta_q,
                             1.0)[0]
        e_orth = e - beta0 * g
    rho = math.sqrt(float(np.median(e_orth * e_orth / nl.v0)) / nl.rho_median) if e.size else 0.0
    rho_s = min(max(1.0, rho), factor)  # the model allows fn up to `factor` times the rounding, never less than 1x

    # 1. normwise, orthogonal to g* (e shrunk by the kink jumps like the replicas: leaf_null)
    e_n = e if kink is None else _shrink(e, kink)
    e_perp = _perp(e_n.ravel(), g.ravel(), gg)
    num = float(np.vdot(e_perp, e_perp))
    norm_ratio = math.sqrt(num / nl.den) if nl.den > 0 else (0.0 if num == 0 else math.inf)
    num_full = float(np.vdot(e_n, e_n))
    flip_free = math.sqrt(num_full / nl.den_full) if nl.den_full > 0 else (0.0 if num_full == 0 else math.inf)

    # 2. scale / sign bias
    if gg > 0:
        gf = g.ravel()
        kf = None if kink is None else np.asarray(kink, np.float64).ravel()
        # behind kinks the gating may settle in two self-consistent ways: a few flips of one sign on heavily weighted
        # entries absorbed into beta (they then look like a scale error and are not gated), or gated as flips with
        # beta near 0. The test takes the more charitable of the two starts (the ungated estimate, beta = 0): a
        # scale error consistent across the leaf reaches the same fixed point from either. (CPU false-alarm sweep,
        # one run: three flips of -0.3 on entries with K ~ 6 gave beta = -1.4% against a limit of 1.2%
        # from the first start, ~0 from the second.)
        candidates = []
        for from_zero in ((False, True) if kf is not None and np.any(kf > 0) else (False,)):
            b_c, w, vf = _gated_scale(e.ravel(), gf, nl.v0.ravel(), kf, nl.beta_q, rho_s, from_zero=from_zero)
            gw = float(gf @ w)  # 0 where the leaf tells no scale (_gated_scale): the scale test is then vacuous
            independent = float(np.sqrt(np.sum(w * w * vf))) / gw if gw > 0 else math.inf  # e's gated entries
            sigma_c = rho_s * max(nl.beta_spread, independent)
            limit_c = max(nl.beta_t * sigma_c, bias_floor(precision))
            candidates.append((abs(b_c) / limit_c, b_c, sigma_c, limit_c))
        _, beta, beta_sigma, beta_limit = min(candidates, key=lambda c: c[0])
    else:
        beta, beta_sigma, beta_limit = 0.0, 0.0, math.inf

    # 3. entries
    # fn's extra rounding scales the rounding part of an entry's variance, not its kink jump (a worst case already)
    z2 = ratio / (rho_s * rho_s) if kink is None else e * e / (rho_s * rho_s * nl.v0 + (v - nl.v0))
    worst = int(np.argmax(z2)) if e.size else 0
    entry_z = math.sqrt(float(z2.ravel()[worst])) if e.size else 0.0
    entry_index = tuple(int(i) for i in np.unravel_index(worst, e.shape)) if e.size else ()

    # 4. slices along every axis, each against its limit from the replicas (leaf_null)
    slice_ratio, slice_where = 0.0, "none (a leaf of fewer than two axes)"
    for ax, lim in nl.slice_limits.items():
        length = e.shape[ax]
        t = np.sum(np.moveaxis(z2, ax, 0).reshape(length, -1), axis=1)
        if ax in nl.slice_means:  # fn's typical slice level along this axis, robustly (module doc, test 4)
            m_s = nl.slice_means[ax]
            level = float(np.median(t[m_s > 0] / m_s[m_s > 0])) / nl.slice_level_median[ax]
            lim = lim * min(max(1.0, level), factor * factor / (rho_s * rho_s))
        ratio_s = t / lim
        j = int(np.argmax(ratio_s))
        if ratio_s[j] > slice_ratio:
            slice_ratio, slice_where = float(ratio_s[j]), f"axis {ax} index {j} of {length}"
    norm_limit, dof, entry_limit, kink_spread = nl.norm_limit, nl.dof, nl.entry_limit, nl.kink_spread

    failed = tuple(name for name, bad in (
        ("norm", norm_ratio > norm_limit), ("scale", abs(beta) > beta_limit), ("entry", entry_z > entry_limit),
        ("slice", slice_ratio > 1.0)) if bad)
    return LeafStatistics(n=int(e.size), replicas=k, alpha=alpha, rho=rho, norm_ratio=norm_ratio,
                          norm_limit=norm_limit, dof=dof, beta=beta, beta_sigma=beta_sigma, beta_limit=beta_limit,
                          entry_z=entry_z, entry_limit=entry_limit, entry_index=entry_index,
                          slice_ratio=slice_ratio, slice_where=slice_where, failed=failed, kink_spread=kink_spread,
                          flip_free_ratio=flip_free)
