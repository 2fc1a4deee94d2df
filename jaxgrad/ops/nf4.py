r"""NF4 4-bit weights, byte-for-byte as bitsandbytes stores them (``quantize_4bit(..., quant_type="nf4")``).

The format is shared: :mod:`jaxgrad.ops.nf4_matmul` reads it, and the LoRA family's QLoRA path (frozen base weights
of :mod:`jaxgrad.lora`, ``jaxgrad.lora.hf.load_hf_checkpoint(quantize="nf4")``) stores its weights in it;
``jaxgrad.lora.nf4`` re-exports these names.

Format (bitsandbytes 0.50, ``backends/default/ops.py`` and ``functional.py``):

* **Code.** 16 float32 values, sorted, with an exact 0 (:data:`NF4_CODE`). They are normal quantiles
  normalised to [-1, 1]; the code is asymmetric (8 positive values, 7 negative ones).
* **Blocks.** The weight ``[out, in]`` is flattened row-major and cut into blocks of ``blocksize`` elements
  (default 64; a power of two from 32 to 4096). A final partial block is a block of its own.
* **Absmax.** ``absmax[b] = max |x|`` over block ``b``, in float32. A full block of zeros keeps ``absmax = 0``;
  bitsandbytes stores the *partial* last block's absmax clamped to ``float32(1e-38)`` (a subnormal). Both
  quirks are reproduced, so the bytes and the absmax array are identical.
* **Scaling.** Full blocks: ``scaled = clamp(x * (1 / max(absmax, 1e-38)), -1, 1)`` (a multiply by the float32
  reciprocal); the partial block: ``scaled = clamp(x / max(absmax, 1e-38), -1, 1)`` (a division). The two can
  differ by one ulp, which decides values that land exactly on a midpoint, so both are kept as bitsandbytes has
  them. A block of zeros scales to 0 and gets the code of 0.0 (index 7).
* **Index.** ``idx = #{midpoints m : m < scaled}`` with ``midpoints = (code[:-1] + code[1:]) / 2`` in float32
  (``torch.bucketize``, ``right=False``): a value exactly on a midpoint goes to the **lower** code.
* **Packing.** Two indices per byte, the first element in the **high** nibble: ``byte[i] = idx[2i] << 4 |
  idx[2i+1]``. An odd element count is padded with one ``scaled = 0`` element (index 7, so the last byte's low
  nibble is 7). ``packed`` has ``ceil(n / 2)`` bytes (bitsandbytes' ``[ceil(n/2), 1]`` tensor, flattened).
* **Dequantise.** ``NF4_CODE[idx] * absmax[block]`` in float32, then one cast to the compute dtype.
* **Double quantisation** (bitsandbytes ``compress_statistics=True``): ``offset = mean(absmax)`` (float32,
  torch's CPU summation order); ``absmax - offset`` is quantised blockwise with blocksize 256 against the 8-bit
  signed dynamic code (:data:`DYNAMIC_CODE`, bitsandbytes ``create_dynamic_map()``): ``absmax2 = max |.|`` per
  256-block (float32, unclamped), ``x * (1 / absmax2)``, nearest code with ties to the lower one, a zero block
  to index 0 (details in :func:`_double_quantize`). Stored: ``absmax`` as uint8 indices, ``absmax2`` (float32),
  ``offset`` (float32 scalar). The float32 absmax is recovered as ``DYNAMIC_CODE[q] * absmax2[block2]`` then
  ``+ offset`` (two roundings, never fused).

Agreement with bitsandbytes 0.50.2 itself (``tests/fixtures/nf4_bnb_fixture.npz``, made on an H200 machine by
``tests/fixtures/make_nf4_bnb_fixture.py``): on the CPU every NF4 byte, absmax, offset, absmax2 and dequantised value
is identical, except that bitsandbytes' *native CPU* kernel for the second level picks the farther of two
dynamic-code values for a few inputs within ~2e-5 of a midpoint (5 of 901 absmax values in the fixture; its
pure-torch kernel (by its source) and its CUDA kernel (measured) pick the nearest, as we do). On CUDA, values
within one ulp of an NF4 midpoint can round the other way, a zero block is stored as code 0 (-1.0) with absmax 0
(dequantising to -0.0 instead of 0.0), and the offset (a GPU reduction) can differ by up to 2 ulp.
``docs/lora_io.md`` has the table.

Quantisation runs in NumPy on the host (it is a one-off step when a checkpoint is loaded, and XLA's CPU backend
flushes subnormals to zero, which would change the stored absmax of a partial zero block). Dequantisation is JAX
and jit-able; :class:`NF4Weight` is a pytree whose leaves are the arrays, so it passes through ``jit``/``grad``
(as a frozen input) and ``device_put``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.checks import check_float_dtype

__all__ = [
    "NF4_CODE",
    "NF4_MIDPOINTS",
    "DYNAMIC_CODE",
    "DOUBLE_QUANT_BLOCKSIZE",
    "NF4Weight",
    "nf4_quantize",
    "nf4_dequantize",
    "check_nf4_weight",
    "nf4_absmax",
    "nf4_indices",
    "create_dynamic_map",
]

#: bitsandbytes' NF4 code (``get_4bit_type("nf4")``), index 0..15, exactly as its float32 table.
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
NF4_CODE.setflags(write=False)

#: Decision thresholds ``(code[i] + code[i+1]) / 2`` computed in float32, as bitsandbytes computes them.
NF4_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)
NF4_MIDPOINTS.setflags(write=False)

#: Blocksize of the second-level quantisation of the absmax values (bitsandbytes' fixed 256).
DOUBLE_QUANT_BLOCKSIZE = 256

_ABSMAX_FLOOR = np.float32(1e-38)  # bitsandbytes' clamp(min=1e-38), a float32 subnormal
_MIN_BLOCKSIZE, _MAX_BLOCKSIZE = 32, 4096


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=float32)`` on the CPU, bit for bit (checked against the table
    bitsandbytes 0.50.2 / torch 2.11 built, in ``tests/fixtures/nf4_bnb_fixture.npz``).

    ``step = (end - start) / (steps - 1)`` in float32; the first half of the points is ``start + step * i``, the
    second half ``end - step * (steps - 1 - i)``, each rounded **once** to float32 (torch's vectorised kernel
    uses a fused multiply-add). Here the expression is evaluated in float64, where it is exact (two 24-bit
    mantissas times a small integer), then rounded once.
    """
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    first = np.float64(start32) + step * i
    second = np.float64(end32) - step * (steps - 1 - i)
    return np.where(i < steps // 2, first, second).astype(np.float32)


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' 8-bit "dynamic" code (``functional.create_dynamic_map``), float32, sorted, 256 values.

    For exponent ``i = 0 .. max_exponent_bits - 1``: the means of consecutive points of
    ``linspace(0.1, 1, 2**(i + non_sign_bits - max_exponent_bits) + 1)`` (float32), times ``10**(i - 6)``
    (a float32 product), and their negations when signed; then 0 and 1.0; padded with zeros to 256; sorted.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n_items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        bounds = _torch_linspace_f32(0.1, 1.0, n_items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        bounds = _torch_linspace_f32(0.1, 1.0, additional_items + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    if len(data) != 2**total_bits:
        raise ValueError(f"create_dynamic_map: {len(data)} values for total_bits={total_bits}")
    data += [0.0] * (256 - len(data))  # bitsandbytes pads a smaller code with zeros to 256 entries
    return np.sort(np.array(data, dtype=np.float32))


#: The 8-bit signed dynamic code used for double quantisation.
DYNAMIC_CODE = create_dynamic_map()
DYNAMIC_CODE.setflags(write=False)
_DYNAMIC_MIDPOINTS = (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:]) / np.float32(2)


# --------------------------------------------------------------------------------------------- the pytree


@dataclasses.dataclass(frozen=True, eq=False)  # leaves are arrays: identity equality, no array truth values
class NF4Weight:
    """A 2-D weight ``[out, in]`` in bitsandbytes' NF4 layout (see the module docstring).

    Leaves (arrays): ``packed`` uint8 ``[ceil(n/2)]``; ``absmax`` float32 ``[n_blocks]``, or uint8 ``[n_blocks]``
    when double-quantised, with then ``absmax2`` float32 ``[ceil(n_blocks/256)]`` and ``offset`` float32 ``[]``
    (both ``None`` otherwise). Static: ``shape`` (out, in), ``blocksize``, ``dtype`` (the original weight's
    dtype name, as bitsandbytes' ``QuantState.dtype``).
    """

    packed: Any
    absmax: Any
    absmax2: Any
    offset: Any
    shape: tuple[int, int]
    blocksize: int
    dtype: str

    @property
    def size(self) -> int:
        return int(self.shape[0]) * int(self.shape[1])

    @property
    def n_blocks(self) -> int:
        return -(-self.size // self.blocksize)

    @property
    def double_quant(self) -> bool:
        return self.absmax2 is not None

    @property
    def nbytes(self) -> int:
        """Storage in bytes of all the leaves."""
        return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(self))


jax.tree_util.register_dataclass(
    NF4Weight, data_fields=["packed", "absmax", "absmax2", "offset"], meta_fields=["shape", "blocksize", "dtype"]
)


# --------------------------------------------------------------------------------------------- quantise


def _check_blocksize(blocksize: Any, name: str = "blocksize") -> int:
    if isinstance(blocksize, bool) or not isinstance(blocksize, (int, np.integer)):
        raise TypeError(
            f"{name} must be an int (a power "
            f"of two from {_MIN_BLOCKSIZE} to {_MAX_BLOCKSIZE}), got {blocksize!r}"
        )
    b = int(blocksize)
    if not (_MIN_BLOCKSIZE <= b <= _MAX_BLOCKSIZE) or b & (b - 1):
        raise ValueError(f"{name} must be a power of two from {_MIN_BLOCKSIZE} to {_MAX_BLOCKSIZE}, got {b}")
    return b


def _blockwise_scale(flat: np.ndarray, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    """(absmax [n_blocks], scaled [n]) by bitsandbytes' rules: full blocks multiply by the float32 reciprocal of
    max(absmax, 1e-38) and keep the unclamped absmax; the partial block divides and keeps the clamped one."""
    n = flat.size
    rem = n % blocksize
    full = n - rem
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = np.abs(blocks).max(axis=1) if blocks.shape[0] else np.zeros((0,), np.float32)
    inv = np.float32(1) / np.maximum(absmax, _ABSMAX_FLOOR)
    scaled = np.clip(blocks * inv[:, None], np.float32(-1), np.float32(1)).reshape(-1)
    if rem:
        tail = flat[full:]
        tail_absmax = np.maximum(np.abs(tail).max(), _ABSMAX_FLOOR)
        absmax = np.concatenate([absmax, tail_absmax[None]])
        scaled = np.concatenate([scaled, np.clip(tail / tail_absmax, np.float32(-1), np.float32(1))])
    return absmax.astype(np.float32), scaled.astype(np.float32)


def _bucketize(scaled: np.ndarray, midpoints: np.ndarray) -> np.ndarray:
    """Index of the code for each value: the number of midpoints strictly below it (ties to the lower code)."""
    return np.searchsorted(midpoints, scaled, side="left").astype(np.uint8)


def _pack_nibbles(idx: np.ndarray) -> np.ndarray:
    """Two 4-bit indices per byte, first element in the high nibble; an odd count is padded with index 7
    (the code of a padded ``scaled = 0``)."""
    if idx.size % 2:
        idx = np.concatenate([idx, _bucketize(np.zeros(1, np.float32), NF4_MIDPOINTS)])
    return ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)


def _torch_cpu_sum_f32(x: np.ndarray, lanes: int = 8) -> np.float32:
    """``torch.sum`` of a contiguous float32 vector on the CPU (single thread, AVX2: 8 lanes), bit for bit.

    ATen's ``vectorized_inner_sum``: the first ``lanes * (n // lanes)`` values are read as vectors and summed by
    ``row_sum`` -- 4 interleaved vector accumulators (``ilp_factor``) summed by ``multi_row_sum``'s 4-level
    cascade (a level is flushed into the next every ``2**max(4, ceil(log2(rows)) // 4)`` rows), left-over
    vectors into accumulator 0, then accumulators 1..3 into 0 --; a float32 scalar starts at 0, adds the tail
    values in order, then the vector's lanes in order. Torch splits reductions over more than 32768 values
    between threads; this restatement is the one-thread order (exact up to 32768 values).
    """
    f32 = np.float32
    x = np.ascontiguousarray(x, np.float32)
    n_vec = x.size // lanes
    vectors = x[: n_vec * lanes].reshape(n_vec, lanes)
    rows = n_vec // 4
    grouped = vectors[: rows * 4].reshape(rows, 4, lanes)
    levels = 4
    power = max(4, (int(np.ceil(np.log2(rows))) if rows > 1 else 0) // levels)
    step, mask = 1 << power, (1 << power) - 1
    acc = np.zeros((levels, 4, lanes), np.float32)
    i = 0
    while i + step <= rows:
        for _ in range(step):
            acc[0] += grouped[i]
            i += 1
        for j in range(1, levels):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * power)):
                break
    while i < rows:
        acc[0] += grouped[i]
        i += 1
    for j in range(1, levels):
        acc[0] += acc[j]
    partial = acc[0]
    for v in vectors[rows * 4 :]:
        partial[0] += v
    for k in range(1, 4):
        partial[0] += partial[k]
    total = f32(0)
    for v in x[n_vec * lanes :]:
        total = f32(total + v)
    for v in partial[0]:
        total = f32(total + v)
    return total


def _double_quantize(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(uint8 absmax, absmax2 float32, offset float32) of bitsandbytes' ``compress_statistics=True``.

    * ``offset = sum(absmax) / n_blocks`` in float32, summed in torch's CPU order (:func:`_torch_cpu_sum_f32`);
    * ``centred = absmax - offset`` (float32), cut into blocks of 256 (the last one may be partial);
    * ``absmax2 = max |centred|`` per block, *not* clamped (bitsandbytes' native blockwise kernels);
    * ``scaled = centred * (1 / absmax2)``, index = nearest :data:`DYNAMIC_CODE` value, ties to the lower one;
      a block of zeros (``absmax2 = 0``: e.g. a weight of a single NF4 block) gets index 0, as the native kernels
      give (0 * inf = nan, which their search sends to index 0); it dequantises to ``code[0] * 0 + offset =
      offset`` all the same.
    """
    offset = np.float32(_torch_cpu_sum_f32(absmax) / np.float32(absmax.size))
    idx, absmax2 = _quantize_centred_absmax((absmax - offset).astype(np.float32))
    return idx, absmax2, offset


def _quantize_centred_absmax(centred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Second level of double quantisation: (uint8 index, absmax2) of ``absmax - offset`` (see above)."""
    n = centred.size
    n_blocks2 = -(-n // DOUBLE_QUANT_BLOCKSIZE)
    padded = np.zeros(n_blocks2 * DOUBLE_QUANT_BLOCKSIZE, np.float32)
    padded[:n] = centred
    blocks = padded.reshape(n_blocks2, DOUBLE_QUANT_BLOCKSIZE)
    absmax2 = np.abs(blocks).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (blocks * (np.float32(1) / absmax2)[:, None]).reshape(-1)[:n]
    idx = _bucketize(scaled, _DYNAMIC_MIDPOINTS)
    idx[np.isnan(scaled)] = 0
    return idx, absmax2


def nf4_quantize(w: Any, blocksize: int = 64, double_quant: bool = False) -> NF4Weight:
    """Quantise a 2-D weight ``[out, in]`` to NF4, byte-identical to bitsandbytes' ``quantize_4bit(w,
    blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4")`` (see the module docstring).

    ``w`` is any float array (NumPy or JAX; bf16/f16/f32/f64), converted to float32 first (exact for bf16/f16).
    Runs on the host in NumPy; the leaves of the result are NumPy arrays (``jax.device_put`` it as needed).
    """
    blocksize = _check_blocksize(blocksize)
    if not isinstance(double_quant, (bool, np.bool_)):
        raise TypeError(f"double_quant must be a bool, got {double_quant!r}")
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"w must be an array [out, in], got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w must be a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"w must be non-empty, got shape {tuple(w.shape)}")
    dtype = np.dtype(w.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"w must be a floating-point array, got dtype {dtype.name}")
    flat = np.asarray(w).astype(np.float32).reshape(-1)
    if not np.all(np.isfinite(flat)):
        raise ValueError(
            f"w contains {int(np.sum(~np.isfinite(flat)))} "
            f"non-finite values (inf/nan); NF4 needs finite weights"
        )
    absmax, scaled = _blockwise_scale(flat, blocksize)
    packed = _pack_nibbles(_bucketize(scaled, NF4_MIDPOINTS))
    absmax2 = offset = None
    if double_quant:
        absmax, absmax2, offset = _double_quantize(absmax)
    return NF4Weight(
        packed=packed,
        absmax=absmax,
        absmax2=absmax2,
        offset=None if offset is None else np.asarray(offset, np.float32),
        shape=(int(w.shape[0]), int(w.shape[1])),
        blocksize=blocksize,
        dtype=dtype.name,
    )


# --------------------------------------------------------------------------------------------- dequantise


def _blockwise_expand(values: jax.Array, n_blocks: int, blocksize: int, n: int) -> jax.Array:
    """Per-block values repeated over their block, cut to the first ``n`` elements."""
    return jnp.broadcast_to(values[:, None], (n_blocks, blocksize)).reshape(-1)[:n]


def nf4_absmax(w: NF4Weight) -> jax.Array:
    """The float32 absmax per block; for a double-quantised weight ``DYNAMIC_CODE[q] * absmax2`` then ``+
    offset`` (an optimisation barrier between the two keeps XLA from fusing them into one FMA, which would round
    once instead of twice as bitsandbytes does)."""
    if not w.double_quant:
        return jnp.asarray(w.absmax, jnp.float32)
    n_blocks2 = -(-w.n_blocks // DOUBLE_QUANT_BLOCKSIZE)
    scale2 = _blockwise_expand(jnp.asarray(w.absmax2, jnp.float32), n_blocks2, DOUBLE_QUANT_BLOCKSIZE, w.n_blocks)
    product = jnp.asarray(DYNAMIC_CODE)[jnp.asarray(w.absmax).astype(jnp.int32)] * scale2
    product = jax.lax.optimization_barrier(product)
    return product + jnp.asarray(w.offset, jnp.float32)


def nf4_indices(w: NF4Weight) -> jax.Array:
    """The 4-bit code index of every element, row-major, length ``out * in`` (high nibble first)."""
    packed = jnp.asarray(w.packed, jnp.uint8)
    pairs = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)
    return pairs[: w.size]


def nf4_dequantize(w: NF4Weight, dtype: Any = jnp.float32) -> jax.Array:
    """``NF4_CODE[idx] * absmax[block]`` in float32, reshaped to ``[out, in]`` and cast to ``dtype``.

    Bit-identical to bitsandbytes' ``dequantize_4bit(packed, state)`` in float32 (and therefore after the
    same round-to-nearest cast). Jit-able (``w``'s shape, blocksize and dtype are static); called outside a
    trace it runs as one compiled computation per (shape, blocksize, dtype).
    """
    check_nf4_weight(w)
    check_float_dtype(dtype, "nf4_dequantize")
    return _dequantize_jit(w, jnp.dtype(dtype))


def check_nf4_weight(w: Any, name: str = "w", where: str = "nf4_dequantize") -> None:
    """``w`` must be an :class:`NF4Weight` whose leaves fit its static fields (``packed`` ``[ceil(n/2)]`` uint8,
    ``absmax`` ``[n_blocks]``, ``absmax2`` / ``offset`` for a double-quantised one): a leaf of another length would
    otherwise be broadcast or cut without a word. Shape checks only, so it works under ``jit``."""
    if not isinstance(w, NF4Weight):
        raise TypeError(f"{where}: '{name}' must be an NF4Weight (jaxgrad.ops.nf4.nf4_quantize), got "
                        f"{type(w).__name__}")
    shape = w.shape
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ValueError(f"NF4Weight '{name}': shape must be (out, in) with positive ints, got {shape!r}")
    _check_blocksize(w.blocksize, f"NF4Weight '{name}': blocksize")
    try:
        float_dtype = jnp.issubdtype(jnp.dtype(w.dtype), jnp.floating)
    except TypeError:
        float_dtype = False
    if not float_dtype:
        raise ValueError(f"NF4Weight '{name}': dtype must name the original floating dtype, got {w.dtype!r}")

    def expect(leaf, field, want_shape, kind):
        got = tuple(np.shape(leaf)) if leaf is not None else None
        ok_dtype = leaf is not None and (jnp.issubdtype(leaf.dtype, jnp.floating) if kind == "float"
                                         else np.dtype(leaf.dtype) == np.uint8)
        if got != want_shape or not ok_dtype:
            found = "None" if leaf is None else f"{np.dtype(leaf.dtype).name} {got}"
            raise ValueError(f"NF4Weight '{name}' {shape} (blocksize {w.blocksize}): '{field}' must be "
                             f"{'floating' if kind == 'float' else 'uint8'} {want_shape}, got {found}")

    expect(w.packed, "packed", (-(-w.size // 2),), "uint8")
    if w.absmax2 is None:
        expect(w.absmax, "absmax", (w.n_blocks,), "float")
        if w.offset is not None:
            raise ValueError(f"NF4Weight '{name}': 'offset' is set but 'absmax2' is None (double quantisation needs "
                             f"both)")
    else:
        expect(w.absmax, "absmax", (w.n_blocks,), "uint8")
        expect(w.absmax2, "absmax2", (-(-w.n_blocks // DOUBLE_QUANT_BLOCKSIZE),), "float")
        expect(w.offset, "offset", (), "float")


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(w: NF4Weight, dtype: Any) -> jax.Array:
    idx = nf4_indices(w).astype(jnp.int32)
    scale = _blockwise_expand(nf4_absmax(w), w.n_blocks, w.blocksize, w.size)
    values = jnp.asarray(NF4_CODE)[idx] * scale
    return values.reshape(w.shape).astype(dtype)
