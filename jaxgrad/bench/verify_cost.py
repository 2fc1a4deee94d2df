"""What one ``check_vjp`` of a small bf16 Llama LoRA block costs: wall time, per stage, and XLA compilations.

    python -m jaxgrad.bench verify_cost --backend xla --repeats 3
    JAX_PLATFORMS=cuda python -m jaxgrad.bench verify_cost --backend mosaic --repeats 3     # on a GPU

The block (issue #26's yardstick): hidden 64, intermediate 96, 4 query heads on 2 kv heads (GQA, head dim 16),
batch 2, seq 24, LoRA r 8 on all 7 projections (random non-zero A and B), bf16 throughout; every gradient and output
leaf has at most 4096 entries, so the verdict takes 32 replicas. ``fn`` is :func:`jaxgrad.lora.block.block` with
``--backend`` (``xla``, ``pallas`` or ``mosaic``), the reference :func:`jaxgrad.lora.block.block_reference`.

Each repeat is a fresh process (nothing compiled yet, as for a user's first call): it builds the block, then times
one ``check_vjp(fn, ref, x, lora, norms)`` and counts the XLA compilations it triggers (JAX's backend-compile
event). Prints a header (device, versions, commit, dirty flag, command line), one line per repeat (wall seconds,
compilations and the seconds they took, the verdict), each repeat's per-stage seconds (``VJPReport.timings``) and
the minimum over the repeats of every number (the machine is shared: the minimum is the least disturbed).
``--out DIR`` also writes them to ``DIR/verify-cost-<backend>-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.json``
(UTC; precision ``tf32`` on an NVIDIA GPU, ``default`` elsewhere), ``--json PATH`` to that file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

CHILD_TAG = "VERIFY_COST_RESULT "


def build_block(backend: str = "xla", seed: int = 0, dtype: str = "bfloat16"):
    """``(fn, reference, (x, lora, norms))`` of the yardstick block (module doc): the frozen projections closed
    over, the two RMSNorm weights differentiated. The draws are those of ``tests/test_lora_block.py``'s
    ``make_block`` at this configuration."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxgrad.lora.block import block, block_reference
    from jaxgrad.lora.config import LlamaConfig, LoraConfig
    from jaxgrad.lora.model import init, init_lora

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64, vocab_size=11)
    lcfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    b, t = 2, 24
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    params = init(k1, cfg, std=cfg.hidden_size ** -0.5)["layers"][0]
    for i, n in enumerate(("input_layernorm", "post_attention_layernorm")):
        params[n]["weight"] = 1 + 0.2 * jax.random.normal(jax.random.fold_in(k2, i), (cfg.hidden_size,))
    lora = init_lora(k3, cfg, lcfg)["layers"][0]
    x = jax.random.normal(k4, (b, t, cfg.hidden_size))
    cast = functools.partial(jax.tree.map, lambda a: a.astype(jnp.dtype(dtype)))
    params, lora, x = cast(params), cast(lora), x.astype(jnp.dtype(dtype))
    norms = {n: params[n] for n in ("input_layernorm", "post_attention_layernorm")}
    frozen = {k: v for k, v in params.items() if k not in norms}

    def fn(x, lora, norms):
        return block({**frozen, **norms}, lora, x, cfg, lcfg, backend=backend)

    def ref(x, lora, norms):
        return block_reference({**frozen, **norms}, lora, x, cfg, lcfg)

    fn.__name__, ref.__name__ = f"block[{backend}]", "block_reference"
    return fn, ref, (x, lora, norms)


def _child(a) -> int:
    """One measurement in this (fresh) process: a JSON line tagged CHILD_TAG."""
    import jax
    from jax import monitoring

    from jaxgrad.verify import check_vjp

    fn, ref, args = build_block(a.backend, a.seed, a.dtype)
    jax.block_until_ready(args)
    compiles: list[float] = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    monitoring.register_event_duration_secs_listener(listen)
    t0 = time.perf_counter()
    report = check_vjp(fn, ref, *args, seed=a.seed)
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "compiles": len(compiles), "compile_s": sum(compiles), "passed": report.passed,
           "timings": getattr(report, "timings", {}) or {}}
    if a.second_call:
        n0 = len(compiles)
        t0 = time.perf_counter()
        check_vjp(fn, ref, *args, seed=a.seed)
        out["second_call_s"], out["second_call_compiles"] = time.perf_counter() - t0, len(compiles) - n0
    if a.print_report:
        print(report, flush=True)
    print(CHILD_TAG + json.dumps(out), flush=True)
    return 0


def _pythonpath() -> str:
    """The caller's ``PYTHONPATH`` with this checkout in front: the child imports the same ``jaxgrad``."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgrad.bench verify_cost",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("xla", "pallas", "mosaic"), default="xla",
                    help="the block's backend (fn); the reference is the plain XLA block either way")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes, one check_vjp each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--second-call", action="store_true", help="also time a second check_vjp in the same process")
    ap.add_argument("--print-report", action="store_true", help="print each repeat's report")
    ap.add_argument("--out", default=None, help="also write the results into this folder (named as the module says)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.child:
        return _child(a)

    from jaxgrad.bench.harness import environment

    env = environment()
    print(f"# device: {env['device_kind']} ({env['platform']}, {env['device']}); jax {env['jax']}, jaxlib "
          f"{env['jaxlib']}, python {env['python']}; host {env['hostname']}, {os.cpu_count()} CPUs")
    print(f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}")
    print(f"# block: hidden 64, seq 24, GQA 4/2 heads, r 8 on 7 projections, {a.dtype}, backend {a.backend}; "
          f"check_vjp defaults, seed {a.seed}", flush=True)
    cmd = [sys.executable, "-m", "jaxgrad.bench.verify_cost", "--child", "--backend", a.backend, "--seed", str(a.seed),
           "--dtype", a.dtype] + (["--second-call"] if a.second_call else []) + \
        (["--print-report"] if a.print_report else [])
    runs = []
    for i in range(a.repeats):
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = float("nan")
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath(),
                                                                         "JAXGRAD_COMMIT": env["commit"],
                                                                         "JAXGRAD_DIRTY": env["dirty"]})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_TAG)]
        if proc.returncode != 0 or not lines:
            sys.stdout.write(proc.stdout)
            sys.stderr.write(proc.stderr[-4000:])
            print(f"repeat {i}: the measuring process failed (exit {proc.returncode})")
            return 1
        if a.print_report:
            sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith(CHILD_TAG))
                             + "\n")
        r = json.loads(lines[-1][len(CHILD_TAG):])
        r["load_before"] = load
        runs.append(r)
        extra = (f"; second call {r['second_call_s']:.2f} s, {r['second_call_compiles']} compilations"
                 if "second_call_s" in r else "")
        print(f"repeat {i}: first call {r['wall_s']:.2f} s wall, {r['compiles']} XLA compilations taking "
              f"{r['compile_s']:.2f} s, verdict {'PASS' if r['passed'] else 'FAIL'} (load average before "
              f"{load:.2f}){extra}", flush=True)
        if r["timings"]:
            print("  stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["timings"].items()), flush=True)
    best = {"wall_s": min(r["wall_s"] for r in runs), "compiles": min(r["compiles"] for r in runs),
            "compile_s": min(r["compile_s"] for r in runs)}
    stages = list(dict.fromkeys(k for r in runs for k in r["timings"]))
    best_stages = {k: min(r["timings"].get(k, float("inf")) for r in runs) for k in stages}
    print(f"min over {len(runs)}: first call {best['wall_s']:.2f} s wall, {best['compiles']} XLA compilations taking "
          f"{best['compile_s']:.2f} s")
    if best_stages:
        print("  stages (s, each the min over the repeats): "
              + ", ".join(f"{k} {v:.2f}" for k, v in best_stages.items()))
    paths = [a.json] if a.json else []
    if a.out:
        from jaxgrad.bench.harness import precision_slug, result_stem

        pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
        stem = result_stem(f"verify-cost-{a.backend}", env, precision_slug(None, (), env["platform"]))
        paths.append(str(pathlib.Path(a.out) / f"{stem}.json"))
    for path in paths:
        with open(path, "w") as f:
            json.dump({"environment": env, "args": vars(a), "runs": runs, "min": best, "min_stages": best_stages}, f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
