"""The kernel backend shim: interpret mode off-GPU, Triton on GPU, masks that make edge blocks safe."""

import functools

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb


def test_interpret_is_automatic_off_gpu():
    assert pb.default_interpret() == (jax.default_backend() != "gpu")
    assert pb.resolve_interpret(None) == pb.default_interpret()
    assert pb.resolve_interpret(True) is True


@pytest.mark.parametrize("n, cap, want", [(1, 256, 16), (17, 256, 32), (129, 256, 256), (5000, 256, 256)])
def test_block_size_is_a_power_of_two_within_bounds(n, cap, want):
    assert pb.block_size(n, cap) == want


def test_block_size_rejects_empty():
    with pytest.raises(ValueError, match="n must be >= 1"):
        pb.block_size(0, 16)


def _copy_plus_one(x, block):
    def kernel(x_ref, o_ref):
        mask = pb.block_mask(block, x.shape)
        pb.masked_store(o_ref, pb.masked_load(x_ref, mask) + 1, mask)

    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    return pb.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1])),
                          in_specs=[spec], out_specs=spec, name="copy_plus_one")(x)


@pytest.mark.parametrize("shape", [(1, 1), (7, 129), (33, 16)])
def test_masked_edge_blocks_read_and_write_only_inside(shape):
    x = jax.random.normal(jax.random.key(0), shape)
    np.testing.assert_array_equal(_copy_plus_one(x, (8, 32)), x + 1)


@pytest.mark.gpu
def test_masked_edge_blocks_on_gpu():
    x = jax.random.normal(jax.random.key(0), (7, 129))
    np.testing.assert_array_equal(jax.jit(functools.partial(_copy_plus_one, block=(8, 32)))(x), x + 1)
    assert "Triton" in pb.describe()
