"""False alarms of ``check_vjp`` on correct low-precision VJPs, randomised.

    python -m jaxgrad.bench verify_false_alarms --mode cpu --n 500 --jobs 8  # TF32/f16/bf16 emulated on the CPU
    python -m jaxgrad.bench verify_false_alarms --mode gpu --n 100           # the GPU's own TF32 / bf16 rounding
    python -m jaxgrad.bench verify_false_alarms --mode cpu --n 6 --no-write  # a smoke run (what CI runs)
    python -m jaxgrad.bench verify_false_alarms --mode mixed --n 200         # backward coarser than forward

Each run draws an op (dense, conv+ReLU, softmax attention, a dense whose weight gradient sums up to 10^6 terms:
``jaxgrad.verify.calibration``), a planted-leaf size (64 .. 16384 entries), white-noise inputs, sometimes scaled by
1e3 with an offset (heavy cancellation in the gradients), and a precision. ``cpu`` mode judges the correct
hand-written kernel at that precision (operands rounded with ``reduce_precision``, f32 accumulation; f16 is stated
with ``precision="f16"``, bf16 also with bf16 arrays); ``gpu`` mode judges the reference itself as the GPU runs it
(XLA's default TF32 dots and cuDNN convs for f32 arrays, bf16 arrays in bf16) and the package's conv2d backends.
Every run is ``check_vjp(fn, reference, ..., float64=False)`` (the situation of a kernel with no float64 re-run),
precision selection and both gates included. A BUG verdict on a correct VJP is a false alarm; an UNDETERMINED verdict
(the inputs do not determine the function at that precision: a softmax on logits of size 1/u, say) is neither a pass
nor a false alarm, and is counted apart.

``mixed`` mode draws correct VJPs whose backward rounds differently from their forward
(``jaxgrad.verify.calibration.make_mixed_case``: an XLA dot or a conv -- cuDNN on a GPU -- with the forward at f32 /
TF32 / bf16 and the backward at bf16 / TF32 / f16, f32 arrays, ``MIXED_PAIRS``), natively on a GPU (TF32 is the
GPU's own; on a CPU it is emulated). Half the runs plant a scale error in one gradient at the documented target for
the coarser of the two precisions (1% at bf16, 0.2% at TF32 / f16): each must be caught on that gradient
(``--planted-share`` sets the share).

Writes ``<out>/verify-false-alarms-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.{json,txt}`` (UTC; precision
``emulated`` for ``--mode cpu``, ``hardware`` for ``gpu``, ``mixed`` for ``mixed``) unless ``--no-write``;
``--out`` defaults to ``runs/bench`` under the current directory (git-ignored in a checkout, so a run never changes
the repository; ``--out benchmarks/results`` adds the result to the committed ones).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np

OPS = ("dense", "conv_relu", "attention", "long_sum")
# jaxgrad.bench.harness.DEFAULT_RESULTS_DIR (git-ignored); spelled out, since importing it imports jax before cpu mode
# sets JAX_PLATFORMS
DEFAULT_OUT = "runs/bench"


#: the word a sweep's result file is named by, per --mode (the sweeps range over precisions)
MODE_PRECISION = {"cpu": "emulated", "gpu": "hardware", "mixed": "mixed"}
PLANTED_TARGET = {"bf16": 0.01, "f16": 0.002, "tf32": 0.002, "f32": 1e-5}


def draw(i: int, seed: int, mode: str, planted_share: float = 0.5) -> dict:
    rng = np.random.default_rng([seed, i])
    if mode == "mixed":
        from jaxgrad.verify.calibration import MIXED_PAIRS
        from jaxgrad.verify.program_precision import coarser

        fw, bw = MIXED_PAIRS[int(rng.integers(len(MIXED_PAIRS)))]
        planted = PLANTED_TARGET[coarser(fw, bw)] if rng.random() < planted_share else 0.0
        return {"i": i, "op": ["dense", "conv"][int(rng.integers(2))], "size": int(2 ** rng.uniform(6, 14)),
                "precision": f"{fw}>{bw}", "cancel": False, "planted": planted, "leaf": int(rng.integers(2)),
                "seed": int(rng.integers(2**31))}
    op = OPS[int(rng.integers(len(OPS)))]
    size = int(2 ** rng.uniform(6, 14))
    if op == "long_sum":
        size = int(10 ** rng.uniform(3, 6))
    if mode == "cpu":
        precision = ["tf32", "f16", "bf16", "bf16-arrays"][int(rng.integers(4))]
    else:
        precision = ["tf32", "bf16-arrays", "conv2d-xla", "conv2d-pallas"][int(rng.integers(4))]
    return {"i": i, "op": op, "size": size, "precision": precision, "cancel": bool(rng.random() < 0.25),
            "seed": int(rng.integers(2**31))}


def run_one(cfg: dict, mode: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxgrad.verify import check_vjp
    from jaxgrad.verify.calibration import make_case

    rng = np.random.default_rng(cfg["seed"])
    prec = cfg["precision"]
    if mode == "mixed":
        from jaxgrad.verify.calibration import make_mixed_case

        fw, bw = prec.split(">")
        case = make_mixed_case(cfg["op"], fw, bw, cfg["size"], rng, emulate=jax.default_backend() == "cpu",
                               planted=cfg["planted"], leaf=cfg["leaf"])
        t0 = time.time()
        rep = check_vjp(case.fn, case.reference, *case.args, float64=False, fd=False, adjoint=False,
                        structural=False, seed=cfg["seed"] % 1000)
        failed = [i for i, lf in enumerate(rep.leaves) if not lf.passed and not lf.undetermined]
        out = dict(cfg, passed=bool(rep.passed), undetermined=bool(rep.undetermined),
                   judged_as=rep.precision.precision, leaf_runs=[lf.run for lf in rep.leaves],
                   caught=bool(cfg["planted"]) and failed == [cfg["leaf"]] and not rep.passed,
                   seconds=round(time.time() - t0, 2), entries=[int(np.prod(lf.shape)) for lf in rep.leaves],
                   platform=jax.default_backend())
        if not rep.passed and not cfg["planted"]:
            out["report"] = str(rep)
        return out
    arrays = jnp.bfloat16 if prec == "bf16-arrays" else jnp.float32
    kernel_precision = {"bf16-arrays": "bf16"}.get(prec, prec)
    op, size = cfg["op"], cfg["size"]
    if prec.startswith("conv2d"):
        op = cfg["op"] = "conv_relu"
    case = make_case(op, size, "f32" if mode == "gpu" or prec.startswith("conv2d") else kernel_precision, rng,
                     arrays)
    args = case.args
    if cfg["cancel"]:  # large values around an offset: the gradients become heavily cancelling sums
        args = tuple(jnp.asarray((np.asarray(a, np.float64) + 3.0) * 1e3 if j == 0 else a, arrays)
                     for j, a in enumerate(args))
    fn, stated = case.fn, ("f16" if prec == "f16" else None)
    if mode == "gpu":
        # XLA's own GPU lowering at the default precision: TF32 dots/convs for f32 arrays, bf16 arrays in bf16
        fn = case.native
        if prec.startswith("conv2d"):
            from jaxgrad.cnn.conv import conv2d

            backend = prec.split("-")[1]
            fn = lambda x, w, b: conv2d(x, w, b, padding="SAME", activation="relu", backend=backend)  # noqa: E731
    t0 = time.time()
    rep = check_vjp(fn, case.reference, *args, float64=False, fd=False, adjoint=False, structural=False,
                    precision=stated, seed=cfg["seed"] % 1000)
    out = dict(cfg, op=op, passed=bool(rep.passed), undetermined=bool(rep.undetermined),
               judged_as=rep.precision.precision,
               seconds=round(time.time() - t0, 2), entries=[int(np.prod(lf.shape)) for lf in rep.leaves],
               kinks=any("kinks:" in n for n in rep.notes), platform=jax.default_backend())
    if not rep.passed:
        out["report"] = str(rep)
    return out


def _worker(args):
    cfg, mode = args
    try:
        return run_one(cfg, mode)
    except Exception as e:  # a crash is reported, not a pass
        return dict(cfg, passed=False, error=f"{type(e).__name__}: {e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgrad.bench verify_false_alarms",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["cpu", "gpu", "mixed"], default="cpu")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (cpu mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop taking results after this many seconds and write those that finished (the header "
                         "says how many of --n ran)")
    ap.add_argument("--planted-share", type=float, default=0.5,
                    help="mixed mode: the share of runs with a planted error (default %(default)s)")
    ap.add_argument("--indices", nargs="+", type=int, default=None,
                    help="replay only these runs of --seed's draws (e.g. a false alarm, after a fix)")
    a = ap.parse_args(argv)
    if a.mode == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not 0.0 <= a.planted_share <= 1.0:
        ap.error(f"--planted-share must lie in [0, 1], got {a.planted_share}")
    cfgs = [draw(i, a.seed, a.mode, a.planted_share) for i in (range(a.n) if a.indices is None else a.indices)]
    if a.indices is not None:
        a.n = len(cfgs)
    t0 = time.time()
    results = []

    def show(r):  # printed as each run finishes, so a run cut short still shows what it judged
        results.append(r)
        if r.get("planted"):
            verdict = "caught" if r.get("caught") else "MISSED" if r["passed"] else "failed elsewhere"
            what = f"planted {r['planted']:g} on leaf {r['leaf']}"
        else:
            verdict = "pass" if r["passed"] else "undetermined" if r.get("undetermined") else "FALSE ALARM"
            what = f"cancel {int(r['cancel'])}"
        print(f"{r['i']:4d} {r['op']:10s} {r['precision']:13s} size {r['size']:8d} {what} -> {verdict} as "
              f"{r.get('judged_as')}{' ' + '/'.join(r['leaf_runs']) if 'leaf_runs' in r else ''} "
              f"({r.get('seconds')} s)" + (f" {r['error']}" if "error" in r else ""), flush=True)

    if a.jobs > 1:
        ex = cf.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn"))
        futs = [ex.submit(_worker, (c, a.mode)) for c in cfgs]
        try:
            for fut in cf.as_completed(futs, timeout=a.budget_s):
                show(fut.result())
        except cf.TimeoutError:
            print(f"budget of {a.budget_s} s spent: {len(results)} of {a.n} runs finished", flush=True)
        ex.shutdown(wait=False, cancel_futures=True)
    else:
        for c in cfgs:
            if a.budget_s is not None and time.time() - t0 > a.budget_s:
                print(f"budget of {a.budget_s} s spent: {len(results)} of {a.n} runs finished", flush=True)
                break
            show(_worker((c, a.mode)))
    results.sort(key=lambda r: r["i"])
    planted = [r for r in results if r.get("planted")]
    results_all, results = results, [r for r in results if not r.get("planted")]
    fails = [r for r in results if not r["passed"] and not r.get("undetermined")]
    undetermined = [r for r in results if r.get("undetermined")]
    n = len(results)
    # one-sided 95% upper bound on the false-alarm rate after k alarms in n runs (exact for k = 0: 1 - 0.05^(1/n))
    upper = 1 - 0.05 ** (1 / n) if not fails and n else None
    summary = {"mode": a.mode, "runs": n, "runs_asked": a.n, "false_alarms": len(fails),
               "undetermined": len(undetermined),
               "seconds": round(time.time() - t0, 1), "rate_upper_95": upper}
    print(f"{len(fails)} false alarms in {n} correct low-precision VJPs ({len(undetermined)} undetermined)"
          + (f"; false-alarm rate per run < {upper:.2%} (95% confidence)" if upper is not None else ""))
    if planted:
        summary.update(planted_runs=len(planted), planted_caught=sum(bool(r.get("caught")) for r in planted))
        print(f"planted errors caught on their gradient: {summary['planted_caught']} of {len(planted)}")
    if not a.no_write:
        from jaxgrad.bench.harness import _jsonable, environment, result_stem
        from jaxgrad.verify.stats import FALSE_ALARM_RATE

        env = environment()
        summary["model_false_alarm_rate_per_leaf"] = FALSE_ALARM_RATE
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / result_stem("verify-false-alarms", env, MODE_PRECISION[a.mode])
        stem.with_suffix(".json").write_text(json.dumps(_jsonable({"environment": env, "summary": summary,
                                                                    "runs": results_all}), indent=1) + "\n")
        by = {}
        for r in results:
            key = (r["op"], r["precision"])
            by.setdefault(key, [0, 0, 0])
            by[key][0] += 1
            by[key][1] += not r["passed"] and not r.get("undetermined")
            by[key][2] += bool(r.get("undetermined"))
        lines = [f"# device: {env['device_kind']} ({env['platform']}), {env['datetime_utc']}; jax {env['jax']}, "
                 f"python {env['python']}",
                 f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}",
                 f"# mode {a.mode}: {n} correct low-precision VJPs (of {a.n} asked) judged by "
                 f"check_vjp(float64=False); model "
                 f"false-alarm rate {FALSE_ALARM_RATE:g} per leaf",
                 f"{'op':10s} {'precision':13s} {'runs':>5s} {'false alarms':>12s} {'undetermined':>12s}"]
        lines += [f"{op:10s} {p:13s} {c[0]:5d} {c[1]:12d} {c[2]:12d}" for (op, p), c in sorted(by.items())]
        if planted:
            lines.append(f"# planted scale errors (1% where bf16 is the coarser precision, 0.2% for TF32 / f16), "
                         f"caught on their gradient: {summary['planted_caught']} of {len(planted)}")
            pby = {}
            for r in planted:
                c = pby.setdefault((r["op"], r["precision"]), [0, 0])
                c[0] += 1
                c[1] += bool(r.get("caught"))
            lines += [f"{op:10s} {p:13s} {c[0]:5d} planted {c[1]:5d} caught" for (op, p), c in sorted(pby.items())]
        lines.append(f"# total: {len(fails)} false alarms in {n} runs ({len(undetermined)} undetermined: the inputs do "
                     "not determine the function at that precision; neither pass nor false alarm)"
                     + (f"; per-run false-alarm rate < {upper:.2%} at 95% confidence" if upper is not None else ""))
        stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(f"wrote {stem.with_suffix('.txt')}")
    return 0 if not fails and all(r.get("caught") for r in planted) else 1


if __name__ == "__main__":
    sys.exit(main())
