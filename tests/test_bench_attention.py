"""The ``attention`` suite of ``python -m jaxgrad.bench`` (issue #13 item 2: cuDNN against our kernels, in numbers):
its variants compute the same gradients, and the suite runs here with a row per variant."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.bench import attention as ba


def test_flops_are_the_block_convention():
    from jaxgrad.bench.lora_block import block_flops

    s = ba.ATTENTION_SIZES["full"]
    blk = block_flops(batch=4, seq=2048, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632, r=16)
    assert ba.attention_flops(**s) == blk["attention_fwd"] + blk["attention_bwd"]


def test_variants_agree_on_the_gradients():
    # the same value and gradients from every variant (f32 inputs here: the differences are the kernels' own rounding)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cot = (jax.random.normal(kk, (1, 77, h, 32), jnp.float32) for kk, h in zip(keys, (4, 2, 2, 4)))
    out = {name: f(q, k, v, cot) for name, f in ba._variants(False).items()}
    ref = out.pop("jax.grad(reference)")
    for name, (val, grads) in out.items():
        np.testing.assert_allclose(val, ref[0], rtol=1e-4, err_msg=name)
        for g, r in zip(grads, ref[1]):
            np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4, err_msg=name)


def test_suite_runs_with_a_row_per_variant():
    rows = ba.suite_attention("small", "default", repeats=1, warmup=0)
    assert [r.variant for r in rows] == ["pallas flash", "xla (our VJP)", "jax.grad(reference)"]
    assert all(r.median_ms and r.suite == "attention" for r in rows)
