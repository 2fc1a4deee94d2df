"""The GPU's TF32 paths round their f32 operands to nearest (``python -m jaxgrad.bench tf32_rounding``).

The verifier's rounding model (:mod:`jaxgrad.verify.stats`) takes TF32 products as operands rounded to nearest even:
a path that truncated them would carry a systematic ``-u_tf32``-sized bias per product, which the scale test reports
as a bug instead of absorbing it as rounding. On a new GPU this is the first thing to check."""

import pytest

from jaxgrad.bench import tf32_rounding


@pytest.mark.gpu
def test_cublas_cudnn_and_triton_tf32_paths_round_to_nearest():
    results = tf32_rounding.measure()
    assert set(results) == {"xla dot (cuBLAS), default precision", "xla conv (cuDNN), default precision",
                            "pallas triton dot"}
    assert {name: r.get("verdict", r.get("error")) for name, r in results.items()} == \
        {name: "round to nearest" for name in results}


def test_off_a_gpu_the_same_paths_are_exact_f32():
    # the CPU computes f32 products exactly in f32: the measurement tells that apart from either TF32 rounding
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("the CPU's f32 products")
    results = tf32_rounding.measure()
    assert {r["verdict"] for r in results.values()} == {"exact f32"}
    assert all(r["d_ex"] < r["d_rn"] / 100 for r in results.values())
