"""Write ``tests/data/attention_dv_slice_fixture.npz``: one leaf of a real VJP whose rounding differs from slice to slice.

The leaf is ``dv`` of our f32 attention VJP (GQA, right-padded mask; ``tests/test_lora_ops.py``'s case) as
``check_vjp`` judges it with 32 replicas at seed 0: ``e`` (fn's error against the float64 oracle), ``replicas``
(the emulated reference's errors) and ``g`` (the oracle). Our VJP recomputes ``P = exp(S - lse)`` from the saved
log-sum-exp, the reference differentiates its softmax: along the key axis fn's slice sums of ``z^2`` measured 1.3-2.9x
the replicas' (64 perturbed runs), with the entries' median ratio below 1. ``tests/test_verify_statistics.py`` keeps
the slice test honest on it. Usage: ``python scripts/make_attention_slice_fixture.py`` (CPU, seconds).
"""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jaxgrad.verify.core as core  # noqa: E402
from jaxgrad.ops.attention import attention, attention_reference  # noqa: E402
from jaxgrad.verify import check_vjp  # noqa: E402

B, T, HQ, HKV, D = 2, 7, 3, 1, 8


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    key = lambda s: jax.random.key(s)  # noqa: E731 - the test's _qkv(8, f32)
    q = jax.random.normal(key(8), (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(key(9), (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(key(10), (B, T, HKV, D), jnp.float32)
    right = jnp.array([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]])
    seen = {}
    judge = core.leaf_statistics

    def spy(e, r, g, *a, **kw):
        if np.shape(e) == v.shape:
            seen.update(e=np.asarray(e), replicas=np.asarray(r), g=np.asarray(g))
        return judge(e, r, g, *a, **kw)

    core.leaf_statistics = spy
    try:
        check_vjp(functools.partial(attention, attention_mask=right),
                  functools.partial(attention_reference, attention_mask=right), q, k, v, replicas=32, seed=0)
    finally:
        core.leaf_statistics = judge
    out = ROOT / "tests" / "data" / "attention_dv_slice_fixture.npz"
    np.savez_compressed(out, **seen)
    print(f"wrote {out} ({out.stat().st_size} bytes): e {seen['e'].shape}, replicas {seen['replicas'].shape}")


if __name__ == "__main__":
    main()
