r"""The ``llama_memory`` tool: what a ``llama_real`` training step holds in device memory, buffer by buffer.

    python -m jaxgrad.bench llama_memory --model 1b|8b [--qlora] [--layers N] [--batch B] [--seq T] [--tiny]
                                         [--variant "jaxgrad recompute=all"] [--top N] [--out DIR]

The step of one ``jaxgrad`` variant of :mod:`jaxgrad.bench.llama_real` (the same spec and variant names) is compiled
at abstract arguments (nothing is built or run) in a child process whose XLA dumps its buffer assignment
(``--xla_dump_to``); the tool reads XLA's memory-usage report of the step and lists its largest buffers with their
shapes, beside ``memory_analysis()``'s argument / output / temporary totals. A buffer's shapes name what it holds
(``bf16[2,4096,14336]``: one MLP activation of Llama-3.1-8B at micro-batch 2 x 4096; ``u8[...]``: unpacked NF4
codes). The report is written to ``DIR/llama_memory_<model>[_qlora]-<device>-<date>.txt``, headed by the device,
versions, commit and command line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

from jaxgrad.bench import fresh_process
from jaxgrad.bench import llama_real as real

TOOL = "llama_memory"
MODULE = "jaxgrad.bench.llama_memory"
MEMORY_TAG = "MEMORY "
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
#: a value row of XLA's memory-usage report: ``cumulative_size; size; offset; used_by_n_values; shapes_list``
_ROW = re.compile(r"^\s*([\d.]+)(B|KiB|MiB|GiB|TiB)\(\s*[\d.]+%\);\s*([\d.]+)(B|KiB|MiB|GiB|TiB);\s*(\d+);\s*(\d+);"
                  r"\s*(.*)$")


def parse_memory_report(text: str) -> list[tuple[int, str, str]]:
    """``[(bytes, memory space, shapes), ...]`` of every buffer row of an XLA memory-usage report, largest first."""
    rows, space = [], "default"
    for line in text.splitlines():
        if line.startswith("Memory Space:"):
            space = line.split(":", 1)[1].strip()
            continue
        m = _ROW.match(line)
        if m:
            rows.append((int(float(m.group(3)) * _UNITS[m.group(4)]), space, m.group(7).strip()))
    return sorted(rows, key=lambda r: -r[0])


def compile_step(s: dict, variant: str) -> dict:
    """Compile ``variant``'s step of spec ``s`` at abstract arguments; ``memory_analysis()``'s totals in bytes."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.lora.model import init_lora

    step, opt, _ = real.make_step(s, variant)
    cfg, lcfg = real.configs(s, variant)
    params = jax.eval_shape(lambda k: real.build_params(s, k), jax.random.key(0))
    lora = jax.eval_shape(lambda k: init_lora(k, cfg, lcfg, jnp.float32), jax.random.key(1))
    opt_state = jax.eval_shape(opt.init, lora)
    ids = jax.ShapeDtypeStruct((s["batch"], s["seq"]), jnp.int32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    ma = jax.jit(step, donate_argnums=(0, 1)).lower(lora, opt_state, params, ids, n).compile().memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "host_temp_size_in_bytes")
    return {f: int(getattr(ma, f, 0) or 0) for f in fields}


def run(s: dict, variant: str, *, timeout: float = 900) -> tuple[dict, list[tuple[int, str, str]]]:
    """``(memory_analysis totals, buffers)`` of the variant's step, compiled in a child process that dumps its buffer
    assignment."""
    with tempfile.TemporaryDirectory() as dump:
        root, env = fresh_process.child_env()
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), f"--xla_dump_to={dump}",
                                                  "--xla_dump_hlo_module_re=.*step.*"]))
        cmd = [sys.executable, "-m", MODULE, "--child", "--spec", json.dumps(s), "--variant", variant]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(root), timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MEMORY_TAG)]
        if proc.returncode or not lines:
            raise RuntimeError(f"{TOOL}: compiling {variant!r} failed:\n{proc.stderr[-3000:]}")
        reports = sorted(glob.glob(os.path.join(dump, "*memory-usage-report.txt")), key=os.path.getsize)
        if not reports:
            raise RuntimeError(f"{TOOL}: XLA wrote no memory-usage report (its dump flags are not supported here)")
        with open(reports[-1]) as f:
            return json.loads(lines[-1][len(MEMORY_TAG):]), parse_memory_report(f.read())


def report_lines(s: dict, variant: str, totals: dict, buffers, top: int) -> list[str]:
    gib = 2**30
    lines = [f"{variant}: arguments {totals['argument_size_in_bytes'] / gib:.2f} GiB, outputs "
             f"{totals['output_size_in_bytes'] / gib:.2f} GiB (aliased to arguments "
             f"{totals['alias_size_in_bytes'] / gib:.2f}), temporaries {totals['temp_size_in_bytes'] / gib:.2f} GiB, "
             f"host temporaries {totals['host_temp_size_in_bytes'] / gib:.2f} GiB",
             f"frozen weights {real.frozen_weight_bytes(s) / gib:.2f} GiB; the {top} largest of {len(buffers)} "
             "buffers of XLA's memory-usage report (MiB, memory space, shapes):"]
    lines += [f"  {b / 2**20:10.1f}  {space:<14}  {shapes[:160]}" for b, space, shapes in buffers[:top]]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m jaxgrad.bench {TOOL}", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(real.MODELS), required=True)
    p.add_argument("--qlora", action="store_true")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--variant", default="jaxgrad", help=f"a jaxgrad variant of llama_real: {real.VARIANTS[:4]}")
    p.add_argument("--checkpointing", default="none")
    p.add_argument("--backend", default="auto")
    p.add_argument("--top", type=int, default=30, help="buffers listed (default: %(default)s)")
    p.add_argument("--out", default="runs/bench")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.variant not in real.VARIANTS or not a.variant.startswith("jaxgrad"):
        parser.error(f"--variant must be a jaxgrad variant of llama_real {[v for v in real.VARIANTS if 'jaxgrad' in v]}"
                     f", got {a.variant!r}")
    try:
        s = real.make_spec(a.model, layers=a.layers, batch=a.batch, seq=a.seq, qlora=a.qlora, tiny=a.tiny,
                           checkpointing=a.checkpointing, backend=a.backend)
    except ValueError as err:
        parser.error(str(err))
    from jaxgrad.bench import environment as envmod

    env = envmod.environment()
    totals, buffers = run(s, a.variant)
    head = [f"device: {env['device_kind']} ({env['platform']}), jax {env['jax']}, jaxlib {env['jaxlib']}, python "
            f"{env['python']}, {env['datetime_utc']}",
            f"commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}",
            *real.header_lines(s)[:2]]
    lines = [f"# {h}" for h in head] + report_lines(s, a.variant, totals, buffers, a.top)
    print("\n".join(lines))
    os.makedirs(a.out, exist_ok=True)
    stamp = re.sub(r"[-:]", "", env["datetime_utc"][:19]).replace("T", "-")
    name = f"{TOOL}_{a.model}" + ("_qlora" if a.qlora else "") + ("_tiny" if a.tiny else "")
    path = os.path.join(a.out, f"{name}-{envmod.device_slug(env['device_kind'])}-{stamp}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--spec", required=True)
    p.add_argument("--variant", required=True)
    a = p.parse_args(argv)
    print(MEMORY_TAG + json.dumps(compile_step(json.loads(a.spec), a.variant)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]) if "--child" in sys.argv[1:] else main())
