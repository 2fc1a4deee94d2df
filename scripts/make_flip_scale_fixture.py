"""Write ``tests/data/conv_relu_flip_scale_fixture.npz``: a leaf whose few ReLU flips once looked like a scale error.

Run 425 of ``scripts/verify_false_alarms.py --mode cpu --seed 2`` (session 13): a correct conv3x3 + ReLU in bf16
arrays, judged at bf16 with 32 replicas. Its weight gradient (3x3x4x6, all 216 entries behind ReLU masks whose
pre-activations lie within bf16 rounding of zero) carries three flips of about -0.3 on heavily weighted entries
(rounding sd ~0.01, worst-case jump K ~6). Gated from the ungated scale estimate, they were absorbed into beta
(-1.41e-2 against a limit of 1.2e-2: a false alarm); gated from beta = 0 they are flips. The file holds what
``leaf_statistics`` judged: ``e`` (fn's error against the float64 oracle), ``replicas``, ``g`` (the oracle) and
``kink`` (the entries' jumps). ``tests/test_verify_statistics.py`` uses it. Usage: ``python
scripts/make_flip_scale_fixture.py`` (CPU, seconds).
"""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import verify_false_alarms as fa  # noqa: E402
import jaxgrad.verify.core as core  # noqa: E402
from jaxgrad.verify import stats  # noqa: E402

SHAPE = (3, 3, 4, 6)


def main() -> None:
    captured = []
    judge = stats.leaf_statistics

    def capture(e, replicas, g_ref, precision, kink=None, *args, **kwargs):
        if np.shape(e) == SHAPE:
            captured.append((np.asarray(e), np.asarray(replicas), np.asarray(g_ref), np.asarray(kink)))
        return judge(e, replicas, g_ref, precision, kink, *args, **kwargs)

    core.leaf_statistics = capture  # check_vjp's own reference to it
    try:
        fa.run_one(fa.draw(425, 2, "cpu"), "cpu")
    finally:
        core.leaf_statistics = judge
    e, r, g, kink = captured[0]
    out = ROOT / "tests" / "data" / "conv_relu_flip_scale_fixture.npz"
    np.savez_compressed(out, e=e, replicas=r, g=g, kink=kink)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
