"""``jaxgrad`` command line.

    jaxgrad demo                  # the main job: audit, fit a KAN, train the denoiser, write jaxgrad-demo/index.html
    jaxgrad demo --quick --out DIR [--overwrite]   # tiny sizes (tests), another report folder
    jaxgrad audit                 # audit every op of the package (check_vjp at 3 sizes + one optimizer step)
    jaxgrad audit --op swiglu     # only ops whose name contains "swiglu"
    jaxgrad audit --planted       # show the verifier catching the planted-bug catalogue (and passing the correct VJPs)
    jaxgrad audit --json out.json # also write the reports as JSON
    jaxgrad audit -v              # print the full check_vjp table of every size
    jaxgrad train kan configs/kan.toml --out runs/kan [--set train.steps=100] [--resume | --overwrite]
    jaxgrad train cnn configs/cnn.toml --out runs/cnn
    jaxgrad bench kan [--sizes small]   # a benchmark suite (scripts/bench.py's options)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def _audit_error(message: str) -> int:
    print(f"jaxgrad audit: error: {message}", file=sys.stderr)
    return 2


def _json_path_problem(path: str) -> str | None:
    """Why ``--json path`` cannot be written (checked before the audit runs), or None: the file must not be a
    directory and its nearest existing ancestor must be a directory (missing folders are created)."""
    p = pathlib.Path(path)
    if p.is_dir():
        return f"--json {path}: is a directory; expected a file name"
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"--json {path}: {parent} exists and is not a directory"
            return None
    return None


def _audit_ops(args) -> int:
    from jaxgrad.ops.registry import all_audit_cases
    from jaxgrad.verify import audit

    every = all_audit_cases()
    cases = [c for c in every if not args.op or any(o in c.name for o in args.op)]
    if not cases:
        return _audit_error(f"no op matches {', '.join(repr(o) for o in args.op)} (--op matches part of a name; the "
                            f"ops: {', '.join(c.name for c in every)})")
    if args.json and (problem := _json_path_problem(args.json)):
        return _audit_error(problem)
    results, summary = [], []
    for case in cases:
        t0 = time.perf_counter()
        rep = audit(case.fn, case.reference, case.make_args, case.sizes, name=case.name, seed=args.seed,
                    arg_names=case.arg_names)
        dt = time.perf_counter() - t0
        print(rep)
        if args.verbose:
            for r in rep.reports:
                print(r)
        print()
        results.append(rep)
        worst = max(lf.normalized_err / lf.bound for r in rep.reports for lf in r.leaves)
        summary.append((case.name, rep.passed, worst, dt))
    print("summary (worst error as a fraction of its rounding bound; < 1 passes):")
    for name, ok, worst, dt in summary:
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<24} worst {worst:8.3f} of bound   ({dt:5.1f} s)")
    if args.json:
        data = json.dumps([{"name": r.name, "passed": r.passed, "sizes": [str(s) for s in r.sizes],
                            "reports": [x.to_dict() for x in r.reports]} for r in results], default=str, indent=1)
        try:
            pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.json).write_text(data)
        except OSError as err:
            return _audit_error(f"--json {args.json}: cannot be written ({err.strerror})")
    return 0 if all(ok for _, ok, _, _ in summary) else 1


def _audit_planted(args) -> int:
    import jax

    from jaxgrad.verify import check_vjp
    from jaxgrad.verify.planted import all_cases

    if args.json:
        return _audit_error("--json writes the op audit's reports; --planted has none (drop one of them)")
    every = all_cases()
    if args.op and not any(o in c.name for c in every for o in args.op):
        return _audit_error(f"no planted case matches {', '.join(repr(o) for o in args.op)} (--op matches part of "
                            f"a name, e.g. {', '.join(c.name for c in every[:4])}, ...)")
    rows, wrong = [], 0
    for case in every:
        if args.op and not any(o in case.name for o in args.op):
            continue
        dtype = case.dtype if hasattr(case, "dtype") else None
        fn_args = case.make_args(jax.random.key(args.seed), dtype or jax.numpy.float32)
        rep = check_vjp(case.fn, case.reference, *fn_args, seed=args.seed, name=case.name, arg_names=case.arg_names)
        caught = not rep.passed
        ok = caught == case.buggy
        wrong += not ok
        kinds = sorted({lf.diagnosis_kind or "-" for lf in rep.failures}) if caught else []
        rows.append((case.name, "bug" if case.buggy else "correct", "FAIL" if caught else "PASS",
                     ",".join(kinds) or "-", "ok" if ok else "WRONG"))
        if args.verbose:
            print(rep, "\n")
    widths = [max(len(r[i]) for r in rows + [("case", "planted", "verifier", "diagnosis", "")]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format("case", "planted", "verifier", "diagnosis", ""))
    for r in rows:
        print(fmt.format(*r))
    print(f"{len(rows) - wrong}/{len(rows)} classified correctly")
    return 0 if wrong == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxgrad", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job in a few minutes: audit the gradients, fit a KAN, train the "
                                     "denoiser, write a report folder")
    p.add_argument("--quick", action="store_true", help="tiny sizes (about a minute; for tests)")
    p.add_argument("--out", default="jaxgrad-demo", metavar="DIR", help="report folder (default: jaxgrad-demo)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR (replaces only a previous "
                                                            "demo report's files)")
    p = sub.add_parser("audit", help="verify the backward pass of jaxgrad's ops (or the planted-bug catalogue)")
    p.add_argument("--op", action="append", help="only cases whose name contains this (repeatable)")
    p.add_argument("--planted", action="store_true", help="run the planted-bug catalogue instead of the ops")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the reports to this JSON file")
    p.add_argument("-v", "--verbose", action="store_true", help="print every check_vjp table")
    p = sub.add_parser("train", help="train a family with the jaxgrad.train engine from a TOML config")
    p.add_argument("family", choices=_families(), help="model family")
    p.add_argument("config", nargs="?", help="TOML config file (sections [train], [model], [data])")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set train.lr=1e-3 (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR from its latest good checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start again in a non-empty DIR (replaces only the "
                                                            "run's own files)")
    p.add_argument("--no-progress", action="store_true", help="print lines instead of a progress bar")
    p = sub.add_parser("bench", help="run a benchmark suite (scripts/bench.py)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="SUITE [--sizes small|full] [--out DIR] ...")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxgrad.demo import run_demo

        return run_demo(args.out, quick=args.quick, overwrite=args.overwrite)
    if args.command == "audit":
        return _audit_planted(args) if args.planted else _audit_ops(args)
    if args.command == "train":
        from jaxgrad.train.cli_train import run

        return run(args.family, args.config, args.set, args.out, resume=args.resume, overwrite=args.overwrite,
                   progress=not args.no_progress)
    if args.command == "bench":
        return _bench(args.bench_args)
    return 2


def _families() -> list[str]:
    from jaxgrad.train.families import FAMILIES

    return list(FAMILIES)


def _bench(bench_args: list[str]) -> int:
    """Delegate to ``scripts/bench.py`` (its options, its output format) from a checkout."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
    if not path.is_file():
        print(f"jaxgrad bench: {path} not found (the benchmark suites live in a source checkout)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("jaxgrad_bench_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return int(mod.main(bench_args) or 0)


if __name__ == "__main__":
    sys.exit(main())
