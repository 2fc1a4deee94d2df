"""The jaxgrad command line.

    jaxgrad demo                  # the main job: audit, fit a KAN, train the denoiser, write jaxgrad-demo/index.html
    jaxgrad demo --quick --out DIR [--overwrite]   # tiny sizes (tests), another report folder
    jaxgrad audit                 # check the custom VJP of every op (the LoRA block included) against jax.grad of
                                  #   its reference, at 1-3 sizes, on each backend this machine runs (Pallas
                                  #   interpreted off a GPU; Mosaic GPU and cuDNN on a GPU only, else listed)
    jaxgrad audit --op swiglu     # only cases whose name contains "swiglu" (e.g. --op "[pallas]": one backend)
    jaxgrad audit --list          # the cases, their backends and sizes, and whether they run here
    jaxgrad audit --planted       # show the verifier catching the planted-bug catalogue (and passing the correct VJPs)
    jaxgrad audit --json out.json # also write the reports as JSON
    jaxgrad audit -v              # print the full check_vjp table of every size
    jaxgrad train kan configs/kan.toml --out runs/kan [--set train.steps=100] [--resume | --overwrite]
    jaxgrad train cnn configs/cnn.toml --out runs/cnn      (lora: configs/lora.toml)
    jaxgrad bench SUITE [--sizes small|full] ...           # a benchmark suite; jaxgrad bench --help for its options
    jaxgrad tokenizer DATA --vocab-size N --out DIR        # a byte-level BPE tokenizer trained on local files
    jaxgrad merge --base DIR --adapter DIR --out DIR       # adapter merged into its base (QLoRA: onto NF4), HF folder
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


def _audit_list(platform: str) -> int:
    """``--list``: every case, its backend, the sizes it runs at here (or why it does not run here)."""
    from jaxgrad.ops.registry import every_audit_case, run_mode, sizes_on

    rows = []
    for case in every_audit_case():
        mode, why = run_mode(case, platform)
        where = f"{mode}, sizes {', '.join(map(str, sizes_on(case, platform)))}" if mode else f"not run: {why}"
        rows.append((case.name, case.backend, where))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    print(f"audit cases on this machine ({platform}):")
    for name, backend, where in rows:
        print(f"  {name:<{width[0]}}  {backend:<{width[1]}}  {where}")
    return 0


def _audit_ops(args) -> int:
    import jax

    from jaxgrad.ops.registry import all_audit_cases, every_audit_case, not_run_here, run_mode
    from jaxgrad.verify import audit

    platform = jax.default_backend()
    if args.list:
        return _audit_list(platform)
    def chosen(case):
        return not args.op or any(o in case.name for o in args.op)

    cases = [c for c in all_audit_cases(platform) if chosen(c)]
    skipped = [(c, why) for c, why in not_run_here(platform) if chosen(c)]
    if not cases and not skipped:
        return _audit_error(f"no op matches {', '.join(repr(o) for o in args.op)} (--op matches part of a name; the "
                            f"ops: {', '.join(c.name for c in every_audit_case())})")
    if not cases:
        return _audit_error("; ".join(f"{c.name} does not run on this machine ({platform}): {why}"
                                      for c, why in skipped))
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
        mode = run_mode(case, platform)[0]
        results.append((case, mode, rep))
        summary.append((case, mode, rep.passed, rep.summary(), dt))
    width = max(len(c.name) for c, *_ in summary + [(c, None) for c, _ in skipped])
    print(f"summary on {platform} (worst error as a fraction of its rounding bound; < 1 passes):")
    for case, mode, ok, worst, dt in summary:
        n = len(case.sizes)
        print(f"  {'PASS' if ok else 'FAIL'}  {case.name:<{width}}  {mode:<14}  {n} size{'s' if n > 1 else ' '}  "
              f"{worst}   ({dt:5.1f} s)")
    for case, why in skipped:
        print(f"  ----  {case.name:<{width}}  not run here: {why}")
    if args.json:
        entries = [{"name": r.name, "backend": case.backend, "mode": mode, "passed": r.passed,
                    "sizes": [str(s) for s in r.sizes], "reports": [x.to_dict() for x in r.reports]}
                   for case, mode, r in results]
        entries += [{"name": case.name, "backend": case.backend, "mode": None, "passed": None, "not_run": why}
                    for case, why in skipped]
        data = json.dumps(entries, default=str, indent=1)
        try:
            pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.json).write_text(data)
        except OSError as err:
            return _audit_error(f"--json {args.json}: cannot be written ({err.strerror})")
    return 0 if all(ok for _, _, ok, _, _ in summary) else 1


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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option, --help included, belongs to the benchmark runner
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="jaxgrad", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: audit the custom VJPs at their smallest sizes, fit a KAN with "
                                     "grid refinement, train the CNN denoiser, write a report folder (index.html)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and two ops of the audit (about a minute; for "
                                                        "tests)")
    p.add_argument("--out", default="jaxgrad-demo", metavar="DIR", help="report folder (default: jaxgrad-demo)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR (replaces only a previous "
                                                            "demo report's files)")
    p = sub.add_parser("audit", help="check the custom VJP of every op (the LoRA block included; or the planted-bug "
                                     "catalogue) against jax.grad of its plain-JAX reference, on each backend this "
                                     "machine runs",
                       description="Each case is one op on one backend (xla; pallas: Triton on a GPU, interpret "
                                   "mode at small sizes elsewhere; mosaic and cudnn: GPU only, listed as not run "
                                   "elsewhere). At each size: check_vjp (the float64 re-run, the rounding model and "
                                   "its statistical verdict, finite differences, the adjoint and structural checks); "
                                   "across the sizes: the error must not grow faster than rounding. Exit status 0 "
                                   "when every case run passes, 1 when one fails, 2 on a usage error.")
    p.add_argument("--op", action="append", metavar="NAME",
                   help="only cases whose name contains NAME, e.g. swiglu or '[pallas]' (repeatable)")
    p.add_argument("--list", action="store_true", help="list the cases, their backends and sizes here, and run "
                                                       "nothing")
    p.add_argument("--planted", action="store_true", help="run the planted-bug catalogue instead of the ops")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs, the cotangents and the finite-difference "
                                                       "directions (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the reports to FILE (one entry per case; cases not "
                                                  "run here with the reason)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the full check_vjp report of every "
                                                                "size")
    p = sub.add_parser("train", help="train a family (kan, cnn, lora) with the jaxgrad.train engine from a TOML "
                                     "config")
    p.add_argument("family", choices=_families(), help="model family")
    p.add_argument("config", nargs="?", help="TOML config file (sections [train], [model], [data]; default: the "
                                             "family's defaults, or the saved run's with --resume)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set train.lr=1e-3 (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR from its latest good checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start again in a non-empty DIR (replaces only the "
                                                            "run's own files)")
    p.add_argument("--no-progress", action="store_true", help="print lines instead of a progress bar")
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (Llama 3's layout, special tokens and "
                                         "chat template) on local data files, for a model trained from scratch")
    p.add_argument("data", help="a file, folder or glob of JSONL / JSON / Parquet / CSV / text (as data.path)")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="tokens in all: 256 bytes, the learnt merges and the special tokens")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write tokenizer.json and "
                                                              "tokenizer_config.json into")
    p.add_argument("--pattern", help="a glob selecting files inside a DATA folder (as data.pattern)")
    p.add_argument("--file-format", choices=("json", "parquet", "csv", "text"),
                   help="read every file in this format whatever its extension (as data.file_format)")
    p.add_argument("--sample-by", choices=("line", "paragraph", "document"), default="document",
                   help="text files: one record per line, paragraph or file (default: document)")
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in DIR")
    p = sub.add_parser("merge", help="merge a PEFT adapter into its base (QLoRA: onto the dequantised NF4 weights it "
                                     "was trained against) and export an HF folder with the base's tokenizer")
    p.add_argument("--base", required=True, metavar="DIR", help="the base model's HF folder (config.json, "
                                                                 "safetensors, tokenizer files)")
    p.add_argument("--adapter", required=True, metavar="DIR", help="the PEFT adapter folder (adapter_config.json, "
                                                                   "adapter_model.safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the merged model")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                   help="dtype of the merged weights (default: the base's)")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--nf4", dest="nf4", action="store_true", default=None,
                   help="the adapter was trained over an NF4 base (QLoRA); default: what the adapter's run "
                        "(run.json above --adapter) says, else dense")
    q.add_argument("--dense", dest="nf4", action="store_false", help="the adapter was trained over the dense base")
    p.add_argument("--nf4-blocksize", type=int, metavar="N", help="NF4 block size of the QLoRA run (default: the "
                                                                  "run's, else 64)")
    p.add_argument("--double-quant", action="store_true", default=None,
                   help="the QLoRA run double-quantised its NF4 scales (default: the run's, else no)")
    p.add_argument("--overwrite", action="store_true", help="replace a merged model already in --out")
    p = sub.add_parser("bench", help="run a benchmark suite (jaxgrad bench --help: the suites and their options)",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="SUITE [--sizes small|full] [--out DIR] ...")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxgrad.demo import run_demo

        return run_demo(args.out, quick=args.quick, overwrite=args.overwrite)
    if args.command == "audit":
        if args.planted and args.list:
            return _audit_error("--list lists the op cases; --planted runs the catalogue (drop one of them)")
        return _audit_planted(args) if args.planted else _audit_ops(args)
    if args.command == "train":
        from jaxgrad.train.cli_train import run

        return run(args.family, args.config, args.set, args.out, resume=args.resume, overwrite=args.overwrite,
                   progress=not args.no_progress)
    if args.command == "bench":
        return _bench(args.bench_args)
    if args.command == "tokenizer":
        return _tokenizer(args)
    if args.command == "merge":
        return _merge(args)
    return 2


def _merge(args) -> int:
    from jaxgrad.lora.export import merge_adapter_folder

    try:
        done = merge_adapter_folder(args.base, args.adapter, args.out, dtype=args.dtype, nf4=args.nf4,
                                    blocksize=args.nf4_blocksize, double_quant=args.double_quant,
                                    overwrite=args.overwrite)
    except (FileNotFoundError, NotADirectoryError, FileExistsError, ValueError) as err:  # AdapterError included
        print(f"jaxgrad merge: error: {str(err).removeprefix('merge: ')}", file=sys.stderr)
        return 2
    onto = (f"the dequantised NF4 weights (blocksize {done['blocksize']}, double_quant {done['double_quant']})"
            if done["nf4"] else "the dense weights")
    print(f"jaxgrad merge: {done['merged_modules']} projections merged (scale {done['scale']:g}) onto {onto}, "
          f"from {done['source']}; wrote {done['out']} ({done['dtype']}, with {', '.join(done['tokenizer_files']) or 'no tokenizer files'})")
    return 0


def _tokenizer(args) -> int:
    from jaxgrad.lora.tokenizer_files import train_tokenizer_on_files
    from jaxgrad.train.errors import ConfigError

    try:
        tok, n, chars = train_tokenizer_on_files(args.data, args.vocab_size, args.out, pattern=args.pattern,
                                                 file_format=args.file_format, sample_by=args.sample_by,
                                                 overwrite=args.overwrite)
    except (ConfigError, FileExistsError, ValueError) as err:  # DataError is a ConfigError
        print(f"jaxgrad tokenizer: error: {err}", file=sys.stderr)
        return 2
    print(f"jaxgrad tokenizer: {tok.vocab_size} tokens learnt from {n} records ({chars} characters); wrote "
          f"{args.out}")
    return 0


def _families() -> list[str]:
    from jaxgrad.train.families import FAMILIES

    return list(FAMILIES)


def _bench(bench_args: list[str]) -> int:
    """Delegate to the benchmark runner, ``python -m jaxgrad.bench`` (its options, its output format)."""
    from jaxgrad.bench.__main__ import main as bench_main

    return int(bench_main(bench_args) or 0)


if __name__ == "__main__":
    sys.exit(main())
