"""How long one detection trial takes, per part (the case's runs vs the statistics), at one op and size.

    JAX_PLATFORMS=cuda python -m jaxgrad.bench verify_detection_timing --op attention --size 1000000 --trials 3

Prints a header (device, versions, commit, command) and one line per trial: seconds in ``leaf_errors`` (the kernel,
16 replicas and the float64 oracle) and in ``judge`` (the statistics at every planted scale). It tells whether a
cell of ``verify_detection_limits`` fits a run's time budget before one is spent on it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxgrad.bench import verify_detection_limits as vdl  # noqa: E402
from jaxgrad.bench.harness import environment  # noqa: E402
from jaxgrad.verify.calibration import OPS, leaf_errors, make_case  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgrad.bench verify_detection_timing",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=OPS, default="attention")
    ap.add_argument("--size", type=int, default=262144)
    ap.add_argument("--precision", default="f16")
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args(argv)
    env = environment()
    print(f"# device: {env['device_kind']} ({env['platform']}); jax {env['jax']}, python {env['python']}")
    print(f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}", flush=True)
    rng = np.random.default_rng(0)
    for trial in range(a.trials):
        case = make_case(a.op, a.size, a.precision, rng)
        t0 = time.time()
        err = leaf_errors(case, a.precision, 16, rng)
        t1 = time.time()
        vdl.judge(err, vdl.SCALES, a.precision, rng)
        print(f"{a.op} {a.precision} {err.error.size} entries, trial {trial}: leaf_errors {t1 - t0:.1f} s, "
              f"judge {time.time() - t1:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
