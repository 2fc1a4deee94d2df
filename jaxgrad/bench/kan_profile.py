"""The ``kan_profile`` tool: where one KAN layer's fwd+bwd time goes, a per-op table from a ``jax.profiler`` trace.

    python -m jaxgrad.bench kan_profile [--sizes full|small] [--grid-size 5] [--spline-order 3]
                                        [--variants "xla custom_vjp fp16_scaled,mosaic"] [--steps 5] [--out runs/bench]

The variants are the ``kan`` suite's (:func:`jaxgrad.bench.kan._kan_variants`: ``value_and_grad`` of ``mean(y^2)``
w.r.t. the trained params and ``x``), on its inputs (batch 16384, 512 -> 512 at ``full``; 64, 32 -> 32 at
``small``). Each is compiled once more **without XLA's command buffers** (``xla_gpu_enable_command_buffer=""``:
inside a CUDA graph the kernels lose the HLO op annotation the table is keyed on), timed, and run ``--steps`` times
under ``jax.profiler.trace``; :mod:`jaxgrad.bench.hlo_profile` reads the trace against the executable's optimised
HLO. A Mosaic GPU kernel is one custom call; XLA's passes around it (the scale maxima, transposes, the unscaling)
are the fusions next to it. The table is :func:`jaxgrad.bench.lora_profile.variant_table`'s.

Output: ``<out>/kan-profile-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.txt`` (and ``.json``; ``--out`` defaults to
``runs/bench``, git-ignored), header first: device, versions, commit, command line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import pathlib
import shutil
import sys
import tempfile

from jaxgrad.bench.hlo_profile import analyse_with_gaps, find_trace
from jaxgrad.bench.lora_profile import DEFAULT_OUT, NO_COMMAND_BUFFERS, rows_json, variant_table

DEFAULT_VARIANTS = ("xla custom_vjp fp16_scaled", "mosaic")
SIZES = {"full": dict(batch=16384, features=512), "small": dict(batch=64, features=32)}


def layer_inputs(sizes: str, grid_size: int, spline_order: int):
    """The ``kan`` suite's parameters and ``x`` (float32) at ``sizes``."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.kan.layer import KANConfig, init

    s = SIZES[sizes]
    params = init(jax.random.key(0), KANConfig(s["features"], s["features"], grid_size=grid_size,
                                               spline_order=spline_order))
    x = jax.random.uniform(jax.random.key(1), (s["batch"], s["features"]), jnp.float32, -1, 1)
    return params, x


def profile_variant(name: str, fn, args, *, steps: int, warmup: int, repeats: int, work_dir: str) -> dict:
    """Time ``fn(*args)`` as compiled for the profile, trace ``steps`` calls, and read the trace against its HLO."""
    import jax

    from jaxgrad.bench import harness as bm

    how = "XLA defaults"
    lowered = jax.jit(fn).lower(*args)
    exe = default = lowered.compile()
    if jax.default_backend() == "gpu":
        try:
            exe = lowered.compile(compiler_options=NO_COMMAND_BUFFERS)
            how = "command buffers off"
        except Exception as e:  # noqa: BLE001 - profile the default executable, and say so
            how = f"XLA defaults (command buffers could not be turned off: {type(e).__name__}: {e})"[:300]
    timing = bm.time_fn(default, *args, warmup=warmup, repeats=repeats)
    profiled = timing if exe is default else bm.time_fn(exe, *args, warmup=warmup, repeats=repeats)
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=work_dir)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(exe(*args))
    trace = find_trace(trace_dir)
    rows, which, gaps = analyse_with_gaps(trace, exe.as_text(), steps)
    meta = {"name": name, "steps": steps, "median_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
            "p90_ms": timing["p90_ms"], "profiled_median_ms": profiled["median_ms"], "profiled_with": how,
            "events_from": which, "idle_gaps": [[op, ms] for op, ms in gaps[:12]]}
    return {"name": name, "rows": rows, "meta": meta}


def header(env: dict, argv: list[str]) -> list[str]:
    return [
        "# kan-profile: where one KAN layer's fwd+bwd time goes (python -m jaxgrad.bench kan_profile)",
        f"# device: {env.get('device_kind')} ({env.get('platform')}), host {env.get('hostname')}, "
        f"{env.get('datetime_utc')}",
        f"# jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuda plugin {env.get('cuda_plugin')}, "
        f"python {env.get('python')}",
        f"# commit {env.get('commit')} (uncommitted changes: {env.get('dirty')}); command: {' '.join(argv)}",
        f"# layer: {env.get('layer')}; matmul precision {env.get('matmul_precision')}",
    ]


def write_outputs(variants: list[dict], env: dict, argv: list[str], out_dir: str, top: int) -> pathlib.Path:
    from jaxgrad.bench import harness as bm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = bm.result_stem("kan-profile", env, bm.precision_slug("default", (), env.get("platform")))
    path, k = out / f"{stem}.txt", 1
    while path.exists():
        path, k = out / f"{stem}-{k}.txt", k + 1
    text = "\n".join(header(env, argv)) + "\n\n" + "".join(
        variant_table(v["name"], v["rows"], v["meta"], top) + "\n" for v in variants)
    path.write_text(text)
    payload = {"environment": env, "command": argv,
               "variants": [{"name": v["name"], "meta": v["meta"], "ops": rows_json(v["rows"])} for v in variants]}
    path.with_suffix(".json").write_text(json.dumps(bm._jsonable(payload), indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m jaxgrad.bench kan_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", choices=sorted(SIZES), default=None, help="default: full on a GPU, else small")
    p.add_argument("--grid-size", type=int, default=5)
    p.add_argument("--spline-order", type=int, default=3)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated names of the kan suite's layer variants (default: %(default)s; 'mosaic' "
                        "needs a Hopper GPU)")
    p.add_argument("--steps", type=int, default=5, help="steps traced")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=30, help="ops listed per variant")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    a = p.parse_args(argv)

    import jax

    from jaxgrad.bench import harness as bm
    from jaxgrad.bench.kan import _kan_variants

    sizes = a.sizes or ("full" if jax.default_backend() == "gpu" else "small")
    available = _kan_variants("default")
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        p.error(f"--variants: {unknown} are not layer variants here; these are: {sorted(available)}")
    params, x = layer_inputs(sizes, a.grid_size, a.spline_order)
    cmd = ["python -m jaxgrad.bench kan_profile", *argv]
    env = {**bm.environment(), "command": " ".join(cmd),
           "layer": f"batch {x.shape[0]}, {x.shape[1]} -> {x.shape[1]}, G={a.grid_size}, k={a.spline_order}, "
                    "float32"}
    work = tempfile.mkdtemp(prefix="kan-profile-")
    variants = []
    for name in names:
        print(f"# profiling {name!r} ({env['layer']}) ...", flush=True)
        try:
            v = profile_variant(name, available[name], (params, x), steps=a.steps, warmup=a.warmup,
                                repeats=a.repeats, work_dir=work)
        except Exception as e:  # noqa: BLE001 - the other variants still get their table
            print(f"# {name!r} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(variant_table(name, v["rows"], v["meta"], a.top), flush=True)
        variants.append(v)
    path = write_outputs(variants, env, cmd, a.out, a.top)
    print(f"wrote {path} ({_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')})")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if len(variants) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
