"""Detection limits of the statistical verdict: the smallest systematic scale error caught in every trial.

    python -m jaxgrad.bench verify_detection_limits                      # the full CPU table (TF32/f16/bf16 emulated)
    python -m jaxgrad.bench verify_detection_limits --quick              # a small table (what CI runs)
    python -m jaxgrad.bench verify_detection_limits --ops dense --precisions bf16 --sizes 64 1024 --trials 20

For each op (dense, conv+ReLU, softmax attention: ``jaxgrad.verify.calibration``), precision and leaf size, and
each of ``--trials`` random problems: a correct kernel at that precision is run, its planted leaf's error against
the float64 oracle and K rounding samples of the reference are taken (``leaf_errors``), and the leaf is judged by
``leaf_statistics`` with planted scale errors ``(1 + s) g`` for every ``s`` of ``--scales``, and with an error
confined to the last 1% of the entries (10 modelled standard deviations each, kink jumps included). "Caught" means
caught in every trial. Each row also gives the floor the kernel's own rounding puts under *any* scale test at the
same false-alarm rate (``ideal_limit``: the Cramer-Rao spread of the best unbiased scale estimate, known exactly,
caught in all trials with probability 0.95), so a limit above a target can be told apart from a weak test. The
correct kernel (``s = 0``) must pass in every trial: its failures are false alarms.

Writes ``<out>/verify-detection-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.{json,txt}`` (UTC; precision ``emulated``,
or ``hardware`` with ``--hardware``; header: device, versions, commit, command line) unless ``--no-write``;
``--out`` defaults to ``runs/bench`` under the current directory (git-ignored in a checkout, so a run never changes
the repository; ``--out benchmarks/results`` adds the result to the committed ones).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.bench.harness import DEFAULT_RESULTS_DIR, _jsonable, environment, result_stem
from jaxgrad.verify.calibration import OPS, leaf_errors, make_case
from jaxgrad.verify.stats import FALSE_ALARM_RATE, leaf_null, leaf_statistics, replicas_for

SCALES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3)
SIZES = (64, 1024, 16384, 262144, 1_000_000)
MAX_SIZE = {"attention": 65536}  # 1e6 entries of dQ means a 8192 x 8192 score matrix per replica: too slow on CPU


def judge(err, s_values, precision, rng, lowest=0):
    """(caught per scale, the correct leaf's statistics, confined caught) for one trial.

    Scales are tried from the largest down and stop at the first one missed, and at index ``lowest`` (a scale an
    earlier trial missed): the limit is the smallest scale above which every scale is caught in every trial, so the
    smaller ones cannot change it (they are returned as not caught)."""
    e0, g = err.error, err.gradient
    null = leaf_null(err.replicas, err.oracle, precision, err.kink)  # the replica-only part, once per trial

    def judged(e):
        return leaf_statistics(e, err.replicas, err.oracle, precision, err.kink, null=null)

    base = judged(e0)
    # Cramer-Rao: with independent Gaussian entries of variance v_i, no unbiased estimate of s in e = e0 + s g*
    # has a spread below 1 / sqrt(sum g*_i^2 / v_i): the floor that this kernel's rounding puts under any scale test
    # (v without the worst-case kink jumps: the rounding itself; the flips the replicas take add to it)
    go = np.asarray(err.oracle, np.float64).reshape(-1)
    sigma_cr = 1.0 / math.sqrt(float(np.sum(go * go / null.v0.reshape(-1))))
    caught = [False] * len(s_values)
    for i in range(len(s_values) - 1, lowest - 1, -1):
        caught[i] = not judged(e0 + s_values[i] * g).passed
        if not caught[i]:
            break
    # an error confined to the last 1% of the entries (a ragged last block / border), 10 modelled sigma each
    flat = e0.reshape(-1).copy()
    n_bad = max(1, flat.size // 100)
    v = null.v.reshape(-1)
    sign = np.sign(rng.standard_normal(n_bad))
    flat[-n_bad:] += 10.0 * np.sqrt(v[-n_bad:]) * sign
    confined = not judged(flat.reshape(e0.shape)).passed
    return caught, base, confined, sigma_cr


def _group(job) -> dict:
    """All trials of one (op, precision, size)."""
    (op, precision, size), a = job
    t0 = time.time()
    caught_all = np.ones(len(a.scales), bool)
    false_alarms, confined, entries, kinks, undetermined = 0, 0, 0, 0, 0
    sigmas = []  # per trial: (the scale test's sigma_beta, the Cramer-Rao spread)
    for trial in range(a.trials):
        rng = np.random.default_rng([a.seed, trial, size, OPS.index(op)])
        if a.hardware:  # the reference as the GPU runs it: TF32 dots/convs for f32 arrays, bf16 arrays in bf16
            case = make_case(op, size, "f32", rng, jnp.bfloat16 if precision == "bf16" else jnp.float32)
            case = dataclasses.replace(case, fn=case.native)
        else:
            case = make_case(op, size, precision, rng)
        k = a.replicas or case_replicas(case)
        err = leaf_errors(case, precision, k, rng)
        missed = [i for i, c in enumerate(caught_all) if not c]
        caught, base, conf, sigma_cr = judge(err, a.scales, precision, rng, lowest=(max(missed) + 1) if missed else 0)
        sigmas.append((base.beta_sigma, sigma_cr))
        undetermined += base.undetermined
        caught_all &= np.asarray(caught)
        false_alarms += not base.passed
        confined += conf
        entries = err.error.size
        kinks += err.kink is not None
    limit = next((s for i, s in enumerate(a.scales) if caught_all[i:].all()), None)
    sig_beta, sig_cr = np.median(np.asarray(sigmas), axis=0)
    return {"op": op, "precision": precision, "size": size, "entries": entries, "trials": a.trials, "kinks": kinks > 0,
            "hardware": bool(a.hardware), "replicas": k,
            "smallest_scale_caught_in_all": limit,
            "caught_in_all": {str(s): bool(c) for s, c in zip(a.scales, caught_all)},
            "false_alarms": false_alarms, "confined_1pct_10sigma_caught": confined, "undetermined": undetermined,
            "sigma_beta_median": float(sig_beta), "sigma_cramer_rao_median": float(sig_cr),
            "ideal_limit": ideal_limit(float(sig_cr), a.trials),
            "seconds": round(time.time() - t0, 1)}


REPLICAS_RULE = "16 (32 where every leaf has <= 4096 entries)"


def case_replicas(case) -> int:
    """K as check_vjp takes it by default: from the largest leaf of the case's arguments and outputs."""
    outs = jax.tree.leaves(jax.eval_shape(case.fn, *case.args))
    return replicas_for(max(int(np.prod(x.shape)) for x in [*case.args, *outs]))


def ideal_limit(sigma: float, trials: int, alpha: float = FALSE_ALARM_RATE / 4) -> float:
    """The scale error that a test *knowing* the rounding spread ``sigma`` of the best unbiased scale estimate
    catches in all ``trials`` with probability 0.95, at the scale test's two-sided false-alarm rate ``alpha``:
    ``(z_{1-alpha/2} + z_{1-0.05/trials}) sigma``. Below it no scale test at that rate can meet "caught in every
    trial" on this kernel's rounding (under the verifier's model: independent Gaussian entries)."""
    from scipy import stats as sps

    return float((sps.norm.isf(alpha / 2) + sps.norm.isf(0.05 / trials)) * sigma)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgrad.bench verify_detection_limits",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", default=["dense", "conv_relu", "attention"], choices=OPS)
    ap.add_argument("--precisions", nargs="+", default=["f32", "tf32", "f16", "bf16"])
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    ap.add_argument("--scales", nargs="+", type=float, default=list(SCALES))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=None,
                    help="K (default: check_vjp's, stats.replicas_for: 32 when every leaf has <= 4096 entries, "
                         "else 16)")
    ap.add_argument("--quick", action="store_true", help="sizes 64 and 1024, 4 trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_RESULTS_DIR,
                    help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes, one (op, precision, size) each")
    ap.add_argument("--cpu-max-attention", type=int, default=MAX_SIZE["attention"],
                    help="largest attention leaf run on the CPU (default %(default)s; 262144 takes ~5 s per trial, "
                         "10^6 minutes)")
    ap.add_argument("--hardware", action="store_true",
                    help="GPU spot check: the correct kernel is the reference at the GPU's default precision (tf32: "
                         "f32 arrays, TF32 dots/convs; bf16: bf16 arrays), its rounding the hardware's own")
    a = ap.parse_args(argv)
    if a.hardware:
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
        bad = [p for p in a.precisions if p not in ("tf32", "bf16")]
        if bad or os.environ["JAX_PLATFORMS"] == "cpu":
            ap.error(f"--hardware: needs a GPU (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r}) and --precisions "
                     f"from tf32, bf16 (got {a.precisions})")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # precisions are emulated: the CPU table is the reference one
    if a.quick:
        a.sizes, a.trials = [64, 1024], 4
    on_cpu = os.environ["JAX_PLATFORMS"] == "cpu"  # JAX_PLATFORMS=cuda runs the large leaves on a GPU
    groups = [(op, precision, size) for op in a.ops for precision in a.precisions for size in a.sizes
              if size <= {**MAX_SIZE, "attention": a.cpu_max_attention}.get(op, size) or not on_cpu]
    t_start = time.time()
    jobs = [(g, a) for g in groups]
    partial = pathlib.Path(a.out) / "verify-detection.partial.jsonl" if not a.no_write else None
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    rows = []

    def keep(row):  # rows are kept as they finish, so a run cut short still leaves its finished groups
        rows.append(row)
        if partial is not None:
            with partial.open("a") as f:
                f.write(json.dumps(_jsonable(row)) + "\n")

    if a.jobs > 1:
        with cf.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            for fut in cf.as_completed([ex.submit(_group, j) for j in jobs]):
                keep(fut.result())
    else:
        for j in jobs:
            keep(_group(j))
    order = {g: i for i, g in enumerate(groups)}
    rows.sort(key=lambda r: order.get((r["op"], r["precision"], r["size"]), 0))
    for row in rows:
        lim = row["smallest_scale_caught_in_all"]
        print(f"{row['op']:10s} {row['precision']:5s} {row['entries']:8d} entries: scale caught in all "
              f"{row['trials']} from {lim if lim is not None else '-'}; confined 1% @10 sigma "
              f"{row['confined_1pct_10sigma_caught']}/{row['trials']}; false alarms {row['false_alarms']}/"
              f"{row['trials']}{' (ReLU kinks)' if row['kinks'] else ''}"
              f"{'; undetermined %d/%d' % (row['undetermined'], row['trials']) if row.get('undetermined') else ''}; "
              f"ideal {row['ideal_limit']:.2g} (sigma_beta {row['sigma_beta_median']:.2g}, Cramer-Rao "
              f"{row['sigma_cramer_rao_median']:.2g}) [{row['seconds']} s]", flush=True)
    env = environment()
    total_fa = sum(r["false_alarms"] for r in rows)
    total_runs = sum(r["trials"] for r in rows)
    summary = {"false_alarms": total_fa, "correct_runs": total_runs, "model_false_alarm_rate_per_leaf":
               FALSE_ALARM_RATE, "replicas": a.replicas or REPLICAS_RULE, "seconds": round(time.time() - t_start, 1)}
    print(f"false alarms: {total_fa} in {total_runs} correct low-precision leaves (model rate {FALSE_ALARM_RATE:g} "
          "per leaf)")
    if not a.no_write:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / result_stem("verify-detection", env, "hardware" if a.hardware else "emulated")
        stem.with_suffix(".json").write_text(json.dumps(_jsonable({"environment": env, "summary": summary,
                                                                    "rows": rows}), indent=1) + "\n")
        lines = [f"# device: {env['device_kind']} ({env['platform']}), {env['datetime_utc']}; jax {env['jax']}, "
                 f"python {env['python']}",
                 f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}",
                 f"# computed on {'the CPU' if on_cpu else 'the GPU'} "
                 f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}, "
                 f"{a.jobs} worker processes; "
                 + ("HARDWARE rounding: the correct kernel is the reference at the GPU's default precision, TF32 "
                    "dots/convs for f32 arrays and bf16 arrays in bf16; only the replicas are emulated); "
                    if a.hardware else "emulated products at HIGHEST, so the GPU's own TF32 is not involved); ")
                 + f"K = {a.replicas or REPLICAS_RULE} replicas, model false-alarm rate {FALSE_ALARM_RATE:g} per "
                 "leaf; 'caught' = "
                 f"caught in all {a.trials} trials; precisions other than the platform's are emulated "
                 "(reduce_precision on operands, f32 accumulation)",
                 f"{'op':10s} {'prec':5s} {'entries':>8s} {'kinks':5s} {'limit':>8s} {'confined1%@10sd':>15s} "
                 f"{'false alarms':>12s} {'ideal':>8s} {'sigma_beta':>10s} {'sigma_CR':>9s}"]
        for r in rows:
            lim = r["smallest_scale_caught_in_all"]
            lines.append(f"{r['op']:10s} {r['precision']:5s} {r['entries']:8d} {'yes' if r['kinks'] else 'no':5s} "
                         f"{lim if lim is not None else '-':>8} {r['confined_1pct_10sigma_caught']:>7d}/"
                         f"{r['trials']:<7d} {r['false_alarms']:>5d}/{r['trials']:<6d} {r['ideal_limit']:8.2g} "
                         f"{r['sigma_beta_median']:10.2g} {r['sigma_cramer_rao_median']:9.2g}"
                         + (f"  (undetermined {r['undetermined']}/{r['trials']})" if r.get("undetermined") else ""))
        lines.append(f"# false alarms: {total_fa} in {total_runs}")
        stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(f"wrote {stem.with_suffix('.txt')}")
        if partial is not None:
            partial.unlink(missing_ok=True)  # the finished rows are in the files just written
    return 0


if __name__ == "__main__":
    sys.exit(main())
