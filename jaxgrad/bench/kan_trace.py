"""The ``kan_trace`` tool: where the time goes inside the KAN layer's Mosaic GPU kernels, from their on-device traces.

    python -m jaxgrad.bench kan_trace [--grids 5:3,20:3] [--batch 16384] [--features 512] [--regions 256]
                                      [--kernels forward,dx,dC] [--out runs/bench]

Each kernel (:mod:`jaxgrad.kan.forward_mgpu`, :mod:`jaxgrad.kan.dx_mgpu`, :mod:`jaxgrad.kan.dcoef_wide_mgpu`) is timed
as the layer runs it, then run once more under :func:`jaxgrad.ops.mgpu_common.kernel_traces`: each compute warpgroup
stamps the SM clock as it enters and leaves the named regions of its pipeline body (the bases, the ``wgmma`` issue,
the wait for the products, the epilogue). Time a compute warpgroup spends outside every region is the pipeline's:
waiting for the memory warpgroup's next stage, and the loop itself. The table gives, per kernel and region, the
cycles per entry and the share of the traced window (the warpgroup's first ``--regions`` entries, so the first
tiles of each CTA; a kernel whose shared memory cannot hold that many is traced with fewer).

Output: ``<out>/kan-trace-<device>-tf32-<YYYYmmdd>-<HHMMSS>.txt`` (and ``.json``), header first: device, versions,
commit, command line. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import sys
import tempfile

from jaxgrad.bench.lora_profile import DEFAULT_OUT

KERNELS = ("forward", "dx", "dC")


def summarise(trace: dict, warpgroups: int = 3, memory_wg: int = 2) -> dict:
    """Per named region (``a/b`` where ``b`` is entered inside ``a``) of the compute warpgroups' traces: entries per
    warpgroup, mean cycles per entry and the share of the traced window; ``outside`` is the window's share that no
    top-level region covers. The trace is Mosaic GPU's Chrome trace (``ts`` in SM clock cycles / 1000 after the
    start's offset), one ``tid`` per warpgroup of a CTA."""
    by_tid: dict[int, list] = collections.defaultdict(list)
    for e in trace.get("traceEvents", []):
        by_tid[e["tid"]].append(e)
    totals: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    windows, top_level = [], 0.0
    for tid, events in by_tid.items():
        if (tid - 1) % warpgroups == memory_wg or not events:
            continue
        stack: list[tuple[str, float]] = []
        for e in events:
            if e["ph"] == "B":
                path = "/".join([s for s, _ in stack] + [e["name"]])
                stack.append((path, e["ts"]))
            elif stack:
                path, start = stack.pop()
                cycles = (e["ts"] - start) * 1e3
                totals[path] += cycles
                counts[path] += 1
                if not stack:
                    top_level += cycles
        windows.append((events[-1]["ts"] - events[0]["ts"]) * 1e3)
    n_wg, window = len(windows), sum(windows)
    regions = {path: {"entries_per_wg": counts[path] / max(n_wg, 1),
                      "cycles_per_entry": totals[path] / counts[path],
                      "share": totals[path] / window if window else None}
               for path in sorted(totals, key=lambda p: -totals[p])}
    return {"warpgroups": n_wg, "window_cycles_per_wg": window / max(n_wg, 1), "regions": regions,
            "outside": 1 - top_level / window if window else None}


def layer_operands(batch: int, features: int, grid_size: int, spline_order: int) -> dict:
    """``x``, the layer's float32 parameters (as ``kan_linear`` passes them to the kernels) and a cotangent ``g``."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.kan.layer import KANConfig, init

    p = init(jax.random.key(0), KANConfig(features, features, grid_size=grid_size, spline_order=spline_order))
    x = jax.random.uniform(jax.random.key(1), (batch, features), jnp.float32, -1, 1)
    g = jax.random.normal(jax.random.key(2), (batch, features), jnp.float32)
    coef = (p["spline_weight"] * p["spline_scaler"][..., None]).astype(jnp.float32)
    return dict(x=x, g=g, grid=p["grid"].astype(jnp.float32), coef=coef,
                base_weight=p["base_weight"].astype(jnp.float32), k=spline_order)


def kernel_fns(ops: dict) -> dict:
    """The three kernels as the layer calls them: ``{name: (jitted function, its arguments)}``."""
    import functools

    import jax

    from jaxgrad.kan.dcoef_wide_mgpu import kan_dcoef_wide_mgpu
    from jaxgrad.kan.dx_mgpu import kan_dx_mgpu
    from jaxgrad.kan.forward_mgpu import kan_forward_mgpu

    x, g, grid, coef, wb, k = (ops[n] for n in ("x", "g", "grid", "coef", "base_weight", "k"))
    return {"forward": (jax.jit(functools.partial(kan_forward_mgpu, spline_order=k)), (x, grid, coef, wb)),
            "dx": (jax.jit(functools.partial(kan_dx_mgpu, spline_order=k)), (x, grid, coef, wb, g)),
            "dC": (jax.jit(functools.partial(kan_dcoef_wide_mgpu, spline_order=k)), (x, grid, g))}


def trace_kernel(fn, args, regions: int, work_dir: str) -> dict:
    """``fn(*args)``'s kernels traced with at most ``regions`` entries a warpgroup (halved until shared memory holds
    the trace); the summary of each kernel call's trace file."""
    import jax

    from jaxgrad.ops.mgpu_common import kernel_traces

    errors = []
    while regions >= 16:
        d = tempfile.mkdtemp(prefix="trace-", dir=work_dir)
        try:
            with kernel_traces(d, regions):
                jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001 - shared memory: retry with a smaller trace
            errors.append(f"{regions} regions: {type(e).__name__}: {str(e)[:200]}")
            regions //= 2
            continue
        files = sorted(glob.glob(os.path.join(d, "*-trace.json")), key=os.path.getmtime)
        return {"regions": regions, "calls": [summarise(json.load(open(f))) for f in files], "errors": errors}
    return {"regions": 0, "calls": [], "errors": errors}


def format_summary(name: str, timing_ms: float, traced: dict) -> str:
    lines = [f"## {name}: {timing_ms:.3f} ms (median, untraced, with its XLA operand passes); traced with "
             f"{traced['regions']} regions a warpgroup"]
    for e in traced["errors"]:
        lines.append(f"   (not traced at {e})")
    for i, call in enumerate(traced["calls"]):
        lines.append(f"   kernel call {i + 1}: {call['warpgroups']} compute warpgroups, "
                     f"{call['window_cycles_per_wg']:.0f} cycles traced each")
        lines.append(f"   {'region':<44} {'entries/wg':>10} {'cycles/entry':>12} {'share':>7}")
        for path, r in call["regions"].items():
            lines.append(f"   {path:<44} {r['entries_per_wg']:>10.1f} {r['cycles_per_entry']:>12.0f} "
                         f"{r['share']:>7.1%}")
        lines.append(f"   {'(outside every region: pipeline waits, loop)':<44} {'':>10} {'':>12} "
                     f"{call['outside']:>7.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m jaxgrad.bench kan_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", default="5:3,20:3", help="G:k pairs (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=512, help="in = out features")
    p.add_argument("--regions", type=int, default=256, help="traced region entries a warpgroup")
    p.add_argument("--kernels", default=",".join(KERNELS), help="of %(default)s")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    a = p.parse_args(argv)
    kernels = [s.strip() for s in a.kernels.split(",") if s.strip()]
    unknown = [s for s in kernels if s not in KERNELS]
    if unknown:
        p.error(f"--kernels: {unknown} are not among {list(KERNELS)}")
    try:
        grids = [tuple(int(v) for v in s.split(":")) for s in a.grids.split(",") if s.strip()]
    except ValueError:
        p.error(f"--grids: expected G:k pairs such as 5:3,20:3, got {a.grids!r}")

    from jaxgrad.bench import harness as bm
    from jaxgrad.kan.forward_mgpu import on_hopper

    if not on_hopper():
        p.error("kan_trace needs a Hopper GPU (the Mosaic GPU kernels and their traces run only there)")
    cmd = ["python -m jaxgrad.bench kan_trace", *argv]
    env = {**bm.environment(), "command": " ".join(cmd)}
    work = tempfile.mkdtemp(prefix="kan-trace-")
    text = ["# kan-trace: cycles inside the KAN layer's Mosaic GPU kernels (python -m jaxgrad.bench kan_trace)",
            f"# device: {env.get('device_kind')} ({env.get('platform')}), host {env.get('hostname')}, "
            f"{env.get('datetime_utc')}",
            f"# jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuda plugin {env.get('cuda_plugin')}, "
            f"python {env.get('python')}",
            f"# commit {env.get('commit')} (uncommitted changes: {env.get('dirty')}); command: {' '.join(cmd)}",
            f"# layer: batch {a.batch}, {a.features} -> {a.features}, float32 through float16 operands scaled by "
            "powers of two (f32 accumulation)", ""]
    results, ok = [], True
    for grid_size, order in grids:
        ops = layer_operands(a.batch, a.features, grid_size, order)
        for name, (fn, args) in kernel_fns(ops).items():
            if name not in kernels:
                continue
            title = f"{name}, G={grid_size}, k={order}"
            print(f"# {title} ...", flush=True)
            try:
                timing = bm.time_fn(fn, *args, warmup=2, repeats=10)
                traced = trace_kernel(fn, args, a.regions, work)
            except Exception as e:  # noqa: BLE001 - the other kernels still get their tables
                ok = False
                text.append(f"## {title}: failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            block = format_summary(title, timing["median_ms"], traced)
            print(block, flush=True)
            text.append(block)
            results.append({"kernel": name, "grid_size": grid_size, "spline_order": order,
                            "median_ms": timing["median_ms"], **traced})
            ok = ok and bool(traced["calls"])
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bm.result_stem('kan-trace', env, 'tf32')}.txt"
    path.write_text("\n".join(text) + "\n")
    path.with_suffix(".json").write_text(json.dumps(bm._jsonable({"environment": env, "command": cmd,
                                                                  "kernels": results}), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
