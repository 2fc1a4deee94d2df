r"""The fresh-process harness of the LoRA benchmark suites (``lora``: :mod:`jaxgrad.bench.lora_block`; ``lora_model``:
:mod:`jaxgrad.bench.lora_model`): each variant runs in its own child process (``python -m <suite module> --child
NAME``), so that the device's peak memory it reports is its own; the child prints its row after :data:`ROW_TAG` and
the parent collects it, or a row saying why there is none (a crash, a timeout, a spent budget, a missing library).
The torch side's timing and configuration are :mod:`jaxgrad.bench.peers`'.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from jaxgrad.bench import harness as bm

ROW_TAG = "LORA_BENCH_ROW "


def compile_and_time(row: bm.Row, fn, args: tuple, *, warmup: int, repeats: int):
    """Compile ``fn`` at ``args`` and time it into ``row`` (compile time, the compiled program's memory, median /
    p10 / p90 / min of ``repeats`` calls after ``warmup``, the device's peak bytes since the process started).
    Returns ``(compiled, peak_after_compile)``: the executable, and the peak before the first timed call."""
    t0 = time.perf_counter()
    compiled = bm.compile_fn(fn, *args)
    row.compile_ms = (time.perf_counter() - t0) * 1e3
    mem = bm.compiled_memory(compiled)
    row.argument_bytes, row.output_bytes = mem["argument_bytes"], mem["output_bytes"]
    row.temp_bytes, row.compiled_bytes = mem["temp_bytes"], mem["total_bytes"]
    peak_compile = bm.device_peak_bytes()
    timing = bm.time_fn(compiled, *args, warmup=warmup, repeats=repeats)
    row.median_ms, row.p10_ms, row.p90_ms = timing["median_ms"], timing["p10_ms"], timing["p90_ms"]
    row.min_ms, row.loop_ms, row.repeats = timing["min_ms"], timing.get("loop_ms"), timing["repeats"]
    row.peak_bytes = bm.device_peak_bytes()
    return compiled, peak_compile


_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_parent_env: dict[str, str | None] = {}


def parent_setup() -> None:
    """Call in the parent before JAX starts its backend: the parent itself must not take 75 % of the GPU's memory
    (JAX's default preallocation), which the children measure and need. The children get the caller's setting."""
    if not _parent_env:
        _parent_env[_PREALLOCATE] = os.environ.get(_PREALLOCATE)
        os.environ[_PREALLOCATE] = "false"


def _child_cmd(name: str, sizes: str, repeats: int, warmup: int, precision: str, module: str) -> list[str]:
    return [sys.executable, "-m", module, "--child", name, "--sizes", sizes, "--repeats",
            str(repeats), "--warmup", str(warmup), "--precision", precision]


def run_in_fresh_process(name: str, sizes: str, *, repeats: int, warmup: int, precision: str = "default",
                         timeout: float = 300.0, module: str, suite: str, size_table: dict) -> bm.Row:
    """One variant in a child process (``python -m <module> --child NAME``, the module's :func:`child_main`); a
    failure or a timeout comes back as a row without a time, its notes saying why. ``module``, ``suite`` and
    ``size_table``: the suite's."""
    s = size_table[sizes]
    failed = bm.Row(suite=suite, variant=name, sizes=dict(s), dtype="bf16", precision=precision)
    return run_child_process(_child_cmd(name, sizes, repeats, warmup, precision, module), failed, timeout=timeout,
                             label=f"{suite} bench child {name!r}")


def child_env() -> tuple[pathlib.Path, dict]:
    """``(repository root, environment)`` for a child process: the root on ``PYTHONPATH`` and the caller's own
    preallocation setting (:func:`parent_setup` changed the parent's)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if _parent_env:  # the caller's own preallocation setting, not the parent's
        env.pop(_PREALLOCATE, None)
        if _parent_env[_PREALLOCATE] is not None:
            env[_PREALLOCATE] = _parent_env[_PREALLOCATE]
    return root, env


def run_child_process(cmd: list[str], failed: bm.Row, *, timeout: float, label: str) -> bm.Row:
    """Run ``cmd`` (a child that prints its row after :data:`ROW_TAG`) and return that row; a failure or a timeout
    comes back as ``failed`` with notes saying why (the child's stderr tail goes to ours, headed by ``label``)."""
    root, env = child_env()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(root), timeout=timeout)
    except subprocess.TimeoutExpired:
        failed.notes = f"error: timed out after {timeout:.0f} s"
        return failed
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(ROW_TAG):
            return bm.Row(**json.loads(line[len(ROW_TAG):]))
    tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    errors = [ln for ln in tail if ("Error" in ln or "Exception" in ln) and not ln.startswith((" ", "For simplicity"))]
    why = (errors or tail or ["no output"])[-1]
    failed.notes = f"error: child exited {proc.returncode}: {why[:250]}"
    sys.stderr.write(f"--- {label} failed (rc {proc.returncode}); stderr tail:\n" + "\n".join(tail[-25:]) + "\n")
    return failed


def select_variants(all_names: list[str], variants, suite: str, known: list[str] | None = None) -> list[str]:
    """The names selected by ``variants`` (substrings; ``=name`` exact), all of them when ``variants`` is empty."""
    if not variants:
        return list(all_names)
    names = [n for n in all_names if bm.selects(variants, n)]
    if not names:
        raise ValueError(f"{suite} bench: --variants {variants} selects none of {known or all_names}")
    return names


def run_fresh_suite(names: list[str], sizes: str, precision: str, *, repeats: int, warmup: int, timeout: float,
                    budget_s: float | None, say, module: str, suite: str, size_table: dict,
                    skip_reason=lambda name: None) -> list[bm.Row]:
    """Run ``names`` one after the other, each in its own process (:func:`run_in_fresh_process`). A variant for
    which ``skip_reason(name)`` says why it cannot run here gets a row with that note; with ``budget_s`` (for the
    whole run) a child gets at most what is left, and a variant with less than 15 s left is not started."""
    s = size_table[sizes]
    rows = []
    t_start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        left = timeout if budget_s is None else min(timeout, budget_s - (t0 - t_start))
        why = skip_reason(name)
        if why:
            row = bm.Row(suite=suite, variant=name, sizes=dict(s), dtype="bf16", precision=precision, notes=why)
        elif left < 15:
            row = bm.Row(suite=suite, variant=name, sizes=dict(s), dtype="bf16", precision=precision,
                         notes=f"error: not run: the suite's time budget ({budget_s:.0f} s) is spent")
        else:
            row = run_in_fresh_process(name, sizes, repeats=repeats, warmup=warmup, precision=precision,
                                       timeout=left, module=module, suite=suite, size_table=size_table)
        say(f"#   {name}: {'-' if row.median_ms is None else f'{row.median_ms:.3f} ms'}, peak "
            f"{'-' if row.peak_bytes is None else f'{row.peak_bytes / 2**20:.1f} MiB'} "
            f"({time.perf_counter() - t0:.0f} s){'; ' + row.notes if row.median_ms is None else ''}")
        rows.append(row)
    return rows


def is_skipped(row: bm.Row) -> bool:
    return row.median_ms is None and row.notes.startswith("skipped")


def child_main(argv: list[str], *, sizes, run_torch: dict, run_jax, description: str) -> int:
    """A child process's entry: ``--child NAME --sizes ... --repeats N --warmup N --precision P``; runs
    ``run_torch[NAME]`` or ``run_jax`` (under the matmul precision) and prints the row after :data:`ROW_TAG`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--child", required=True)
    p.add_argument("--sizes", choices=sorted(sizes), required=True)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", choices=["default", "highest"], default="default")
    a = p.parse_args(argv)
    if a.child in run_torch:
        row = run_torch[a.child](a.sizes, repeats=a.repeats, warmup=a.warmup, precision=a.precision)
    else:
        import contextlib

        import jax

        ctx = jax.default_matmul_precision("highest") if a.precision == "highest" else contextlib.nullcontext()
        with ctx:
            row = run_jax(a.child, a.sizes, repeats=a.repeats, warmup=a.warmup, precision=a.precision)
    print(ROW_TAG + json.dumps(bm._jsonable(row.to_dict())), flush=True)
    return 0
