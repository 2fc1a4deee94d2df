#!/usr/bin/env python
"""Regenerate every figure table of README.md and docs/*.md from the committed result files.

    python scripts/readme_tables.py            # rewrite the tables in place
    python scripts/readme_tables.py --check    # exit 1 (and show the diff) if any table is stale

A table lives between two marker comments in a markdown file, e.g.::

    <!-- table:bench begin -->
    ... generated, never edited by hand ...
    <!-- table:bench end -->

Tables (``TABLES``):

* ``bench``: per benchmark suite (``python -m jaxgrad.bench``: ``benchmarks/results/<suite>-<device>-<precision>-<date>-<time>.json``) and
  device, the latest result file of each matmul-precision setting (``default``, ``highest``), merged into one
  table: the variants as rows, each (dtype, precision) as a column, for the suite's first problem size (the
  headline one of the suite); cells are median milliseconds and the speedup over ``jax.grad`` of the
  plain-JAX reference measured in the same run; the last rows are the fastest jaxgrad variant's speedup over
  PyTorch (when measured) and the floor (``max(flops / peak FLOP/s, bytes / HBM B/s)``).
* ``bench-full``: the same result files, every problem size, one row per variant with p10-p90, floor, achieved
  fraction and memory.
* ``headline``: the README's one table of measurements, a row per entry of ``HEADLINE`` (suite, device, dtype,
  matmul precision): from the file the ``bench`` table shows for that suite, device and precision, the fastest
  jaxgrad variant at the suite's headline size, its speedup over ``jax.grad`` of the reference and over the
  PyTorch peer of the same run, the two peak memories where each variant ran in a fresh process, and the file.
* ``detection``: the latest ``verify-detection-*.json`` (``python -m jaxgrad.bench verify_detection_limits``): the smallest
  planted scale error caught in all trials, per op, leaf size and precision.
* ``real-size``: the latest ``llama_real`` result (``python -m jaxgrad.bench llama_real``) of each model and base
  precision (Llama-3.2-1B, Llama-3.1-8B bf16, Llama-3.1-8B NF4): tokens/s of one LoRA training step, model TFLOP/s
  (NeMo's accounting, ``4 P N``), peak memory and peak minus the frozen weights, and the ratios to the same run's
  transformers + PEFT and transformers + PEFT + Liger rows.
* ``scaling``: per (workload, GPUs, layout), the newest ``scaling`` run that measured it (``python -m jaxgrad.bench
  scaling``): throughput, scaling factor and efficiency against that run's 1-GPU row, peak and base memory per GPU,
  profiled collective and compute time.
* ``kan-fit``: the latest KAN fit result (``scripts/kan_fit.py``, recognised by its content): train / test RMSE per
  grid, ours and pykan's.

``bench.SUITE`` and ``bench-full.SUITE`` (e.g. ``<!-- table:bench.kan begin -->``) show one suite.

Which file is shown never depends on its name: the suite, device and precision are read from the file's rows and
``environment``, so renaming a result file changes only the link.

"Latest" is the environment's ``datetime_utc`` (the file name's stamp where it is missing). Only the standard library
is used, so the check runs anywhere (``tests/test_readme_tables.py`` runs it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# What each suite times (python -m jaxgrad.bench SUITE), for the caption. Unknown suites are named as they are.
SUITE_TITLES = {
    "kan": "KAN: one `kan_linear` layer, forward + backward",
    "cnn": "CNN: the seed denoiser (1 -> 16 -> 16 -> 1 channels, 3x3 convs, ReLU), forward + backward",
    "swiglu": "swiglu: `silu(gate) * up`, forward + backward",
    "lora": "LoRA: the Llama block, forward + backward",
}
SUITE_ORDER = ("kan", "cnn", "lora", "swiglu")
# The README's headline measurements: (what, suite, device substring, dtype, matmul precision), one row each.
HEADLINE = (
    ("KAN layer (`kan_linear`), fwd + bwd", "kan", "H100", "f32", "default"),
    ("CNN denoiser, fwd + bwd", "cnn", "H100", "f32", "default"),
    ("CNN denoiser, fwd + bwd", "cnn", "H100", "bf16", "default"),
)
# The detection sweep's ops (jaxgrad.verify.calibration) and the leaf that carries the planted error.
DETECTION_OPS = {"dense": "dense (W)", "conv_relu": "conv3x3+ReLU (x)", "attention": "softmax attention (q)",
                 "long_sum": "long sum (W)"}
DETECTION_PRECISIONS = (("f32", "f32"), ("tf32", "TF32"), ("f16", "f16"), ("bf16", "bf16"))

MARKER = re.compile(r"(<!-- table:(?P<name>[\w.-]+) begin -->\n)(?P<body>.*?)(<!-- table:(?P=name) end -->)", re.S)


# ------------------------------------------------------------------------------------------------ formatting
def fmt3(x: float) -> str:
    """Three significant digits, trailing zeros kept: 2.40, 11.7, 0.534, 104."""
    s = f"{x:#.3g}"
    return s[:-1] if s.endswith(".") else s


def fmt_sci(x: float | None) -> str:
    """1.65e-2 (RMSE style)."""
    if x is None:
        return "-"
    m, e = f"{x:.2e}".split("e")
    return f"{m}e{int(e)}"


def fmt_sizes(sizes: dict) -> str:
    return " ".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in sizes.items())


# Links are written relative to the markdown file being rendered (README.md at the root, docs/*.md one level down).
_BASE = [ROOT]


def _rel(path: pathlib.Path) -> str:
    return pathlib.Path(os.path.relpath(path.resolve(), _BASE[0].resolve())).as_posix()


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


# ------------------------------------------------------------------------------------------------ loading
def _stamp(path: pathlib.Path, env: dict) -> str:
    if env.get("datetime_utc"):
        return env["datetime_utc"]
    m = re.search(r"(\d{8})-?(\d{6})?", path.stem)
    return m.group(0) if m else ""


def load_bench(results: pathlib.Path) -> list[dict]:
    """Every benchmark result file: {path, env, rows, suite, device, precision, stamp}."""
    out = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(data, dict) or "environment" not in data or not rows or not isinstance(rows, list) \
                or not all(isinstance(r, dict) and {"suite", "variant", "median_ms"} <= r.keys() for r in rows):
            continue
        env = data["environment"]
        out.append({"path": path, "env": env, "rows": rows, "suite": rows[0]["suite"],
                    "device": env.get("device_kind") or "unknown device",
                    "precision": (env.get("matmul_precision") or "default").split(" ")[0],
                    "stamp": _stamp(path, env)})
    return out


#: suites whose runs are tabled by their own marker (``table:scaling``: every workload's newest row, across runs),
#: not by the per-suite "latest run" tables
OWN_TABLE = ("scaling",)


def latest_bench(results: pathlib.Path, suite: str | None = None) -> dict[tuple[str, str], list[dict]]:
    """(suite, device) -> the latest file of each matmul-precision setting, 'default' first (one suite if named);
    a file with a PyTorch row is preferred to a later one without (a run of a few variants, ``--variants``)."""
    best: dict[tuple[str, str, str], dict] = {}
    for f in load_bench(results):
        if suite is not None and f["suite"] != suite:
            continue
        if suite is None and f["suite"] in OWN_TABLE:  # each of its runs measures other workloads: its own table
            continue
        key = (f["suite"], f["device"], f["precision"])
        # a run that has the PyTorch row (the whole comparison) wins over a later run of a few variants
        rank = lambda g: (any(_is_torch(r["variant"]) for r in g["rows"]), g["stamp"], g["path"].name)  # noqa: E731
        if key not in best or rank(f) > rank(best[key]):
            best[key] = f
    order = {s: i for i, s in enumerate(SUITE_ORDER)}
    groups: dict[tuple[str, str], list[dict]] = {}
    for (suite, device, precision), f in sorted(
            best.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][0], kv[0][1],
                                          kv[0][2] != "default", kv[0][2])):
        groups.setdefault((suite, device), []).append(f)
    return groups


def _latest_json(results: pathlib.Path, pattern: str, accept=None) -> tuple[pathlib.Path, dict] | None:
    """The newest result file matching ``pattern`` (and ``accept(data)``, when given)."""
    found = _all_json(results, pattern, accept)
    return found[-1] if found else None


def _all_json(results: pathlib.Path, pattern: str, accept=None) -> list[tuple[pathlib.Path, dict]]:
    """Every result file matching ``pattern`` (and ``accept(data)``), oldest first."""
    found = []
    for path in results.glob(pattern):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if accept is not None and not accept(data):
            continue
        env = data.get("environment", {}) if isinstance(data, dict) else {}
        found.append(((_stamp(path, env), path.name), path, data))
    return [(path, data) for _, path, data in sorted(found, key=lambda t: t[0])]


# ------------------------------------------------------------------------------------------------ bench
def _is_baseline(variant: str) -> bool:
    return variant.startswith("jax.grad")


def _is_torch(variant: str) -> bool:
    """A PyTorch variant (PyTorch autograd, transformers + PEFT)."""
    return any(w in variant.lower() for w in ("torch", "peft", "transformers"))


def _not_run(row: dict) -> str:
    notes = str(row.get("notes", ""))
    return "failed" if notes.startswith("error") else "skipped" if notes.startswith("skipped") else "-"


def _column_label(dtype: str, precision: str, platform: str | None) -> str:
    if dtype == "f32" and precision == "default":
        return "f32, TF32 (JAX default)" if platform == "gpu" else "f32 (default)"
    if dtype == "f32" and precision == "highest":
        return "f32, exact (highest)"
    return dtype if precision == "default" else f"{dtype} ({precision})"


def _groups(rows: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(sizes, dtype, rows) in order of first appearance."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((fmt_sizes(r["sizes"]), r["dtype"]), []).append(r)
    return [(s, d, rs) for (s, d), rs in out.items()]


def _speed_cell(row: dict, base: dict | None, fastest: bool) -> str:
    ms = row.get("median_ms")
    if ms is None:
        return _not_run(row)
    cell = fmt3(ms)
    if fastest:
        cell = f"**{cell}**"
    if base is not None and base is not row and base.get("median_ms"):
        cell += f" ({fmt3(base['median_ms'] / ms)}x)"
    return cell


def _date(f: dict) -> str:
    return str(f["env"].get("datetime_utc", f["stamp"]))[:10]


def table_bench(results: pathlib.Path, suite: str | None = None) -> list[str]:
    groups = latest_bench(results, suite)
    if not groups:
        return ["(no benchmark results in `" + _rel(results) + "`)"]
    lines = ["Median milliseconds per forward + backward step, and in brackets the speedup over `jax.grad` of the "
             "plain-JAX reference in the same run (**bold**: fastest). Floor: `max(flops / peak FLOP/s, bytes / HBM "
             "B/s)` of the device. `failed` / `skipped`: the variant did not run (why: the result file's notes).", ""]
    for (suite, device), files in groups.items():
        cols = []  # (label, file, rows of the first size with this dtype)
        headline = None
        for f in files:
            grouped = _groups(f["rows"])
            if headline is None:
                headline = grouped[0][0]
            for sizes, dtype, rows in grouped:
                if sizes == headline:
                    cols.append((_column_label(dtype, f["precision"], f["env"].get("platform")), f, rows))
        variants: list[str] = []
        for _, _, rows in cols:
            variants += [r["variant"] for r in rows if r["variant"] not in variants]
        variants.sort(key=lambda v: (_is_torch(v), _is_baseline(v), v))  # ours, then jax.grad, then PyTorch
        body = []
        for v in variants:
            cells = [f"`{v}`" if not _is_torch(v) else v]
            for _, _, rows in cols:
                row = next((r for r in rows if r["variant"] == v), None)
                base = next((r for r in rows if _is_baseline(r["variant"])), None)
                timed = [r["median_ms"] for r in rows if r.get("median_ms")]
                cells.append("-" if row is None else
                             _speed_cell(row, base, bool(timed) and row.get("median_ms") == min(timed)))
            body.append(cells)
        if any(_is_torch(v) for v in variants):
            cells = ["fastest jaxgrad vs PyTorch"]
            for _, _, rows in cols:
                torch = next((r for r in rows if _is_torch(r["variant"]) and r.get("median_ms")), None)
                ours = [r for r in rows if not _is_torch(r["variant"]) and not _is_baseline(r["variant"])
                        and r.get("median_ms")]
                best = min(ours, key=lambda r: r["median_ms"]) if ours else None
                cells.append(f"{fmt3(torch['median_ms'] / best['median_ms'])}x (`{best['variant']}`)"
                             if torch and best else "-")
            body.append(cells)
        floors = []
        for _, _, rows in cols:
            fl = next((r["floor_ms"] for r in rows if r.get("floor_ms")), None)
            floors.append(fmt3(fl) if fl else "-")
        body.append(["floor"] + floors)
        sources = ", ".join(f"[`{f['path'].name}`]({_rel(f['path'])})" for f in files)
        versions = sorted({f"jax {f['env'].get('jax')}" for f in files})
        lines += [f"**{SUITE_TITLES.get(suite, suite)}** -- {headline}, one {device} "
                  f"({', '.join(sorted({_date(f) for f in files}))}, {', '.join(versions)}; {sources})", ""]
        lines += _table(["variant"] + [c[0] for c in cols], body) + [""]
    return lines[:-1]


def table_bench_full(results: pathlib.Path, suite: str | None = None) -> list[str]:
    groups = latest_bench(results, suite)
    if not groups:
        return ["(no benchmark results in `" + _rel(results) + "`)"]
    lines = []
    for (suite, device), files in groups.items():
        for f in files:
            env = f["env"]
            lines += [f"**{SUITE_TITLES.get(suite, suite)}** -- {device}, matmul precision {f['precision']} "
                      f"([`{f['path'].name}`]({_rel(f['path'])}); {_date(f)}, jax {env.get('jax')}, "
                      f"jaxlib {env.get('jaxlib')}, python {env.get('python')}"
                      + (f", commit {str(env['commit'])[:7]}" if env.get("commit") else "") + ")", ""]
            body = []
            for sizes, dtype, rows in _groups(f["rows"]):
                base = next((r for r in rows if _is_baseline(r["variant"])), None)
                for r in rows:
                    ms = r.get("median_ms")
                    mib = lambda b: "-" if not b else f"{b / 2**20:.0f}"  # noqa: E731
                    body.append([
                        sizes, dtype, f"`{r['variant']}`" if not _is_torch(r["variant"]) else r["variant"],
                        fmt3(ms) if ms else _not_run(r),
                        f"{fmt3(r['p10_ms'])}-{fmt3(r['p90_ms'])}" if ms and r.get("p10_ms") else "-",
                        f"{fmt3(base['median_ms'] / ms)}x" if ms and base and base.get("median_ms") else "-",
                        fmt3(r["floor_ms"]) if r.get("floor_ms") else "-",
                        f"{r['achieved_fraction']:.2f}" if r.get("achieved_fraction") else "-",
                        mib(r.get("compiled_bytes")), mib(r.get("peak_bytes"))])
            lines += _table(["sizes", "dtype", "variant", "median ms", "p10-p90", "vs jax.grad", "floor ms",
                             "floor / median", "compiled MiB", "peak MiB"], body) + [""]
    lines.append("Compiled MiB: arguments + outputs + temporaries of the variant's XLA executable; peak MiB: the "
                 "process-wide device high-water mark when the variant had run (JAX's `peak_bytes_in_use`; "
                 "PyTorch's `max_memory_allocated` over its timed steps), so for JAX variants an upper bound. "
                 "Why a `failed` or `skipped` variant did not run is in the result file's `notes`.")
    return lines


# ------------------------------------------------------------------------------------------------ headline
def _precision_label(dtype: str, precision: str, platform: str | None) -> str:
    if dtype == "f32" and precision == "default":
        return "f32 (TF32)" if platform == "gpu" else "f32"
    if dtype == "f32" and precision == "highest":
        return "f32 (exact)"
    return dtype if precision == "default" else f"{dtype} ({precision})"


def _short_device(device: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
    return re.sub(r"\s+\d+\s*GB\b.*$", "", device.removeprefix("NVIDIA ")).strip() or device


def _fresh(row: dict) -> bool:
    """Timed in a process of its own, so its peak memory is its own (the LoRA suites)."""
    return "fresh process" in str(row.get("notes", ""))


def table_headline(results: pathlib.Path, spec=None) -> list[str]:
    """One row per ``HEADLINE`` entry; an entry without a result file reads "no result" (never silently dropped)."""
    spec = HEADLINE if spec is None else spec
    body = []
    for what, suite, device, dtype, precision in spec:
        f = next((f for (s, d), files in latest_bench(results, suite).items() if device in d
                  for f in files if f["precision"] == precision), None)
        rows = []
        if f is not None:
            headline = _groups(f["rows"])[0][0]
            rows = [r for sizes, dt, rs in _groups(f["rows"]) if sizes == headline and dt == dtype for r in rs]
        ours = [r for r in rows if not _is_torch(r["variant"]) and not _is_baseline(r["variant"]) and r.get("median_ms")]
        if f is None or not ours:
            body.append([what, f"{device}, {_precision_label(dtype, precision, 'gpu')}", "no result", "-", "-", "-", "-"])
            continue
        best = min(ours, key=lambda r: r["median_ms"])
        base = next((r for r in rows if _is_baseline(r["variant"]) and r.get("median_ms")), None)
        peer = next((r for r in rows if _is_torch(r["variant"]) and r.get("median_ms")), None)
        mib = lambda r: f"{r['peak_bytes'] / 2**20:.0f}"  # noqa: E731
        memory = (f"{mib(best)} / {mib(peer)} MiB" if peer and _fresh(best) and _fresh(peer)
                  and best.get("peak_bytes") and peer.get("peak_bytes") else "-")
        body.append([
            what, f"{_short_device(f['device'])}, {_precision_label(dtype, precision, f['env'].get('platform'))}",
            f"{fmt3(best['median_ms'])} ms (`{best['variant']}`)",
            f"{fmt3(base['median_ms'] / best['median_ms'])}x" if base else "-",
            f"**{fmt3(peer['median_ms'] / best['median_ms'])}x** ({peer['variant']})" if peer else "-",
            memory, f"[{_date(f)}]({_rel(f['path'])})"])
    return (["Median time of one step at each suite's headline size ([docs/benchmarks.md](" + _rel(ROOT / "docs" /
             "benchmarks.md") + ")), the fastest jaxgrad variant against `jax.grad` of the plain-JAX reference and "
             "against the PyTorch peer, all measured in the same run (the linked result file).", ""]
            + _table(["measurement", "device, precision", "jaxgrad", "vs `jax.grad`", "vs PyTorch (same run)",
                      "peak memory, jaxgrad / PyTorch", "result"], body))


# ------------------------------------------------------------------------------------------------ detection
def table_detection(results: pathlib.Path) -> list[str]:
    # a complete sweep: every op of the table (a run of some ops, ``--ops``, is a spot check and stays in its file)
    # (when no file covers every op, the newest file of any ops, so a first partial run still shows)
    # (of several complete sweeps, the one with the most cells: a newer sweep of one size only updates those cells)
    found = (_widest_sweep(results)
             or _latest_json(results, "verify-detection-*.json",
                             accept=lambda d: not any(r.get("hardware") for r in d.get("rows", []))))
    if found is None:
        return ["(no `verify-detection-*.json` in `" + _rel(results) + "`)"]
    path, data = found
    env, rows = data.get("environment", {}), data.get("rows", [])
    # a newer emulated sweep of some cells (``--ops``) with as many trials replaces those cells: the verifier changed
    # for them (e.g. a change to the kink gating re-measured conv+ReLU only); the caption names it
    base_stamp, trials_needed = _stamp(path, env), max((r["trials"] for r in rows), default=0)
    cells = {(r["op"], r["size"], r["precision"]): (base_stamp, r, path) for r in rows}
    for p, stamp, r in _emulated_rows(results):
        key = (r["op"], r["size"], r["precision"])
        if key in cells and stamp > cells[key][0] and r["trials"] >= trials_needed:
            cells[key] = (stamp, r, p)
    rows = [v[1] for v in cells.values()]
    newer = sorted({v[2].name for v in cells.values() if v[2] != path})
    body = _detection_rows(rows)
    trials = sorted({r["trials"] for r in rows})
    summary = data.get("summary", {})
    commit = str(env.get("commit", "unknown"))[:7]
    lines = [f"Smallest planted scale error `s` (a gradient `(1 + s) g`) caught in all {'/'.join(map(str, trials))} "
             f"random trials; from [`{path.name}`]({_rel(path)}) ({str(env.get('datetime_utc', ''))[:10]}, "
             f"commit {commit}, {summary.get('replicas', '?')} replicas, false-alarm rate "
             f"{summary.get('model_false_alarm_rate_per_leaf', '?'):g} per leaf; computed on "
             + ("a CPU" if env.get("device_kind", "cpu") == "cpu" else f"the CPU of the {env['device_kind']} machine")
             + ", TF32/f16/bf16 emulated)"
             + ("; cells re-measured since: " + "; ".join(
                 f"[`{f}`]({_rel(results / f)}) ("
                 + ", ".join(f"`{op}`" for op in sorted({v[1]['op'] for v in cells.values() if v[2].name == f}))
                 + " at " + ", ".join(str(n) for n in sorted({v[1]['size'] for v in cells.values()
                                                              if v[2].name == f})) + ")" for f in newer)
                if newer else "")
             + ".", ""]
    lines += _table(["op (planted leaf)", "entries", "ReLU kinks"] + [label for _, label in DETECTION_PRECISIONS],
                    body)
    if "false_alarms" in summary:
        sums = [summary] + [json.loads((results / f).read_text()).get("summary", {}) for f in newer]
        fa = sum(sm.get("false_alarms", 0) for sm in sums)
        runs = sum(sm.get("correct_runs", 0) for sm in sums) if all("correct_runs" in sm for sm in sums) else "?"
        lines += ["", f"The correct kernels of the same sweep{'s' if newer else ''}: {fa} false alarms in "
                      f"{runs} leaves."]
    if any("ideal_limit" in r for r in rows):
        lines += ["", "In parentheses: the floor that the kernel's own rounding puts under any scale test at this "
                      "false-alarm rate (the Cramer-Rao spread of the best unbiased scale estimate, caught in every "
                      "trial with probability 0.95; `ideal_limit` in the file)."]
    # larger leaves than the table's (GPU sweeps: products emulated at HIGHEST there too), newest file per cell
    top = max((r["size"] for r in rows), default=0)
    large: dict[tuple[str, int, str], tuple[str, dict, pathlib.Path]] = {}
    for p, stamp, r in _emulated_rows(results):
        key = (r["op"], r["size"], r["precision"])
        if r["size"] > top and (key not in large or large[key][0] < stamp):
            large[key] = (stamp, r, p)
    if large:
        files = sorted({v[2].name for v in large.values()})
        lines += ["", "Larger leaves (" + ", ".join(f"[`{f}`]({_rel(results / f)})" for f in files) + "; each "
                  "file names its device; TF32/f16/bf16 emulated, products at HIGHEST; "
                  + "/".join(str(t) for t in sorted({v[1]["trials"] for v in large.values()})) + " trials):", ""]
        lines += _table(["op (planted leaf)", "entries", "ReLU kinks"] + [lb for _, lb in DETECTION_PRECISIONS],
                        _detection_rows([v[1] for v in large.values()]))
    return lines


def _emulated_rows(results: pathlib.Path):
    """``(path, stamp, row)`` of every emulated (not ``--hardware``) row of every readable detection file."""
    for p in results.glob("verify-detection-*.json"):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        stamp = _stamp(p, d.get("environment", {}))
        for r in d.get("rows", []):
            if not r.get("hardware"):
                yield p, stamp, r


def _widest_sweep(results: pathlib.Path) -> tuple[pathlib.Path, dict] | None:
    """The emulated sweep of every op with the most (op, size) cells, the newest of those."""
    best = None
    for path in results.glob("verify-detection-*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows = [r for r in data.get("rows", []) if not r.get("hardware")]
        if not {"dense", "conv_relu", "attention"} <= {r.get("op") for r in rows}:
            continue
        key = (len({(r["op"], r["size"]) for r in rows}), _stamp(path, data.get("environment", {})), path.name)
        if best is None or key > best[0]:
            best = (key, path, data)
    return None if best is None else (best[1], best[2])


def _detection_rows(rows: list[dict]) -> list[list[str]]:
    """One table row per (op, size): the smallest scale caught in all trials per precision, with the Cramer-Rao
    floor in parentheses where the file has it."""
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["op"], r["size"]), {})[r["precision"]] = r
    op_order = {op: i for i, op in enumerate(DETECTION_OPS)}
    body = []
    for (op, size), by_p in sorted(cells.items(), key=lambda kv: (op_order.get(kv[0][0], 99), kv[0][0], kv[0][1])):
        any_row = next(iter(by_p.values()))
        row = [DETECTION_OPS.get(op, op), str(any_row["entries"]), "yes" if any(r["kinks"] for r in by_p.values())
               else "no"]
        for p, _ in DETECTION_PRECISIONS:
            r = by_p.get(p)
            if r is None:
                row.append("-")
                continue
            if r["smallest_scale_caught_in_all"] is None:
                scales = [float(s) for s in r.get("caught_in_all", {})]
                cell = f"> {max(scales):g}" if scales else "not caught"
            else:
                cell = f"{r['smallest_scale_caught_in_all']:g}"
            if "ideal_limit" in r:
                cell += f" ({r['ideal_limit']:.1g})"
            row.append(cell)
        body.append(row)
    return body


# ------------------------------------------------------------------------------------------------ KAN fit
def _is_kan_fit(data) -> bool:
    """A ``scripts/kan_fit.py`` result: a list of per-grid rows with ``G`` and ``train_rmse`` (whatever its name)."""
    rows = data.get("results") if isinstance(data, dict) else None
    return bool(rows) and isinstance(rows, list) and all(isinstance(r, dict) and {"G", "train_rmse"} <= r.keys()
                                                         for r in rows)


def table_kan_fit(results: pathlib.Path) -> list[str]:
    found = _latest_json(results, "*.json", accept=_is_kan_fit)
    if found is None:
        return ["(no KAN fit result (`kan_fit.py --out-dir`) in `" + _rel(results) + "`)"]
    path, data = found
    body = []
    for r in data.get("results", []):
        theirs = (f"{fmt_sci(r.get('pykan_train_rmse'))} / {fmt_sci(r.get('pykan_test_rmse'))}"
                  if r.get("pykan_train_rmse") is not None else "-")
        body.append([str(r["G"]), f"{fmt_sci(r['train_rmse'])} / {fmt_sci(r['test_rmse'])}", theirs])
    lines = [f"{data.get('task', 'KAN fit')}; {data.get('dtype', '')} on {data.get('device', '?')} "
             f"({data.get('machine', '')}), seed {data.get('seed', '?')}, jax {data.get('jax', '?')}; "
             f"[`{path.name}`]({_rel(path)}).", ""]
    return lines + _table(["G", "ours: train / test RMSE", "pykan: train / test RMSE"], body)


# ------------------------------------------------------------------------------------------------ real sizes
REAL_SIZE_FILES = (("Llama-3.2-1B LoRA", "llama_real_1b-*.json"), ("Llama-3.1-8B LoRA", "llama_real_8b-*.json"),
                   ("Llama-3.1-8B QLoRA", "llama_real_8b_qlora-*.json"))
PEFT, LIGER = "transformers+PEFT", "transformers+PEFT+Liger"


def _file_date(path: pathlib.Path) -> str:
    """``YYYY-MM-DD`` of a result file named ``<suite>-<device>-<precision>-<date>-<time>.json``."""
    m = re.search(r"-(\d{4})(\d{2})(\d{2})-\d{6}\.json$", path.name)
    return f"{m.group(1)}-{m.group(2)}-{m.group(3)}" if m else path.name


def _is_real_size(data) -> bool:
    env = data.get("environment", {}) if isinstance(data, dict) else {}
    spec = env.get("llama_real", {}).get("spec", {})
    return bool(spec) and not spec.get("tiny") and spec.get("layers") == spec.get("full_layers") \
        and "variants" in env["llama_real"]


def table_real_size(results: pathlib.Path) -> list[str]:
    """One row per variant of the full-depth ``llama_real`` files of each model: each variant from the newest file
    that measured it (its date beside it where that is not the model's newest file), its ratios to the peers of
    that same run (speed: their step time over ours; memory: our peak over theirs, and our peak minus the frozen
    weights over theirs)."""
    body, files = [], []
    for what, pattern in REAL_SIZE_FILES:
        found = _all_json(results, pattern, _is_real_size)
        if not found:
            body.append([what, "no result"] + ["-"] * 6)
            continue
        newest: dict[str, tuple] = {}  # variant -> (path, its metrics, that run's peers), newest file wins
        for path, data in found:
            variants = data["environment"]["llama_real"]["variants"]
            batch = data["environment"]["llama_real"]["spec"]["batch"]
            for name, m in variants.items():
                if m.get("status") == "measured" and name != "jax.grad":
                    newest[name] = (path, m, {peer: variants.get(peer) for peer in (PEFT, LIGER)}, batch)
        latest_path = found[-1][0]
        order = list(found[-1][1]["environment"]["llama_real"]["variants"])
        names = [n for n in order if n in newest] + [n for n in newest if n not in order]
        used = sorted({newest[n][0] for n in names}, key=lambda p: [q for q, _ in found].index(p))
        files += [f"[{what}{'' if p == latest_path else ', ' + _file_date(p)}]({_rel(p)})" for p in used]
        gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
        for name in names:
            path, m, peers, batch = newest[name]
            ratios = []
            for peer in peers.values():
                ok = peer and peer.get("status") == "measured" and peer is not m
                ratios.append(f"{m['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if ok else "-")
            peft = peers[PEFT]
            mem = (f"{m['peak_bytes'] / peft['peak_bytes']:.2f}x / "
                   f"{m['peak_minus_frozen_bytes'] / peft['peak_minus_frozen_bytes']:.2f}x"
                   if peft and peft.get("status") == "measured" and peft is not m else "-")
            label = f"**{name}**" if name == "jaxgrad" else name
            label += "" if m.get("batch", batch) == batch else f" (batch {m['batch']})"
            label += "" if path == latest_path else f" ({_file_date(path)})"
            body.append([what, label, f"{m['tokens_per_s']:,.0f}", f"{m['model_tflops_nemo']:.0f}",
                         f"{gib(m['peak_bytes'])} ({gib(m['peak_minus_frozen_bytes'])})", *ratios, mem])
    head = ("One LoRA training step (forward, backward, AdamW on the adapters; r = 16 on all 7 projections, fp32 "
            "adapters, bf16 activations) at micro-batch 2 x seq 4096, random weights at the real shapes, on one H100, "
            "each row in a fresh process, the peers in the same run. Model TFLOP/s as NeMo counts them (4 x base "
            "parameters x tokens, attention not counted). Peak: the device's high-water mark, weights included; in "
            "brackets without the frozen weights. `recompute=` and `checkpointing=` trade time for memory "
            "(docs/lora.md). A row dated in brackets is from an earlier run than its model's newest (its ratios are "
            "to that run's peers). Files: " + ", ".join(files) + ".")
    return [head, ""] + _table(["model", "variant", "tokens/s", "model TFLOP/s", "peak GiB (minus frozen)",
                                "vs PEFT", "vs PEFT + Liger", "memory vs PEFT: peak / minus frozen"], body)


def _is_scaling(data) -> bool:
    env = data.get("environment", {}) if isinstance(data, dict) else {}
    return isinstance(env.get("scaling"), dict) and "rows" in env["scaling"]


def _run_label(path: pathlib.Path) -> str:
    """``YYYY-MM-DD HH:MM`` (UTC) of a result file named ``...-<date>-<time>.json``."""
    m = re.search(r"-(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})\d{2}\.json$", path.name)
    return f"{m.group(1)}-{m.group(2)}-{m.group(3)} {m.group(4)}:{m.group(5)}" if m else path.name


def table_scaling(results: pathlib.Path) -> list[str]:
    """One row per (workload, devices, layout) of the ``scaling`` files (``python -m jaxgrad.bench scaling``), each
    from the newest run that measured it: throughput, the scaling factor and efficiency against that run's own
    1-device row, the largest per-device peak, the frozen base's bytes per device (and their share of the whole
    base), and the profiled collective and compute milliseconds per step (mean over the devices)."""
    found = _all_json(results, "scaling-*.json", _is_scaling)
    newest: dict[tuple, tuple] = {}
    for path, data in found:
        gpu = data["environment"].get("device_kind", "?").removeprefix("NVIDIA ")
        for r in data["environment"]["scaling"]["rows"]:
            if r.get("status") == "measured":
                newest[(r["workload"], gpu, r["devices"], r["layout"], r.get("processes", 1))] = (path, r)
    if not newest:
        return ["No scaling run is committed yet."]
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    num = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731 - no 1-GPU row to scale by (a base too large)
    body = []
    for key in sorted(newest, key=lambda k: (k[0], k[1], k[2], k[3] != "data", k[3], k[4])):
        path, r = newest[key]
        prof = (r.get("profile") or {}).get("mean") or {}
        ms = lambda name: f"{prof[name]:.1f}" if name in prof else "-"  # noqa: E731
        unit = r.get("unit", "items")
        layout = r["layout"] + (f", {key[4]} processes" if key[4] > 1 else "")
        body.append([r["workload"], key[1], str(r["devices"]), layout, str(r['spec'].get('batch', '-')),
                     f"{r['throughput']:,.0f} {unit}", num(r.get("scaling_factor")), num(r.get("efficiency")),
                     gib(r["peak_bytes_max"]) if r.get("peak_bytes_max") else "-",
                     f"{gib(r['base_bytes_per_device'])} ({r['base_bytes_ratio']:.2f})"
                     if r.get("base_bytes_per_device") else "-",
                     ms("all_gather"), ms("all_reduce"), ms("exposed_collective"), ms("compute"),
                     f"{r['median_ms']:.1f}", f"[{_run_label(path)}]({_rel(path)})"])
    head = ("Weak scaling on one host of H100 SXM or H200 GPUs (NVLink; `NCCL_NVLS_ENABLE=0`): the per-GPU micro-batch "
            "fixed, each row in a fresh process (`N processes`: one per GPU), the scaling factor against the 1-GPU row "
            "of the same run (same GPU model). Peak: the largest "
            "device high-water mark. Base: the frozen base's bytes per GPU (in brackets, their share of the whole "
            "base). Collective and compute milliseconds per step from a profile of 2 steps, mean over the GPUs; "
            "exposed: collective time no compute overlaps.")
    return [head, ""] + _table(["workload", "GPU", "GPUs", "layout", "batch/GPU", "per second", "scaling", "efficiency",
                                "peak GiB/GPU", "base GiB/GPU", "all-gather ms", "all-reduce ms", "exposed ms",
                                "compute ms", "step ms", "run"], body)


# A marker's name is a table, optionally with one argument after a dot: ``bench.kan`` is the bench table of the kan
# suite alone.
TABLES: dict[str, Callable[..., list[str]]] = {
    "bench": table_bench, "bench-full": table_bench_full, "detection": table_detection, "kan-fit": table_kan_fit,
    "headline": table_headline, "real-size": table_real_size, "scaling": table_scaling}


# ------------------------------------------------------------------------------------------------ files
def render(text: str, results: pathlib.Path, base: pathlib.Path = ROOT) -> str:
    """``text`` with every marked table regenerated (unknown table names are an error); links are relative to
    ``base``, the markdown file's directory."""
    _BASE[0] = base

    def sub(m: re.Match) -> str:
        name, _, arg = m.group("name").partition(".")
        if name not in TABLES:
            raise SystemExit(f"readme_tables: unknown table {m.group('name')!r} (known: {', '.join(TABLES)}; "
                             "bench and bench-full take a suite: bench.kan)")
        return m.group(1) + "\n".join(TABLES[name](results, *([arg] if arg else []))) + "\n" + m.group(4)
    return MARKER.sub(sub, text)


def default_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=pathlib.Path, help="markdown files (default: README.md, docs/*.md)")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS, help="result directory")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    a = ap.parse_args(argv)
    stale = []
    for path in a.files or default_files():
        old = path.read_text()
        new = render(old, a.results, path.parent)
        if new == old:
            continue
        stale.append(path)
        if a.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{path} (committed)", f"{path} (from the results)"))
        else:
            path.write_text(new)
            print(f"readme_tables: rewrote {path}")
    if a.check and stale:
        print(f"readme_tables: stale tables in {', '.join(map(str, stale))}: run python scripts/readme_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
