"""The ``lora_profile`` tool: where the LoRA block's fwd+bwd time goes, a per-op table from a ``jax.profiler`` trace.

    python -m jaxgrad.bench lora_profile [--sizes full|small] [--variants "custom_vjp cudnn,jax.grad(reference) cudnn"]
                                         [--steps 5] [--out runs/bench] [--artifacts DIR]
    python -m jaxgrad.bench lora_profile --from-artifacts DIR [--out ...]     # re-make the table from a saved run

Each variant is built and compiled by :func:`jaxgrad.bench.lora_block.run_jax_variant` itself (the benchmark's inputs,
block call and timing), with two hooks on the harness it calls: ``compile_fn`` keeps the function and its
arguments, and ``time_fn``, after the benchmark's own timing, compiles the same function once more **without XLA's
command buffers** (``xla_gpu_enable_command_buffer=""``: inside a CUDA graph the kernels lose the HLO op
annotation the table is keyed on), times that executable too, and runs ``--steps`` steps of it under
``jax.profiler.trace``. :mod:`jaxgrad.bench.hlo_profile` reads the trace against the executable's optimised HLO.

The pass of an op: fwd, bwd, or the custom VJP's recomputed forward in the backward (``_block_bwd`` ->
``_recompute``). A gemm is "lora" when one of M, N, K is <= 128 (r = 16 at the benchmark shape; XLA concatenates
adapters that share an input, e.g. 2 x 8192 x 96 x 1024), else "base". Floors: gemm and attention at 790 TFLOP/s,
what large bf16 GEMMs sustain on an H100 SXM (the data sheet's dense bf16 peak is 989; an f32 (TF32) gemm is held to
the same 790, so its gap includes the 2x it loses to TF32), bytes at 3.35 TB/s; the block's FLOP convention
(cuDNN's attention backward also recomputes ``QK^T``, 10 not 8, not counted).

Output: ``<out>/lora-profile-<device>-bf16-<YYYYmmdd>-<HHMMSS>.txt`` (UTC; and ``.json``; ``--out`` defaults to
``runs/bench`` under the current directory, git-ignored in a checkout, so a run never changes the repository;
``--out benchmarks/results`` adds the table to the committed results), header first: device, versions, commit
(``JAXGRAD_COMMIT`` / ``JAXGRAD_DIRTY`` from the launcher, see :func:`jaxgrad.bench.harness.provenance`), command
line. ``--artifacts DIR`` also keeps each variant's trace and HLO text (gzip) and a ``meta`` json, from which
``--from-artifacts`` remakes the same table elsewhere (its header says so).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime as _dt
import gzip
import json
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Any

from jaxgrad.bench.hlo_profile import (HBM_BYTES, MATMUL_FLOPS, OpInfo, OpRow, analyse, find_trace,
                                       load_events, trace_summary)

DEFAULT_VARIANTS = ("custom_vjp cudnn", "jax.grad(reference) cudnn")
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
# jaxgrad.bench.harness.DEFAULT_RESULTS_DIR (git-ignored); spelled out, since importing it imports jax, which
# --from-artifacts does not need
DEFAULT_OUT = "runs/bench"


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def variant_table(name: str, rows: list[OpRow], meta: dict, top: int = 40) -> str:
    busy = sum(r.ms for r in rows)
    # floors per step: an op's floor times its launches per step
    fl = {r.op: r.info.floor_s * 1e3 * r.count for r in rows}
    floor = sum(fl.values())
    lines = [f"== {name} =="]
    wall, wall_p = meta.get("median_ms"), meta.get("profiled_median_ms")
    lines.append(
        f"step wall (harness median): {_f(wall)} ms as benchmarked (XLA defaults); {_f(wall_p)} ms for the "
        f"profiled executable ({meta.get('profiled_with', '?')}); {meta.get('steps')} steps traced")
    lines.append(f"GPU busy per step (sum of kernel times): {busy:.3f} ms in {sum(r.launches for r in rows):.0f} "
                 f"kernel launches of {len(rows)} ops; idle/launch gap vs profiled wall: "
                 f"{_f(None if wall_p is None else wall_p - busy)} ms; sum of op floors {floor:.3f} ms "
                 f"(the model's FLOP floor is separate: see header)")
    lines.append(f"events: {meta.get('events_from', '?')}")
    if meta.get("idle_gaps"):
        lines.append("GPU idle per step before: " + ", ".join(f"{op} {ms:.3f} ms" for op, ms in meta["idle_gaps"]))
    # by category
    cats: dict[str, list[OpRow]] = collections.defaultdict(list)
    for r in rows:
        cats[r.info.category].append(r)
    lines.append("")
    lines.append("-- by category (sorted by time - floor) --")
    head = f"{'category':<34} {'n/step':>7} {'ms':>8} {'%busy':>6} {'floor_ms':>9} {'gap_ms':>8} {'eff':>5} " \
           f"{'TFLOP/s':>8} {'GB/s':>7}"
    lines += [head, "-" * len(head)]
    stats = []
    for c, rs in cats.items():
        ms = sum(r.ms for r in rs)
        f = sum(fl[r.op] for r in rs)
        flops = sum(r.info.flops * r.count for r in rs)
        byts = sum(r.info.bytes * r.count for r in rs)
        stats.append((ms - f, c, sum(r.count for r in rs), ms, f, flops, byts))
    for gap, c, n, ms, f, flops, byts in sorted(stats, reverse=True):
        lines.append(f"{_short(c, 34):<34} {n:7.0f} {ms:8.3f} {100 * ms / busy:6.1f} {f:9.3f} {gap:8.3f} "
                     f"{(f / ms if ms else 0):5.2f} {flops / ms / 1e9 if ms else 0:8.1f} "
                     f"{byts / ms / 1e6 if ms else 0:7.0f}")
    lines.append(f"{'total':<34} {sum(s[2] for s in stats):7.0f} {busy:8.3f} {100.0:6.1f} {floor:9.3f} "
                 f"{busy - floor:8.3f} {(floor / busy if busy else 0):5.2f}")
    # coarse buckets
    buckets: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        b = buckets[_bucket(r.info)]
        b[0] += r.count
        b[1] += r.ms
        b[2] += fl[r.op]
    lines.append("coarse: " + "; ".join(f"{k} {v[1]:.3f} ms ({100 * v[1] / busy:.1f}%, n {v[0]:.0f}, floor {v[2]:.3f})"
                                        for k, v in sorted(buckets.items(), key=lambda kv: -kv[1][1])))
    # by pass
    passes = collections.defaultdict(float)
    for r in rows:
        passes[r.info.phase or "?"] += r.ms
    lines.append("by pass: " + ", ".join(f"{p} {ms:.3f} ms ({100 * ms / busy:.1f}%)" for p, ms in
                                         sorted(passes.items(), key=lambda kv: -kv[1])))
    # top ops
    lines.append("")
    lines.append(f"-- top {min(top, len(rows))} ops by time (per step) --")
    head = f"{'op':<28} {'category':<28} {'pass':<13} {'n':>3} {'ms':>7} {'%':>5} {'floor':>7} {'bnd':<5} " \
           f"{'eff':>5}  {'shape / dtypes':<34} {'source':<32} kernel"
    lines += [head, "-" * len(head)]
    for r in rows[:top]:
        f = fl[r.op]
        k = r.main_kernel + (f" (+{len(r.kernels) - 1})" if len(r.kernels) > 1 else "")
        lines.append(f"{_short(r.op, 28):<28} {_short(r.info.category, 28):<28} {r.info.phase or '-':<13} "
                     f"{r.count:3.0f} {r.ms:7.3f} {100 * r.ms / busy:5.1f} {f:7.3f} {r.info.bound:<5} "
                     f"{(f / r.ms if r.ms else 0):5.2f}  {_short(r.info.detail, 34):<34} "
                     f"{_short(r.info.source, 32):<32} {_short(k, 60)}")
    rest = rows[top:]
    if rest:
        lines.append(f"(+{len(rest)} more ops: {sum(r.ms for r in rest):.3f} ms)")
    return "\n".join(lines) + "\n"


def _bucket(info: OpInfo) -> str:
    if info.kind == "gemm":
        kind, dtype = "lora" if " lora " in info.category else "base", "f32/tf32" if "f32" in info.category else "bf16"
        return f"{kind} gemm {dtype}"
    if info.kind == "attention":
        return "attention"
    if info.kind in ("elementwise", "reduction", "convert", "copy"):
        return "memory passes"
    return "other"


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def rows_json(rows: list[OpRow]) -> list[dict]:
    return [{"op": r.op, "count_per_step": r.count, "ms_per_step": r.ms, "kernels": dict(r.kernels),
             "kernel_ms_per_step": dict(r.kernel_ms), "launches_per_step": r.launches,
             "floor_ms_per_step": r.info.floor_s * 1e3 * r.count, **dataclasses.asdict(r.info)} for r in rows]


def header(env: dict, argv: list[str], extra: list[str]) -> list[str]:
    from jaxgrad.bench.lora_block import SIZES, block_flops

    lines = [
        "# lora-profile: where the LoRA block's fwd+bwd time goes (python -m jaxgrad.bench lora_profile)",
        f"# device: {env.get('device_kind')} ({env.get('platform')}), host {env.get('hostname')}, "
        f"{env.get('datetime_utc')}",
        f"# jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuda plugin {env.get('cuda_plugin')}, "
        f"python {env.get('python')}",
        f"# commit {env.get('commit')} (uncommitted changes: {env.get('dirty')}); command: {' '.join(argv)}",
        f"# floors: gemm/attention at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s (bf16 dense that cuBLAS sustains on H100 SXM;"
        f" data-sheet peak 989), bytes at {HBM_BYTES / 1e12:.2f} TB/s; op floor = max of the two, bytes = the op's "
        "operand + result buffers once; eff = floor / time; gap = time - floor",
    ]
    s = SIZES.get(env.get("sizes", ""), None)
    if s:
        f = block_flops(**s)
        lines.append(f"# shape {env.get('sizes')}: {s}; block FLOPs (no recompute) {f['total']:.4g} -> "
                     f"{f['total'] / MATMUL_FLOPS * 1e3:.3f} ms at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s "
                     f"({f['total'] / 989e12 * 1e3:.3f} ms at 989); custom VJP recompute +"
                     f"{f['recompute_fwd_custom_vjp']:.4g}")
    return lines + [f"# {x}" for x in extra]


def render(variants: list[dict], env: dict, argv: list[str], extra: list[str], top: int) -> str:
    out = "\n".join(header(env, argv, extra)) + "\n\n"
    for v in variants:
        out += variant_table(v["name"], v["rows"], v["meta"], top) + "\n"
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running a variant (the benchmark's own setup, hooked)
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _hooked_harness(cap: dict, steps: int, trace_dir: str):
    """Hook :mod:`jaxgrad.bench.harness`'s ``compile_fn`` / ``time_fn`` while ``run_jax_variant`` runs."""
    import jax

    from jaxgrad.bench import harness as bm

    orig_compile, orig_time = bm.compile_fn, bm.time_fn

    def compile_hook(fn, *args):
        compiled = orig_compile(fn, *args)
        cap.update(fn=fn, args=args, compiled=compiled)
        return compiled

    def time_hook(fn, *args, **kw):
        timing = orig_time(fn, *args, **kw)  # the benchmark's own number (XLA defaults)
        exe, how = cap["compiled"], "XLA defaults"
        if jax.default_backend() == "gpu":
            try:
                exe = jax.jit(cap["fn"]).lower(*args).compile(compiler_options=NO_COMMAND_BUFFERS)
                how = "command buffers off"
            except Exception as e:  # noqa: BLE001 - profile the default executable, and say so
                how = f"XLA defaults (command buffers could not be turned off: {type(e).__name__}: {e})"[:300]
        cap["profiled_with"] = how
        cap["profiled_timing"] = orig_time(exe, *args, **kw) if exe is not cap["compiled"] else timing
        cap["hlo"] = exe.as_text()
        for _ in range(2):
            jax.block_until_ready(exe(*args))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(exe(*args))
        cap["trace"] = str(find_trace(trace_dir))
        return timing

    bm.compile_fn, bm.time_fn = compile_hook, time_hook
    try:
        yield
    finally:
        bm.compile_fn, bm.time_fn = orig_compile, orig_time


def profile_variant(name: str, sizes: str, *, steps: int, warmup: int, repeats: int, work_dir: str) -> dict:
    from jaxgrad.bench import lora_block as lb

    cap: dict[str, Any] = {}
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=work_dir)
    with _hooked_harness(cap, steps, trace_dir):
        row = lb.run_jax_variant(name, sizes, repeats=repeats, warmup=warmup)
    meta = {"name": name, "sizes": sizes, "steps": steps, "median_ms": row.median_ms,
            "p10_ms": row.p10_ms, "p90_ms": row.p90_ms, "compile_ms": row.compile_ms,
            "profiled_median_ms": cap["profiled_timing"]["median_ms"], "profiled_with": cap["profiled_with"],
            "notes": row.notes}
    print(f"# trace {cap['trace']}:\n{trace_summary(load_events(cap['trace']))}", flush=True)
    rows, which, _ = analyse(cap["trace"], cap["hlo"], steps)
    meta["events_from"] = which
    return {"name": name, "rows": rows, "meta": meta, "trace": cap["trace"], "hlo": cap["hlo"]}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def write_outputs(variants: list[dict], env: dict, argv: list[str], extra: list[str], out_dir: str, top: int,
                  stamp: str | None = None) -> pathlib.Path:
    from jaxgrad.bench import harness as bm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    when = _dt.datetime.strptime(stamp, "%Y%m%d-%H%M%S") if stamp else None
    stem = bm.result_stem("lora-profile", env, "bf16", when)
    path, k = out / f"{stem}.txt", 1
    while path.exists():
        path, k = out / f"{stem}-{k}.txt", k + 1
    text = render(variants, env, argv, extra, top)
    path.write_text(text)
    payload = {"environment": env, "command": argv, "notes": extra,
               "variants": [{"name": v["name"], "meta": v["meta"], "ops": rows_json(v["rows"])} for v in variants]}
    path.with_suffix(".json").write_text(json.dumps(bm._jsonable(payload), indent=1) + "\n")
    return path


def save_artifacts(variants: list[dict], env: dict, art: str) -> None:
    """Per variant: ``trace-<v>.json.gz`` and ``hlo-<v>.txt.gz``; one ``meta.json``, all in one flat folder."""
    d = pathlib.Path(art)
    d.mkdir(parents=True, exist_ok=True)
    metas = []
    for v in variants:
        s = _slug(v["name"])
        shutil.copyfile(v["trace"], d / f"trace-{s}.json.gz")
        with gzip.open(d / f"hlo-{s}.txt.gz", "wt") as f:
            f.write(v["hlo"])
        metas.append({**v["meta"], "slug": s})
    from jaxgrad.bench import harness as bm

    (d / "meta.json").write_text(json.dumps(bm._jsonable({"environment": env, "variants": metas}), indent=1))


def from_artifacts(art: str) -> tuple[list[dict], dict]:
    d = pathlib.Path(art)
    meta = json.loads((d / "meta.json").read_text())
    variants = []
    for m in meta["variants"]:
        with gzip.open(d / f"hlo-{m['slug']}.txt.gz", "rt") as f:
            hlo = f.read()
        rows, which, _ = analyse(d / f"trace-{m['slug']}.json.gz", hlo, m["steps"])
        m["events_from"] = which
        variants.append({"name": m["name"], "rows": rows, "meta": m})
    return variants, meta["environment"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m jaxgrad.bench lora_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", choices=["full", "small"], default=None, help="default: full on a GPU, else small")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated jaxgrad.bench.lora_block variant names (off-GPU 'cudnn' becomes 'sdpa(xla)')")
    p.add_argument("--steps", type=int, default=5, help="steps traced")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=40, help="ops listed per variant")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    p.add_argument("--artifacts", default=None, help="keep traces, HLO text and meta.json here")
    p.add_argument("--from-artifacts", default=None, help="remake the table from a saved --artifacts folder")
    a = p.parse_args(argv)
    cmd = ["python -m jaxgrad.bench lora_profile", *argv]
    if a.from_artifacts:
        variants, env = from_artifacts(a.from_artifacts)
        import socket

        extra = [f"table remade with --from-artifacts on {socket.gethostname()} at "
                 f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} from the traces and HLO of "
                 f"the run above (its command: {env.get('command')})"]
        path = write_outputs(variants, env, cmd, extra, a.out, a.top)
        print(path.read_text())
        print(f"wrote {path}")
        return 0

    import jax

    from jaxgrad.bench import harness as bm

    on_gpu = jax.default_backend() == "gpu"
    sizes = a.sizes or ("full" if on_gpu else "small")
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    if not on_gpu:
        names = [n.replace("cudnn", "sdpa(xla)") for n in names]
    env = {**bm.environment(), "sizes": sizes}
    env["command"] = " ".join(cmd)
    work = tempfile.mkdtemp(prefix="lora-profile-")
    variants = []
    for name in names:
        print(f"# profiling {name!r} ({sizes}) ...", flush=True)
        try:
            v = profile_variant(name, sizes, steps=a.steps, warmup=a.warmup, repeats=a.repeats, work_dir=work)
        except Exception as e:  # noqa: BLE001 - the other variants still get their table
            import traceback

            traceback.print_exc()
            print(f"# {name!r} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(variant_table(name, v["rows"], v["meta"], a.top), flush=True)
        variants.append(v)
    if a.artifacts:
        save_artifacts(variants, env, a.artifacts)
    path = write_outputs(variants, env, cmd, [], a.out, a.top)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
