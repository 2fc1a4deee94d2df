"""Run one jaxgrad benchmark suite: ``python -m jaxgrad.bench SUITE [options]`` (also ``jaxgrad bench SUITE``).

    python -m jaxgrad.bench SUITE [--sizes small|full|long] [--out runs/bench] [--repeats N] [--warmup N]
                                  [--precision default|highest] [--variants SUBSTR,...] [--budget-s S]
    python -m jaxgrad.bench TOOL [its own options]     # verify_cost, verify_false_alarms, verify_detection_limits,
                                                       # verify_detection_timing, lora_profile, kan_profile, kan_trace,
                                                       # lora_curve_drift,
                                                       # nf4_matmul, tf32_rounding, llama_real, scaling

A timing suite (:data:`SUITES`) prints its table and writes it to
``<out>/<suite>-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.{json,txt}`` (UTC;
:func:`jaxgrad.bench.harness.write_results`). ``--out`` defaults to ``runs/bench`` under the current directory
(git-ignored in a checkout), so running a benchmark never changes the repository: the README's tables are generated
from the committed ``benchmarks/results/``, and a result joins them only with ``--out benchmarks/results``.
Stopped by SIGTERM (``timeout``'s signal), a suite writes the rows this process measured so far, with a note saying
so, and exits with status 1 (a compilation or a run in progress finishes first).

The variants of a suite are timed one after the other in this process (the GPU machines are shared and noisy, so only
side-by-side numbers are compared); the ``lora`` and ``lora_model`` suites run each variant in a fresh process instead
(:mod:`jaxgrad.bench.fresh_process`), so that each one's peak device memory is its own; ``--variants`` and
``--budget-s`` apply to them and to the ``kan`` suite. Off-GPU the Pallas kernels run in interpret mode, which is slow, so ``--sizes``
defaults to ``small`` there and to ``full`` on a GPU.

A tool (:data:`TOOLS`: the verifier's calibration sweeps, the LoRA block's and the KAN layer's profiles, the f32 loss-curve drift of the
LoRA paths, the NF4 matmul tile sweep, the GPU's TF32 rounding mode) has its own options;
``python -m jaxgrad.bench TOOL --help`` lists them. Every tool writes its header (device, versions, commit,
uncommitted changes, command line) first, and names its result files the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pathlib
import sys
import time
from collections.abc import Callable

#: timing suites: name -> ``module:function``; the function is ``(sizes, precision, *, repeats, warmup, ...) ->
#: rows`` or ``(rows, notes)`` (lines printed with the table and kept in the result's environment)
SUITES: dict[str, str] = {
    "swiglu": "jaxgrad.bench.swiglu:suite_swiglu",
    "kan": "jaxgrad.bench.kan:suite_kan",
    "cnn": "jaxgrad.bench.cnn:suite_cnn",
    "lora": "jaxgrad.bench.lora_block:suite_lora",
    "lora_model": "jaxgrad.bench.lora_model:suite_lora_model",
    "lora_proj": "jaxgrad.bench.lora_proj:suite_lora_proj",
    "attention": "jaxgrad.bench.attention:suite_attention",
    "lm_head": "jaxgrad.bench.lm_head:suite_lm_head",
}
#: tools with their own command line: name -> module whose ``main(argv) -> int`` runs it
TOOLS: dict[str, str] = {
    "verify_cost": "jaxgrad.bench.verify_cost",
    "verify_false_alarms": "jaxgrad.bench.verify_false_alarms",
    "verify_detection_limits": "jaxgrad.bench.verify_detection_limits",
    "verify_detection_timing": "jaxgrad.bench.verify_detection_timing",
    "lora_profile": "jaxgrad.bench.lora_profile",
    "kan_profile": "jaxgrad.bench.kan_profile",
    "kan_trace": "jaxgrad.bench.kan_trace",
    "lora_curve_drift": "jaxgrad.bench.lora_curve_drift",
    "nf4_matmul": "jaxgrad.bench.nf4_matmul",
    "tf32_rounding": "jaxgrad.bench.tf32_rounding",
    "llama_real": "jaxgrad.bench.llama_real",
    "llama_memory": "jaxgrad.bench.llama_memory",
    "scaling": "jaxgrad.bench.scaling",
}
FRESH_PROCESS_SUITES = ("lora", "lora_model", "lm_head")  # each variant in a child process
SELECTABLE_SUITES = (*FRESH_PROCESS_SUITES, "kan")  # --variants, --budget-s
#: runs/bench (jaxgrad.bench.harness.DEFAULT_RESULTS_DIR, spelled out: importing the harness imports JAX, which a
#: tool may first need to configure): git-ignored; --out benchmarks/results to commit a result
DEFAULT_OUT = "runs/bench"


def suite_function(name: str) -> Callable:
    """The function of timing suite ``name`` (imported now)."""
    module, _, function = SUITES[name].partition(":")
    return getattr(importlib.import_module(module), function)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxgrad.bench",
                                description="Run one jaxgrad benchmark suite (also: jaxgrad bench SUITE); a tool "
                                            "takes its own options (python -m jaxgrad.bench TOOL --help).")
    p.add_argument("suite", choices=sorted(SUITES) + sorted(TOOLS),
                   help="a timing suite, or a tool with its own options (TOOL --help)")
    p.add_argument("--sizes", choices=["small", "full", "long"], default=None,
                   help="problem sizes (default: full on a GPU, small elsewhere; long: lora / attention at seq 8192)")
    p.add_argument("--out", default=DEFAULT_OUT, help="results directory (default: %(default)s, git-ignored; "
                                                      "--out benchmarks/results adds a result to the committed "
                                                      "ones the README's tables are made from)")
    p.add_argument("--repeats", type=_int_at_least(1), default=20,
                   help="timed calls per variant (default: %(default)s)")
    p.add_argument("--warmup", type=_int_at_least(0), default=3,
                   help="untimed calls per variant (default: %(default)s)")
    p.add_argument("--precision", choices=["default", "highest"], default="default",
                   help="jax default matmul precision for the whole run (default: %(default)s)")
    p.add_argument("--variants", default=None,
                   help="comma-separated substrings: run only the variants whose name contains one; =NAME: exactly "
                        "that variant (lora, lora_model, lm_head, kan suites)")
    p.add_argument("--budget-s", type=_positive_float, default=None,
                   help="wall-clock budget of the whole suite in seconds (lora, lora_model, lm_head, kan suites: "
                        "variants that do not fit are not started)")
    p.add_argument("--grids", type=_grid_list, default=None,
                   help="kan suite: only the sizes with these grid sizes and orders, as G:k pairs (e.g. 20:3,5:5)")
    p.add_argument("--head-grad", action="store_true",
                   help="lm_head suite: also dW, the head's gradient (default: dh only; LoRA freezes the head)")
    return p


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _grid_list(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            g, k = (int(v) for v in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected G:k pairs such as 20:3,5:5, got {part!r}") from None
        pairs.append((g, k))
    if not pairs:
        raise argparse.ArgumentTypeError(f"expected G:k pairs such as 20:3,5:5, got {text!r}")
    return pairs


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        return int(importlib.import_module(TOOLS[argv[0]]).main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite in TOOLS:  # options before the tool's name
        parser.error(f"{args.suite} is a tool with its own options: python -m jaxgrad.bench {args.suite} --help")
    out = pathlib.Path(args.out)
    for parent in (out, *out.parents):  # checked now, not after the suite has run
        if parent.exists() and not parent.is_dir():
            parser.error(f"--out {args.out}: {parent} exists and is not a directory")
    if args.sizes == "long" and args.suite not in ("lora", "attention"):
        parser.error(f"--sizes long is only defined for the lora and attention suites (seq 8192), not {args.suite!r}")
    if (args.variants or args.budget_s is not None) and args.suite not in SELECTABLE_SUITES:
        parser.error(f"--variants and --budget-s are only implemented for the {', '.join(SELECTABLE_SUITES)} "
                     f"suites, not {args.suite!r}")
    if args.grids is not None and args.suite != "kan":
        parser.error(f"--grids is an option of the kan suite, not {args.suite!r}")
    if args.head_grad and args.suite != "lm_head":
        parser.error(f"--head-grad is an option of the lm_head suite, not {args.suite!r}")
    if args.suite in FRESH_PROCESS_SUITES:  # variants in child processes: this one must not preallocate the GPU
        from jaxgrad.bench.fresh_process import parent_setup

        parent_setup()
    import jax

    from jaxgrad.bench import harness as bm

    sizes = args.sizes or ("full" if jax.default_backend() == "gpu" else "small")
    ctx = jax.default_matmul_precision("highest") if args.precision == "highest" else contextlib.nullcontext()
    extra = {}
    if args.variants:
        extra["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.budget_s is not None:
        extra["budget_s"] = args.budget_s
    if args.head_grad:
        extra["head_grad"] = True
    if args.grids is not None:
        from jaxgrad.bench.kan import kan_configs

        try:
            kan_configs(sizes, args.grids)
        except ValueError as e:
            parser.error(str(e))
        extra["grids"] = args.grids
    terminated = False
    with ctx, bm.stops_on_sigterm() as measured:
        env = bm.environment()
        t0 = time.perf_counter()
        try:
            result = suite_function(args.suite)(sizes, args.precision, repeats=args.repeats, warmup=args.warmup,
                                                **extra)
        except bm.Terminated:  # timeout's signal: keep what was measured
            terminated = True
            result = (list(measured), [f"stopped by SIGTERM after {time.perf_counter() - t0:.0f} s: the rows above "
                                       f"were measured, the suite's later variants were not run"])
    rows, notes = result if isinstance(result, tuple) else (result, [])
    if notes:
        env["suite_notes"] = notes
    table = bm.format_table(rows, env) + "".join(f"# {line}\n" for line in notes)
    print(table, end="")
    path = bm.write_results(rows, args.suite, args.out, env=env)
    if notes:
        path.with_suffix(".txt").write_text(table)
    print(f"wrote {path.resolve()} and {path.with_suffix('.txt').name}")
    skipped = [r.variant for r in rows if r.median_ms is None and r.notes.startswith("skipped")]
    if skipped:
        print(f"note: {len(skipped)} variant(s) skipped: {skipped}")
    failed = [r.variant for r in rows if r.median_ms is None and not r.notes.startswith("skipped")]
    if failed:
        print(f"error: {len(failed)} variant run(s) failed: {sorted(set(failed))}", file=sys.stderr)
        return 1
    if terminated:
        print("error: the suite was stopped by SIGTERM before its end", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
