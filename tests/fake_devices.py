"""Checks on fake CPU devices: the device count must be set before JAX starts, so each check is a script run in a
subprocess of its own that prints one ``REPORT <json>`` line; :func:`run_report` runs it and returns the report."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_report(script: str, *, timeout: float = 600) -> dict:
    """Run ``script`` with ``python -c`` on the CPU backend and return its ``REPORT`` JSON. XLA's backend
    optimisation is off: the checks are dominated by compile time, and the unoptimised CPU backend compiles faster
    with the same arithmetic (no fast-math; every comparison is between two programs of the same flags)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")]
    return json.loads(line[len("REPORT"):])
