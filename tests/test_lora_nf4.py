"""NF4 (``jaxgrad.ops.nf4``, re-exported as ``jaxgrad.lora.nf4``): bitsandbytes' own bytes, an independent
NumPy restatement, and properties.

The fixture ``tests/fixtures/nf4_bnb_fixture.npz`` was written by ``tests/fixtures/make_nf4_bnb_fixture.py`` with
bitsandbytes 0.50.2 (torch 2.11, CPU and CUDA of an H200 machine); see ``docs/lora_io.md``.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxgrad.ops import nf4
from jaxgrad.ops.nf4 import (
    DYNAMIC_CODE,
    NF4_CODE,
    NF4Weight,
    nf4_dequantize,
    nf4_quantize,
)

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "nf4_bnb_fixture.npz"
F32 = np.float32

# The NF4 code as lora.md section 3 lists it (typed in again: the restatement shares no constant with the module).
CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=F32,
)


def test_the_lora_family_path_names_the_same_objects():
    # jaxgrad.lora.nf4 is where QLoRA users import NF4 from: every public name there is the shared format's own
    from jaxgrad.lora import nf4 as lora_nf4

    assert set(lora_nf4.__all__) == set(nf4.__all__)
    for name in nf4.__all__:
        assert getattr(lora_nf4, name) is getattr(nf4, name), name


# --------------------------------------------------------------------------------------------- restatement


def restated_quantize(w: np.ndarray, blocksize: int) -> tuple[bytes, np.ndarray]:
    """bitsandbytes' NF4 quantisation, element by element: (packed bytes, absmax)."""
    flat = [F32(v) for v in np.asarray(w, F32).reshape(-1)]
    n = len(flat)
    thresholds = [F32((CODE[k] + CODE[k + 1]) / F32(2)) for k in range(15)]
    indices: list[int] = []
    absmax: list[np.float32] = []
    for start in range(0, n, blocksize):
        block = flat[start : start + blocksize]
        biggest = max(abs(v) for v in block)
        floor = max(biggest, F32(1e-38))
        is_partial = len(block) < blocksize
        absmax.append(floor if is_partial else biggest)
        reciprocal = F32(F32(1) / floor)
        for v in block:
            scaled = F32(v / floor) if is_partial else F32(v * reciprocal)
            scaled = min(max(scaled, F32(-1)), F32(1))
            indices.append(sum(1 for t in thresholds if scaled > t))  # on a threshold: the lower code
    if n % 2:
        indices.append(7)  # bitsandbytes pads the scaled values with one 0.0, whose code is index 7
    packed = bytes(indices[i] * 16 + indices[i + 1] for i in range(0, len(indices), 2))
    return packed, np.array(absmax, F32)


def restated_dequantize(packed: bytes, absmax: np.ndarray, shape: tuple[int, int], blocksize: int) -> np.ndarray:
    n = shape[0] * shape[1]
    out = np.empty(n, F32)
    for i in range(n):
        byte = packed[i // 2]
        index = byte >> 4 if i % 2 == 0 else byte & 15
        out[i] = CODE[index] * absmax[i // blocksize]
    return out.reshape(shape)


def restated_second_level(centred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest dynamic-code value (ties to the lower one) of ``centred / absmax2`` per 256-block; a zero block
    gives index 0."""
    idx, absmax2 = [], []
    for start in range(0, centred.size, 256):
        block = centred[start : start + 256]
        m = F32(np.max(np.abs(block)))
        absmax2.append(m)
        for v in block:
            if m == 0:
                idx.append(0)
                continue
            x = F32(v * F32(F32(1) / m))
            below = np.nonzero(DYNAMIC_CODE <= x)[0]
            lo = int(below[-1]) if below.size else 0
            hi = min(lo + 1, 255)
            mid = F32((DYNAMIC_CODE[lo] + DYNAMIC_CODE[hi]) / F32(2))
            idx.append(hi if x > mid else lo)
    return np.array(idx, np.uint8), np.array(absmax2, F32)


def normal(shape, seed=0, std=0.02):
    return (std * np.random.default_rng(seed).standard_normal(shape)).astype(F32)


# --------------------------------------------------------------------------------------------- restatement tests


@pytest.mark.parametrize(
    "shape, blocksize",
    [((3, 7), 64), ((10, 50), 64), ((10, 50), 128), ((64, 96), 64), ((33, 65), 32), ((5, 300), 256), ((2, 4100), 4096)],
)
def test_bytes_match_restatement(shape, blocksize):
    w = normal(shape, seed=sum(shape))
    q = nf4_quantize(w, blocksize)
    packed, absmax = restated_quantize(w, blocksize)
    assert q.packed.tobytes() == packed
    np.testing.assert_array_equal(q.absmax, absmax)
    deq = np.asarray(nf4_dequantize(q))
    np.testing.assert_array_equal(deq, restated_dequantize(packed, absmax, shape, blocksize))


def test_double_quant_matches_restatement():
    w = normal((160, 201), seed=5)  # 503 blocks: two level-two blocks, the second partial
    q = nf4_quantize(w, 64, double_quant=True)
    plain = nf4_quantize(w, 64)
    assert q.packed.tobytes() == plain.packed.tobytes()  # the 4-bit codes do not depend on double quantisation
    np.testing.assert_allclose(q.offset, np.mean(plain.absmax, dtype=np.float64), rtol=2**-23)
    idx, absmax2 = restated_second_level((plain.absmax - q.offset).astype(F32))
    np.testing.assert_array_equal(q.absmax, idx)
    np.testing.assert_array_equal(q.absmax2, absmax2)
    expect = (DYNAMIC_CODE[idx] * np.repeat(absmax2, 256)[: idx.size]).astype(F32) + q.offset
    np.testing.assert_array_equal(np.asarray(nf4.nf4_absmax(q)), expect)
    np.testing.assert_array_equal(np.asarray(jax.jit(nf4.nf4_absmax)(q)), expect)  # no FMA under jit


# --------------------------------------------------------------------------------------------- properties


def test_exact_zero_and_zero_blocks():
    w = normal((3, 50), seed=1)
    w.reshape(-1)[64:128] = 0  # a full block of zeros
    w.reshape(-1)[128:] = 0  # the partial block, all zeros
    w[0, 3] = 0.0
    q = nf4_quantize(w)
    deq = np.asarray(nf4_dequantize(q))
    assert deq[0, 3] == 0.0
    assert np.all(deq.reshape(-1)[64:] == 0.0) and not np.any(np.signbit(deq.reshape(-1)[64:]))
    assert q.absmax[1] == 0.0  # a full zero block keeps absmax 0
    assert q.absmax[2] == F32(1e-38)  # bitsandbytes clamps the partial block's absmax
    assert all(b == 0x77 for b in q.packed[32:])  # index 7 = 0.0 in both nibbles


def test_ties_go_to_the_lower_code():
    mid = (NF4_CODE[:-1] + NF4_CODE[1:]) / F32(2)
    for scale in (F32(1), F32(2), F32(0.5)):
        row = np.concatenate([[1.0], mid, np.nextafter(mid, F32(2))]).astype(F32) * scale
        q = nf4_quantize(row.reshape(1, -1))
        idx = np.asarray(nf4.nf4_indices(q))
        np.testing.assert_array_equal(idx[1:16], np.arange(15))  # on the midpoint: lower
        np.testing.assert_array_equal(idx[16:31], np.arange(1, 16))  # one ulp above: upper


def test_partial_block_and_odd_count():
    w = normal((3, 7), seed=2)  # 21 values: one partial block, an odd count
    q = nf4_quantize(w)
    assert q.packed.shape == (11,) and q.absmax.shape == (1,)
    assert q.packed[-1] & 0xF == 7  # the padding nibble
    assert q.absmax[0] == np.abs(w).max()
    w2 = normal((10, 50), seed=3)  # 500 = 7 full blocks + 52
    q2 = nf4_quantize(w2)
    assert q2.absmax.shape == (8,) and q2.absmax[-1] == np.abs(w2.reshape(-1)[448:]).max()


def test_nf4_error_on_gaussian_weights():
    w = normal((1024, 1024), seed=4)
    q = nf4_quantize(w)
    deq = np.asarray(nf4_dequantize(q))
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert 0.088 < rel < 0.096, rel  # lora.md: 0.092 at 4096x4096
    worst = np.abs(deq - w).reshape(-1, 64) / q.absmax[:, None]
    assert worst.max() <= (1 - 0.6961928009986877) / 2 * (1 + 1e-6)  # half the widest code gap


def test_double_quant_error_bound():
    w = normal((1024, 1024), seed=6)
    plain, dq = nf4_quantize(w), nf4_quantize(w, double_quant=True)
    recovered = np.asarray(nf4.nf4_absmax(dq))
    err = np.abs(recovered - plain.absmax)
    rel = err / plain.absmax
    assert rel.max() <= 0.01, rel.max()  # lora.md: up to 1.0 %, mean 0.16 %
    assert 0.001 < rel.mean() < 0.0025, rel.mean()
    # derived bound: half the widest gap of the dynamic code, times the block's absmax2
    half_gap = float(np.max(np.diff(DYNAMIC_CODE))) / 2
    bound = half_gap * np.repeat(dq.absmax2, 256)[: err.size] * (1 + 1e-5) + 2**-23 * plain.absmax
    assert np.all(err <= bound)
    rel_frob = np.linalg.norm(np.asarray(nf4_dequantize(dq)) - w) / np.linalg.norm(w)
    assert 0.088 < rel_frob < 0.096


def test_dequantize_jit_pytree_and_dtypes():
    w = normal((24, 40), seed=7).astype(ml_dtypes.bfloat16)
    for dq in (False, True):
        q = nf4_quantize(w, double_quant=dq)
        assert q.dtype == "bfloat16" and q.double_quant == dq
        eager = nf4_dequantize(q)
        jitted = jax.jit(nf4_dequantize, static_argnames="dtype")(jax.device_put(q))
        np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
        bf16 = nf4_dequantize(q, jnp.bfloat16)
        assert bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(bf16), np.asarray(eager).astype(ml_dtypes.bfloat16))
        leaves, treedef = jax.tree_util.tree_flatten(q)
        assert len(leaves) == (4 if dq else 2)
        back = jax.tree_util.tree_unflatten(treedef, leaves)
        assert isinstance(back, NF4Weight) and back.shape == (24, 40) and back.blocksize == 64
    assert q.nbytes < 24 * 40 * 2 / 3  # 4.1 bits per weight with double quantisation


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(w=np.zeros((4,), F32)), ValueError, "2-D"),
        (dict(w=np.zeros((2, 3, 4), F32)), ValueError, "2-D"),
        (dict(w=np.zeros((0, 4), F32)), ValueError, "non-empty"),
        (dict(w=np.zeros((4, 4), np.int32)), TypeError, "floating"),
        (dict(w=[[1.0]]), TypeError, "array"),
        (dict(w=np.array([[1.0, np.inf]], F32)), ValueError, "non-finite"),
        (dict(w=np.ones((4, 4), F32), blocksize=48), ValueError, "blocksize must be a power of two"),
        (dict(w=np.ones((4, 4), F32), blocksize=16), ValueError, "blocksize must be a power of two"),
        (dict(w=np.ones((4, 4), F32), blocksize=8192), ValueError, "blocksize"),
        (dict(w=np.ones((4, 4), F32), blocksize=64.0), TypeError, "blocksize"),
        (dict(w=np.ones((4, 4), F32), blocksize=True), TypeError, "blocksize"),
        (dict(w=np.ones((4, 4), F32), double_quant="yes"), TypeError, "double_quant"),
    ],
)
def test_bad_input(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        nf4_quantize(**kwargs)


def test_dequantize_rejects_other_types():
    with pytest.raises(TypeError, match="NF4Weight"):
        nf4_dequantize(np.zeros((4, 4), F32))


# --------------------------------------------------------------------------------------------- bitsandbytes itself


def _fixture():
    z = np.load(FIXTURE)
    return z, json.loads(str(z["meta"]))


def _cases():
    z = np.load(FIXTURE)
    return sorted({k.split("/")[1] for k in z.files if k.startswith("input/")})


def _quantize_case(z, name):
    m = json.loads(str(z[f"input/{name}/meta"]))
    w = z[f"input/{name}/w"]
    if m["dtype"] == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16)
    return nf4_quantize(w, m["blocksize"], m["double_quant"]), m


def test_fixture_provenance():
    z, meta = _fixture()
    assert meta["bitsandbytes"] == "0.50.2" and "cpu" in meta["devices"] and not meta["errors"]
    np.testing.assert_array_equal(np.array(meta["nf4_code"], F32), NF4_CODE)
    np.testing.assert_array_equal(np.array(meta["dynamic_code"], F32), DYNAMIC_CODE)  # torch.linspace restated
    np.testing.assert_array_equal(NF4_CODE, CODE)


@pytest.mark.parametrize("name", _cases())
def test_identical_to_bitsandbytes_cpu(name):
    z, _ = _fixture()
    q, m = _quantize_case(z, name)
    p = f"cpu/{name}/"
    assert q.packed.tobytes() == z[p + "packed"].tobytes()
    if not m["double_quant"]:
        assert q.absmax.dtype == z[p + "absmax"].dtype
        np.testing.assert_array_equal(q.absmax, z[p + "absmax"])
        np.testing.assert_array_equal(np.asarray(nf4_dequantize(q)), z[p + "dequant_f32"])
        out_dtype = jnp.bfloat16 if m["dtype"] == "bfloat16" else jnp.float32
        np.testing.assert_array_equal(np.asarray(nf4_dequantize(q, out_dtype)).astype(F32), z[p + "dequant"])
        return
    assert q.offset == z[p + "offset"]
    np.testing.assert_array_equal(q.absmax2, z[p + "absmax2"])
    np.testing.assert_array_equal(z[p + "code2"], DYNAMIC_CODE)
    # bitsandbytes' native CPU kernel of the second level (not its pure-torch one) sometimes takes the farther of
    # two code values; every such case must be an off-by-one within 3e-5 of their midpoint.
    theirs = z[p + "absmax"]
    differ = np.nonzero(q.absmax != theirs)[0]
    assert differ.size <= max(1, theirs.size // 100)
    plain = nf4_quantize(z[f"input/{name}/w"], m["blocksize"])
    for j in differ:
        x = F32((plain.absmax[j] - q.offset) * (F32(1) / q.absmax2[j // 256]))
        lo, hi = sorted((int(q.absmax[j]), int(theirs[j])))
        assert hi == lo + 1
        assert abs(x - (DYNAMIC_CODE[lo] + DYNAMIC_CODE[hi]) / 2) < 3e-5
    # with their second-level indices, the dequantised absmax and weights are bit-identical
    theirs_q = NF4Weight(q.packed, theirs, q.absmax2, q.offset, q.shape, q.blocksize, q.dtype)
    np.testing.assert_array_equal(np.asarray(nf4.nf4_absmax(theirs_q)), z[p + "absmax_dequant"])
    np.testing.assert_array_equal(np.asarray(nf4_dequantize(theirs_q)), z[p + "dequant_f32"])
    if differ.size == 0:
        np.testing.assert_array_equal(np.asarray(nf4_dequantize(q)), z[p + "dequant_f32"])


@pytest.mark.parametrize("name", _cases())
def test_against_bitsandbytes_cuda(name):
    """bitsandbytes on CUDA: identical NF4 bytes except the documented cases (values exactly on a midpoint, zero
    blocks); its second level from its own offset reproduced exactly."""
    z, meta = _fixture()
    if "cuda" not in meta["devices"]:
        pytest.skip("the fixture has no CUDA results")
    q, m = _quantize_case(z, name)
    p = f"cuda/{name}/"
    theirs = np.frombuffer(z[p + "packed"].tobytes(), np.uint8)
    ours_idx = np.stack([q.packed >> 4, q.packed & 15], -1).reshape(-1)
    their_idx = np.stack([theirs >> 4, theirs & 15], -1).reshape(-1)
    w = z[f"input/{name}/w"].reshape(-1)
    plain = nf4_quantize(z[f"input/{name}/w"], m["blocksize"])
    block_absmax = np.repeat(plain.absmax, m["blocksize"])[: w.size]
    differ = np.nonzero(ours_idx[: w.size] != their_idx[: w.size])[0]
    mids = (NF4_CODE[:-1] + NF4_CODE[1:]) / F32(2)
    for i in differ:
        if block_absmax[i] == 0 or block_absmax[i] == F32(1e-38):  # zero block: CUDA stores code 0 (-1.0)
            assert their_idx[i] == 0 and w[i] == 0
            continue
        scaled = w[i] / block_absmax[i]
        assert np.min(np.abs(mids - scaled)) <= 2**-23, (i, scaled)  # within an ulp of a midpoint
        assert abs(int(ours_idx[i]) - int(their_idx[i])) == 1
    assert ours_idx[w.size :].tolist() == their_idx[w.size :].tolist()  # the same padding nibble
    if "midpoints" not in name and "zero" not in name:
        assert differ.size == 0
    if m["double_quant"]:
        their_offset = z[p + "offset"]
        assert abs(float(their_offset) - float(q.offset)) <= 2**-21 * float(q.offset)  # GPU reduction order: 2 ulp seen
        idx, absmax2 = nf4._quantize_centred_absmax((plain.absmax - their_offset).astype(F32))
        if "zero" not in name:
            np.testing.assert_array_equal(idx, z[p + "absmax"])
            np.testing.assert_array_equal(absmax2, z[p + "absmax2"])
