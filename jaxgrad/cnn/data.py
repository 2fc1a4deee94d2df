r"""Cryo-EM particle stacks (MRC files) and shuffled, memory-bounded batch streams for a denoising CNN.

Reading MRC stacks
------------------
:func:`open_stack` memory-maps a file with ``mrcfile.mmap(path, mode="r")`` and returns an :class:`MRCStack`:
``len(stack)`` particles of ``H x W`` pixels (``stack.shape == (n, H, W)``); a single 2-D image is a stack of 1,
and a 3-D volume (space group 1) is read as the stack of its z-sections. Accepted MRC modes (``SUPPORTED_MODES``):

====  =========  ============================
mode  on disk    read as
====  =========  ============================
0     int8       float32 (exact)
1     int16      float32 (exact)
2     float32    float32
6     uint16     float32 (exact)
12    float16    float32 (exact)
====  =========  ============================

Rejected with :class:`MRCFormatError` (a ``ValueError`` whose message starts with the file's path): the complex
modes 3 and 4, mode 101 (4-bit) and unknown modes (the message names the mode and the accepted ones); files shorter
than the 1024-byte header or without the ``MAP`` identifier / with an unreadable machine stamp (the last two only
with ``permissive=False``, mrcfile's own checks); non-positive dimensions; volume stacks (4-D data); **truncated**
files (fewer bytes after the header than ``nx * ny * nz * itemsize``; the message says how many particles are
complete); and, when particles are read, **non-finite pixels** (NaN/inf in the float modes; the message names the
particle's 0-based index). Files *longer* than the header says are accepted (mrcfile warns).

:meth:`MRCStack.read` returns a float32 copy ``[k, H, W]`` and then drops the pages it touched from the process'
mapping (``madvise(MADV_DONTNEED)``; the data stays in the OS page cache). Without this, every page of a memory
map that was ever read counts in the process' resident set (RSS) until the map is closed, so streaming through a
200 MB stack would raise the RSS by 200 MB although nothing holds on to that data.

Writing
-------
:func:`write_stack` writes an in-memory array; :func:`stack_writer` creates a stack of a given shape and fills it
in pieces through a memory map (for stacks larger than RAM). Both write to a hidden temporary file next to the
target and move it into place only when the file is complete, and refuse to replace an existing file unless
``overwrite=True``: an interrupted write never leaves a half-written stack nor destroys the previous file.

Streaming batches: the chunked shuffle buffer
---------------------------------------------
:class:`ParticleStream` yields float32 batches ``[B, H, W, 1]`` (NHWC, one channel) -- or ``(input, target)``
pairs for Noise2Noise -- from one or more stacks, which may be much larger than RAM. ``stream.epoch(e)`` is a
generator whose batches are a deterministic function of ``(seed, e)``; ``stream.epoch(e)`` can be called again (the
same batches) and epochs can be visited in any order.

One epoch with ``shuffle=True``:

1. every stack is cut into *chunks* of ``chunk_size`` contiguous particles (the last chunk of a stack may be
   shorter); the chunks of all stacks are put in a random order;
2. chunks are read, in that order, into a preallocated buffer of ``buffer_size`` slots as long as the next chunk
   fits; when it does not (or no chunk is left), one batch of ``batch_size`` slots chosen uniformly at random
   without replacement is removed from the buffer and emitted; repeat;
3. when all chunks have been read the buffer is drained in random batches; the final ``n mod batch_size``
   particles form a last, smaller batch when ``drop_last=False`` and are dropped otherwise (which ones is random).

Every particle is read exactly once per epoch, so with ``drop_last=False`` each appears in exactly one batch.

**Bounded memory** means: the buffer is the only place particles are held between reads, it has exactly
``buffer_size`` slots (``stream.buffer_nbytes = buffer_size * H * W * 4`` bytes, doubled for pairs), and it is
allocated when an epoch starts and released when the epoch's generator finishes or is closed. Beyond it, at any
time there are one batch being assembled (and its normalisation temporaries, ``B * H * W`` floats) and the batches
the caller still holds; pages of the memory maps are dropped right after each chunk is copied (see above).
``stream.peak_buffered`` records the largest number of particles ever resident in the buffers of this stream
(summed over epoch generators running at the same time -- run one at a time for the bound to hold).

**Shuffle quality.** The order is not a uniform permutation of the dataset; it is "locally" random: the buffer
holds about ``buffer_size / chunk_size`` chunks from random places of the dataset, and each batch is a uniform
sample of the buffer. Consequences, with ``S = buffer_size``, ``c = chunk_size``, ``B = batch_size``:

* a particle waits in the buffer a geometric number of batches, on average about ``S / B``, so particles of one
  chunk (neighbours in the file, often from the same micrograph) end up spread over roughly the next ``S / B``
  batches rather than over the whole epoch;
* in a batch, a given particle has on average about ``(c - 1) * B / (2 S)`` companions from its own chunk (for
  ``B << S``: a chunk-mate is still buffered with probability ~``1 / 2`` averaged over the particle's wait, and then
  drawn into the same batch with probability ``B / S``); 0 for ``c = 1``, which is a perfect shuffle when
  ``S >= n``;
* the default ``chunk_size = max(1, S // 16)`` keeps ~16 chunks' worth of particles in the buffer (about
  ``B / 32`` same-chunk companions per batch) while reading contiguous runs of ``S / 16`` particles; a smaller
  ``chunk_size`` shuffles better at the price of more, smaller reads (cheap on SSDs and from the page cache).

``chunk_size`` must not exceed ``buffer_size - batch_size + 1``, so that a chunk always fits once fewer than
``batch_size`` particles are buffered. With ``shuffle=False`` batches are consecutive particles in file order
(sources in the order given) and at most one batch is buffered.

Normalisation: ``normalize="per_particle"`` maps every image (input and target separately) to zero mean and unit
standard deviation over its pixels (mean and std accumulated in float64); a constant image (std 0, or std below
``1e-6 * |mean|``, i.e. rounding noise) becomes all zeros instead of being divided by ~0. ``normalize=None`` keeps
the values.

Noise2Noise pairs: ``ParticleStream(None, B, pairs=(inputs, targets), ...)`` where ``inputs`` and ``targets`` are
each a stack or a list of stacks, aligned one-to-one (e.g. even- and odd-frame half-sums of the same particles):
the pair ``(inputs[k][i], targets[k][i])`` always stays together (same index, same slot, shuffled jointly), and the
stream yields ``(x, y)`` with ``x.shape == y.shape == (B, H, W, 1)``. Lengths and image shapes must match (the
error names both files). For synthetic pairs see :mod:`jaxgrad.cnn.synthetic`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mrcfile
import numpy as np

__all__ = ["SUPPORTED_MODES", "ArrayStack", "MRCFormatError", "MRCStack", "ParticleStream", "normalize_per_particle",
           "open_stack", "stack_writer", "write_stack"]

#: MRC mode -> on-disk dtype, for the modes :func:`open_stack` accepts.
SUPPORTED_MODES: dict[int, np.dtype] = {0: np.dtype(np.int8), 1: np.dtype(np.int16), 2: np.dtype(np.float32),
                                        6: np.dtype(np.uint16), 12: np.dtype(np.float16)}
_MODE_NAMES = {0: "int8", 1: "int16", 2: "float32", 3: "complex int16", 4: "complex float32", 6: "uint16",
               12: "float16", 101: "4-bit"}
_HEADER_BYTES = 1024
_CONSTANT_RTOL = 1e-6


class MRCFormatError(ValueError):
    """An MRC file that cannot be used as a particle stack (the message starts with the file's path)."""


def _supported_text() -> str:
    return ", ".join(f"{m} ({_MODE_NAMES[m]})" for m in SUPPORTED_MODES)


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------

class _PageReleaser:
    """Drops byte ranges of a memory-mapped array's pages from this process (``madvise(MADV_DONTNEED)``).

    For a read-only map the pages are re-read from the page cache on the next access; for a shared writable map
    (the stack writer) Linux keeps dirty pages in the page cache and writes them back, so no data is lost. Best
    effort: where ``madvise`` is missing it does nothing, which only affects the RSS, never the data.
    """

    def __init__(self, array: np.ndarray, *, writable: bool = False):
        self._mm = None
        self._offset = 0
        if writable and not sys.platform.startswith("linux"):
            return  # the no-data-loss guarantee for dirty shared pages is Linux's
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "base", None)
        if base is None or not hasattr(base, "madvise") or array.size == 0:
            return
        probe = np.frombuffer(base, dtype=np.uint8, count=1)
        self._offset = array.__array_interface__["data"][0] - probe.__array_interface__["data"][0]
        del probe  # a live export would keep the mmap from closing
        self._mm = base

    def release(self, lo: int, hi: int) -> None:
        """Release bytes ``[lo, hi)`` of the array (widened to whole pages)."""
        if self._mm is None or hi <= lo:
            return
        lo += self._offset
        hi += self._offset
        lo -= lo % mmap.PAGESIZE
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            self._mm = None

    def close(self) -> None:
        self._mm = None


def _check_finite(images: np.ndarray, name: str, first_index: int | np.ndarray) -> None:
    """Raise :class:`MRCFormatError` naming the first particle of ``images [k, H, W]`` with a NaN/inf pixel."""
    finite = np.isfinite(images).all(axis=(1, 2))
    if finite.all():
        return
    k = int(np.argmin(finite))
    index = int(first_index + k) if np.isscalar(first_index) else int(np.asarray(first_index)[k])
    bad = int(images[k].size - np.isfinite(images[k]).sum())
    raise MRCFormatError(f"{name}: particle {index} (0-based) contains {bad} non-finite pixel(s) (NaN/inf)")


def _as_index_array(indices, n: int, name: str) -> np.ndarray:
    if isinstance(indices, slice):
        return np.arange(n)[indices]
    idx = np.asarray(indices)
    if idx.dtype == bool or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
        raise TypeError(f"{name}: 'indices' must be integers or a slice, got dtype {idx.dtype}")
    idx = np.atleast_1d(idx).astype(np.int64, copy=False)
    if idx.ndim != 1:
        raise ValueError(f"{name}: 'indices' must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = idx[(idx < -n) | (idx >= n)][0]
        raise IndexError(f"{name}: particle index {bad} out of range for a stack of {n}")
    return np.where(idx < 0, idx + n, idx)


def _runs(idx: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, stop)`` of consecutive values in the sorted unique ``idx``."""
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [idx.size]])
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops)]


class MRCStack:
    """A memory-mapped MRC particle stack (see the module docstring). Create it with :func:`open_stack`.

    Attributes: ``path`` (``Path``), ``shape`` (``(n, H, W)``), ``dtype`` (on-disk numpy dtype), ``mode`` (MRC mode),
    ``voxel_size`` (pixel size along x in Angstrom, as in the header; 0.0 when unset). Use it as a context manager or
    call :meth:`close`.
    """

    def __init__(self, path: Path, mrc, data: np.ndarray, mode: int, voxel_size: float):
        self.path = path
        self._mrc = mrc
        self._data = data  # [n, H, W] view of the memory map
        self.shape: tuple[int, int, int] = tuple(int(s) for s in data.shape)
        self.dtype = np.dtype(data.dtype).newbyteorder("=")
        self.mode = mode
        self.voxel_size = voxel_size
        self._pages = _PageReleaser(data)
        self._particle_bytes = self.shape[1] * self.shape[2] * data.dtype.itemsize

    # -- basic protocol
    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def closed(self) -> bool:
        return self._mrc is None

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.shape[0]} x {self.shape[1]} x {self.shape[2]}"
        return f"MRCStack('{self.path}', {state}, mode {self.mode} ({_MODE_NAMES[self.mode]}))"

    def __enter__(self) -> MRCStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the memory map (idempotent). Arrays returned by :meth:`read` are copies and stay valid."""
        if self._mrc is not None:
            self._data = None
            self._pages.close()
            mrc, self._mrc = self._mrc, None
            mrc.close()

    def _require_open(self) -> None:
        if self._mrc is None:
            raise ValueError(f"{self.path}: the stack is closed")

    def _release(self, start: int, stop: int) -> None:
        """Drop the mapped pages of particles ``[start, stop)`` from this process (page cache unaffected)."""
        self._pages.release(start * self._particle_bytes, stop * self._particle_bytes)

    # -- reading
    def read_into(self, start: int, stop: int, out: np.ndarray, *, check_finite: bool = True) -> None:
        """Copy particles ``[start, stop)`` into ``out`` (float32 ``[stop - start, H, W]``), then release them."""
        self._require_open()
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"{self.path}: particle range [{start}, {stop}) out of range for a stack of "
                             f"{self.shape[0]}")
        np.copyto(out, self._data[start:stop], casting="unsafe")
        self._release(start, stop)
        if check_finite and self.dtype.kind == "f":
            _check_finite(out, str(self.path), start)

    def read(self, indices, *, check_finite: bool = True) -> np.ndarray:
        """Particles ``indices`` (int, sequence, integer array or slice; negative counts from the end) as a new
        float32 array ``[k, H, W]``, in the order given. Raises :class:`MRCFormatError` on a NaN/inf pixel."""
        self._require_open()
        idx = _as_index_array(indices, self.shape[0], str(self.path))
        out = np.empty((idx.size, self.shape[1], self.shape[2]), np.float32)
        if idx.size:
            np.copyto(out, self._data[idx], casting="unsafe")
            for a, b in _runs(np.unique(idx)):
                self._release(a, b)
        if check_finite and self.dtype.kind == "f":
            _check_finite(out, str(self.path), idx)
        return out


class ArrayStack:
    """An in-memory ``[n, H, W]`` (or ``[H, W]``) array with the reading interface of :class:`MRCStack`.

    ``name`` is used in error messages. The array is not copied; :meth:`read` returns float32 copies.
    """

    def __init__(self, array, name: str = "<array>"):
        a = np.asarray(array)
        if a.ndim == 2:
            a = a[None]
        if a.ndim != 3 or 0 in a.shape[1:]:
            raise ValueError(f"{name}: expected an image [H, W] or a stack [n, H, W], got shape {a.shape}")
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"{name}: expected real (integer or float) pixels, got dtype {a.dtype}")
        self.array = a
        self.path = None
        self.name = name
        self.shape = tuple(int(s) for s in a.shape)
        self.dtype = a.dtype
        self.voxel_size = 0.0

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ArrayStack({self.name}, {self.shape[0]} x {self.shape[1]} x {self.shape[2]}, {self.dtype})"

    def __enter__(self) -> ArrayStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def read_into(self, start: int, stop: int, out: np.ndarray, *, check_finite: bool = True) -> None:
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"{self.name}: particle range [{start}, {stop}) out of range for a stack of "
                             f"{self.shape[0]}")
        np.copyto(out, self.array[start:stop], casting="unsafe")
        if check_finite and self.dtype.kind == "f":
            _check_finite(out, self.name, start)

    def read(self, indices, *, check_finite: bool = True) -> np.ndarray:
        idx = _as_index_array(indices, self.shape[0], self.name)
        out = self.array[idx].astype(np.float32)
        if check_finite and self.dtype.kind == "f":
            _check_finite(out, self.name, idx)
        return out


def _read_header(path: Path, permissive: bool):
    size = path.stat().st_size  # FileNotFoundError names the path
    if size < _HEADER_BYTES:
        raise MRCFormatError(f"{path}: not an MRC file: {size} bytes, shorter than the {_HEADER_BYTES}-byte MRC "
                             f"header")
    try:
        with mrcfile.open(path, mode="r", header_only=True, permissive=permissive) as mrc:
            header = mrc.header.copy()
    except ValueError as err:
        raise MRCFormatError(f"{path}: not a readable MRC file: {err}") from None
    if header is None:
        raise MRCFormatError(f"{path}: not a readable MRC file (no header)")
    return header, size


def open_stack(path: str | os.PathLike, *, permissive: bool = False) -> MRCStack:
    """Memory-map the MRC particle stack at ``path`` (read-only). See the module docstring for what is accepted.

    ``permissive=True`` is passed to ``mrcfile.mmap``: a missing ``MAP`` identifier or a bad machine stamp then
    only warns. The checks on mode, dimensions and file size apply either way.
    """
    path = _as_path(path, "open_stack")
    if path.is_dir():
        raise IsADirectoryError(f"open_stack: {path} is a directory; expected an MRC file")
    if not path.exists():
        raise FileNotFoundError(f"open_stack: {path} does not exist (expected an MRC file)")
    header, size = _read_header(path, permissive)
    mode = int(header.mode)
    if mode not in SUPPORTED_MODES:
        what = f"mode {mode} ({_MODE_NAMES[mode]})" if mode in _MODE_NAMES else f"unknown mode {mode}"
        raise MRCFormatError(f"{path}: unsupported MRC {what}; supported modes are {_supported_text()}")
    nx, ny, nz, nsymbt = (int(header.nx), int(header.ny), int(header.nz), int(header.nsymbt))
    if min(nx, ny, nz) <= 0 or nsymbt < 0:
        raise MRCFormatError(f"{path}: bad MRC header: nx={nx}, ny={ny}, nz={nz}, nsymbt={nsymbt} (dimensions "
                             f"must be positive)")
    if mrcfile.utils.spacegroup_is_volume_stack(header.ispg):
        raise MRCFormatError(f"{path}: a volume stack (space group {int(header.ispg)}); expected a 2-D image or a "
                             f"stack of 2-D images")
    itemsize = SUPPORTED_MODES[mode].itemsize
    data_start = _HEADER_BYTES + nsymbt
    expected = nx * ny * nz * itemsize
    have = size - data_start
    if have < expected:
        complete = max(0, have) // (nx * ny * itemsize)
        raise MRCFormatError(f"{path}: truncated MRC file: the header announces {nz} image(s) of {ny} x {nx} "
                             f"{_MODE_NAMES[mode]} pixels = {expected} data bytes after {data_start} header bytes, "
                             f"but the file has {max(have, 0)} ({complete} complete image(s))")
    try:
        mrc = mrcfile.mmap(path, mode="r", permissive=permissive)
    except ValueError as err:
        raise MRCFormatError(f"{path}: cannot memory-map the MRC data: {err}") from None
    if mrc.data is None:
        mrc.close()
        raise MRCFormatError(f"{path}: mrcfile could not map the data block (permissive mode)")
    data = mrc.data.reshape(nz, ny, nx)
    voxel = float(mrc.voxel_size.x)
    return MRCStack(path, mrc, data, mode, voxel)


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------

_DTYPE_TO_MODE = {np.dtype(np.int8): 0, np.dtype(np.int16): 1, np.dtype(np.float32): 2, np.dtype(np.uint16): 6,
                  np.dtype(np.float16): 12}


def _as_path(path: Any, where: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: 'path' must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    return Path(path)


def _check_voxel_size(voxel_size: Any, where: str) -> float:
    if isinstance(voxel_size, bool) or not isinstance(voxel_size, (int, float, np.integer, np.floating)) or \
            not (np.isfinite(voxel_size) and voxel_size > 0):
        raise ValueError(f"{where}: 'voxel_size' must be a positive number (Angstrom per pixel), got {voxel_size!r}")
    return float(voxel_size)


def _check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path}: file exists; pass overwrite=True to replace it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist")


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:  # a hard link fails atomically if the target appeared meanwhile
        os.link(tmp, path)
    except FileExistsError:
        tmp.unlink()
        raise FileExistsError(f"{path}: file exists; pass overwrite=True to replace it") from None
    except OSError:  # no hard links on this file system
        if path.exists():
            tmp.unlink()
            raise FileExistsError(f"{path}: file exists; pass overwrite=True to replace it") from None
        os.replace(tmp, path)
    else:
        tmp.unlink()


class _StackWriter:
    """Fills a new memory-mapped stack; see :func:`stack_writer`."""

    def __init__(self, mrc, shape):
        self._mrc = mrc
        self.shape = shape
        self._data = mrc.data.reshape(shape)
        self._pages = _PageReleaser(self._data, writable=True)
        self._particle_bytes = shape[1] * shape[2] * self._data.dtype.itemsize
        self._written = np.zeros(shape[0], bool)
        self._stats = [np.inf, -np.inf, 0.0, 0.0]  # min, max, sum, sum of squares

    def write(self, start: int, images) -> None:
        """Write ``images [k, H, W]`` (or one image ``[H, W]``) as particles ``start .. start + k - 1``."""
        a = np.asarray(images)
        if a.ndim == 2:
            a = a[None]
        n, h, w = self.shape
        if a.ndim != 3 or a.shape[1:] != (h, w):
            raise ValueError(f"stack_writer: 'images' must be [k, {h}, {w}], got shape {a.shape}")
        if not 0 <= start <= start + a.shape[0] <= n:
            raise IndexError(f"stack_writer: particles [{start}, {start + a.shape[0]}) out of range for {n}")
        stop = start + a.shape[0]
        target = self._data[start:stop]
        np.copyto(target, a, casting="same_kind" if a.dtype.kind == target.dtype.kind else "unsafe")
        if a.size:
            v = target.astype(np.float64)  # the values as stored
            s = self._stats
            s[0], s[1] = min(s[0], float(v.min())), max(s[1], float(v.max()))
            s[2] += float(v.sum())
            s[3] += float(np.square(v).sum())
            del v
        self._pages.release(start * self._particle_bytes, stop * self._particle_bytes)
        self._written[start:stop] = True

    def _finish(self) -> None:
        if not self._written.all():
            missing = np.flatnonzero(~self._written)
            raise ValueError(f"stack_writer: {missing.size} particle(s) never written (first: {missing[0]})")
        count = float(np.prod(self.shape))
        mn, mx, total, sq = self._stats
        mean = total / count
        h = self._mrc.header
        h.dmin, h.dmax, h.dmean = mn, mx, mean
        h.rms = math.sqrt(max(sq / count - mean * mean, 0.0))
        self._pages.close()
        self._data = None


@contextlib.contextmanager
def stack_writer(path: str | os.PathLike, shape: tuple[int, int, int], *, mrc_mode: int = 2,
                 voxel_size: float = 1.0, overwrite: bool = False) -> Iterator[_StackWriter]:
    """Create the stack ``path`` of ``shape = (n, H, W)`` and fill it piece by piece without holding it in RAM::

        with stack_writer("noisy.mrc", (n, 128, 128)) as w:
            for start in range(0, n, 256):
                w.write(start, make_chunk(start))

    The data go to a hidden temporary file in the same directory through ``mrcfile.new_mmap``; on a clean exit
    (every particle written) the header statistics are set and the file is moved to ``path``; on an exception the
    temporary file is deleted and ``path`` is untouched. Refuses an existing ``path`` unless ``overwrite=True``.
    """
    path = _as_path(path, "stack_writer")
    if mrc_mode not in SUPPORTED_MODES:
        raise ValueError(f"stack_writer: 'mrc_mode' must be one of {_supported_text()}, got {mrc_mode!r}")
    if (not isinstance(shape, (tuple, list)) or len(shape) != 3
            or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape) or min(shape) <= 0):
        raise ValueError(f"stack_writer: 'shape' must be (n, H, W) with positive sizes, got {shape!r}")
    voxel_size = _check_voxel_size(voxel_size, "stack_writer")
    _check_target(path, overwrite)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
    mrc = mrcfile.new_mmap(tmp, shape=tuple(int(s) for s in shape), mrc_mode=mrc_mode)
    try:
        mrc.set_image_stack()
        mrc.voxel_size = voxel_size
        writer = _StackWriter(mrc, tuple(int(s) for s in shape))
        yield writer
        writer._finish()
        mrc.close()
        _move_into_place(tmp, path, overwrite)
    except BaseException:
        mrc.close()
        tmp.unlink(missing_ok=True)
        raise


def write_stack(path: str | os.PathLike, array, voxel_size: float = 1.0, overwrite: bool = False) -> Path:
    """Write ``array [n, H, W]`` (or one image ``[H, W]``) as an MRC image stack and return the path.

    The mode follows the dtype: int8 -> 0, int16 -> 1, float32 -> 2, uint16 -> 6, float16 -> 12; uint8 is
    written as mode 6 and float64 as mode 2 (rounded to float32). Other dtypes raise a ``ValueError``. Refuses to
    replace an existing file unless ``overwrite=True``; the file appears only once completely written.
    """
    _as_path(path, "write_stack")
    _check_voxel_size(voxel_size, "write_stack")
    a = np.asarray(array)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or min(a.shape) <= 0:
        raise ValueError(f"write_stack: 'array' must be [n, H, W] or [H, W] with positive sizes, got {a.shape}")
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    elif a.dtype == np.uint8:
        a = a.astype(np.uint16)
    dtype = np.dtype(a.dtype).newbyteorder("=")
    if dtype not in _DTYPE_TO_MODE:
        raise ValueError(f"write_stack: 'array' has dtype {a.dtype}; supported: int8, int16, uint8, uint16, "
                         f"float16, float32, float64 (cast it first)")
    with stack_writer(path, a.shape, mrc_mode=_DTYPE_TO_MODE[dtype], voxel_size=voxel_size,
                      overwrite=overwrite) as w:
        w.write(0, a)
    return Path(path)


# ----------------------------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------------------------

def normalize_per_particle(images: np.ndarray) -> np.ndarray:
    """Zero mean, unit std per image over the last two axes (float32; constant images -> zeros). See module doc."""
    x = np.asarray(images, dtype=np.float32)
    mean = x.mean(axis=(-2, -1), keepdims=True, dtype=np.float64)
    centred = x - mean.astype(np.float32)
    std = np.sqrt(np.mean(np.square(centred, dtype=np.float64), axis=(-2, -1), keepdims=True))
    constant = (std == 0) | (std <= _CONSTANT_RTOL * np.abs(mean))
    scale = np.where(constant, 0.0, 1.0 / np.where(constant, 1.0, std)).astype(np.float32)
    centred *= scale
    return centred


def _as_source(src, what: str, i: int):
    if isinstance(src, (MRCStack, ArrayStack)):
        if isinstance(src, MRCStack) and src.closed:
            raise ValueError(f"ParticleStream: {what} {src.path} is closed")
        return src, False
    if isinstance(src, (str, os.PathLike)):
        return open_stack(src), True
    if isinstance(src, np.ndarray):
        return ArrayStack(src, name=f"<array {what} {i}>"), False
    raise TypeError(f"ParticleStream: {what} must be a path, an MRCStack, an ArrayStack or a numpy array, got "
                    f"{type(src).__name__}")


def _as_list(x) -> list:
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


class ParticleStream:
    """Shuffled batches of particles from one or more stacks, holding at most ``buffer_size`` particles (module doc).

    Args:
        paths_or_stacks: a path, :class:`MRCStack`, :class:`ArrayStack` or ``[n, H, W]`` array, or a list of them
            (all with the same ``H x W``); ``None`` when ``pairs`` is given.
        batch_size: particles per batch ``B``.
        buffer_size: slots of the shuffle buffer (``>= batch_size``); the memory bound.
        seed: non-negative int; batches of epoch ``e`` depend only on ``(seed, e)``.
        shuffle: chunked shuffle buffer (True) or file order (False).
        drop_last: drop the final batch when it has fewer than ``B`` particles.
        normalize: ``"per_particle"`` or ``None``.
        pairs: ``(inputs, targets)``, each a source or a list of sources aligned one-to-one; the stream then yields
            ``(x, y)`` pairs.
        chunk_size: contiguous particles per read (default ``max(1, buffer_size // 16)``, at most
            ``buffer_size - batch_size + 1``).
        check_finite: raise :class:`MRCFormatError` on NaN/inf pixels when particles are read.

    Stacks given by path are opened here and closed by :meth:`close` (or the ``with`` block); stacks passed in are
    left open. ``len(stream)`` is the number of batches per epoch.
    """

    def __init__(self, paths_or_stacks, batch_size: int, *, buffer_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, normalize: str | None = "per_particle", pairs=None,
                 chunk_size: int | None = None, check_finite: bool = True):
        for name, v, lo in (("batch_size", batch_size, 1), ("buffer_size", buffer_size, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"ParticleStream: '{name}' must be an integer >= {lo}, got {v!r}")
        if buffer_size < batch_size:
            raise ValueError(f"ParticleStream: 'buffer_size' ({buffer_size}) must be >= 'batch_size' "
                             f"({batch_size})")
        max_chunk = buffer_size - batch_size + 1
        if chunk_size is None:
            chunk_size = max(1, min(buffer_size // 16, max_chunk))
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or \
                not 1 <= chunk_size <= max_chunk:
            raise ValueError(f"ParticleStream: 'chunk_size' must be an integer in [1, buffer_size - batch_size + 1 "
                             f"= {max_chunk}], got {chunk_size!r}")
        if normalize not in ("per_particle", None):
            raise ValueError(f"ParticleStream: 'normalize' must be 'per_particle' or None, got {normalize!r}")
        if (paths_or_stacks is None) == (pairs is None):
            raise ValueError("ParticleStream: give either 'paths_or_stacks' or 'pairs=(inputs, targets)', not both "
                             "or neither")
        self.batch_size, self.buffer_size, self.seed = int(batch_size), int(buffer_size), int(seed)
        self.chunk_size = int(chunk_size)
        self.shuffle, self.drop_last, self.normalize = bool(shuffle), bool(drop_last), normalize
        self.check_finite = bool(check_finite)
        self._owned: list = []
        try:
            if pairs is None:
                self.sources = self._open_all(_as_list(paths_or_stacks), "source")
                self.targets = None
            else:
                if not (isinstance(pairs, (list, tuple)) and len(pairs) == 2):
                    raise ValueError("ParticleStream: 'pairs' must be (inputs, targets)")
                ins, outs = _as_list(pairs[0]), _as_list(pairs[1])
                if len(ins) != len(outs):
                    raise ValueError(f"ParticleStream: 'pairs' has {len(ins)} input stack(s) but {len(outs)} target "
                                     f"stack(s)")
                self.sources = self._open_all(ins, "input")
                self.targets = self._open_all(outs, "target")
                for a, b in zip(self.sources, self.targets):
                    if a.shape != b.shape:
                        raise ValueError(f"ParticleStream: paired stacks differ: {_name(a)} is {_shape_text(a)} but "
                                         f"{_name(b)} is {_shape_text(b)}; pairs need the same number of particles "
                                         f"and image size")
        except BaseException:
            self.close()
            raise
        self.image_shape: tuple[int, int] = self.sources[0].shape[1:]
        sizes = [len(s) for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n_particles = int(self.offsets[-1])
        if self.n_particles == 0:
            self.close()
            raise ValueError("ParticleStream: the stacks hold no particles")
        h, w = self.image_shape
        self.buffer_nbytes = self.buffer_size * h * w * 4 * (1 if self.targets is None else 2)
        self.peak_buffered = 0
        self._resident = 0

    def _open_all(self, srcs: list, what: str) -> list:
        if not srcs:
            raise ValueError(f"ParticleStream: no {what} stacks given")
        out = []
        for i, s in enumerate(srcs):
            stack, owned = _as_source(s, what, i)
            if owned:
                self._owned.append(stack)
            out.append(stack)
        first = out[0]
        for s in out[1:]:
            if s.shape[1:] != first.shape[1:]:
                raise ValueError(f"ParticleStream: {_name(s)} has images of {s.shape[1]} x {s.shape[2]} but "
                                 f"{_name(first)} has {first.shape[1]} x {first.shape[2]}; all stacks must share "
                                 f"H x W")
        return out

    # -- protocol
    def __len__(self) -> int:
        n, b = self.n_particles, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __enter__(self) -> ParticleStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the stacks this stream opened from paths (idempotent)."""
        owned, self._owned = self._owned, []
        for s in owned:
            s.close()

    def __repr__(self) -> str:
        kind = "pairs" if self.targets is not None else "particles"
        return (f"ParticleStream({self.n_particles} {kind} of {self.image_shape[0]} x {self.image_shape[1]} in "
                f"{len(self.sources)} stack(s), batch {self.batch_size}, buffer {self.buffer_size}, chunk "
                f"{self.chunk_size})")

    # -- reading helpers
    def _chunks(self) -> list[tuple[int, int, int]]:
        out = []
        for k, s in enumerate(self.sources):
            n = len(s)
            out.extend((k, a, min(a + self.chunk_size, n)) for a in range(0, n, self.chunk_size))
        return out

    def _read(self, k: int, a: int, b: int, out_x: np.ndarray, out_y: np.ndarray | None) -> None:
        self.sources[k].read_into(a, b, out_x, check_finite=self.check_finite)
        if out_y is not None:
            self.targets[k].read_into(a, b, out_y, check_finite=self.check_finite)

    def _hold(self, delta: int) -> None:
        self._resident += delta
        self.peak_buffered = max(self.peak_buffered, self._resident)

    def _emit(self, x: np.ndarray, y: np.ndarray | None, idx: np.ndarray, with_indices: bool):
        def finish(a):
            if self.normalize == "per_particle":
                a = normalize_per_particle(a)
            return a[..., None]
        out = (finish(x),) if y is None else (finish(x), finish(y))
        if with_indices:
            out = out + (idx,)
        return out[0] if len(out) == 1 else out

    # -- epochs
    def epoch(self, epoch: int, *, with_indices: bool = False) -> Iterator:
        """Generator over the batches of ``epoch`` (deterministic in ``(seed, epoch)``).

        Yields ``x [B, H, W, 1]`` float32, or ``(x, y)`` for pairs; with ``with_indices=True`` also the int64 global
        particle indices ``[B]`` as a last element (index ``i`` of stack ``k`` is ``stream.offsets[k] + i``).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"ParticleStream.epoch: 'epoch' must be an integer >= 0, got {epoch!r}")
        if not self.sources or (isinstance(self.sources[0], MRCStack) and self.sources[0].closed):
            raise ValueError("ParticleStream.epoch: the stream is closed")
        return self._shuffled(int(epoch), with_indices) if self.shuffle else self._ordered(with_indices)

    def _ordered(self, with_indices: bool) -> Iterator:
        h, w = self.image_shape
        b = self.batch_size
        pairs = self.targets is not None
        stops = range(b, self.n_particles + (0 if self.drop_last else b - 1) + 1, b)
        for stop in stops:
            start, stop = stop - b, min(stop, self.n_particles)
            x = np.empty((stop - start, h, w), np.float32)
            y = np.empty_like(x) if pairs else None
            self._hold(stop - start)
            try:
                for k in range(len(self.sources)):  # the pieces of [start, stop) in every stack
                    lo, hi = max(start, self.offsets[k]), min(stop, self.offsets[k + 1])
                    if lo < hi:
                        self._read(k, int(lo - self.offsets[k]), int(hi - self.offsets[k]), x[lo - start:hi - start],
                                   None if y is None else y[lo - start:hi - start])
            finally:
                self._hold(-(stop - start))
            yield self._emit(x, y, np.arange(start, stop, dtype=np.int64), with_indices)

    def _shuffled(self, epoch: int, with_indices: bool) -> Iterator:
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(epoch,)))
        chunks = self._chunks()
        order = rng.permutation(len(chunks))
        h, w = self.image_shape
        size, b = self.buffer_size, self.batch_size
        buf_x = np.empty((size, h, w), np.float32)
        buf_y = np.empty_like(buf_x) if self.targets is not None else None
        ids = np.empty(size, np.int64)
        count = 0  # slots [0, count) are occupied
        nxt = 0  # next chunk (position in `order`)
        try:
            while True:
                while nxt < len(order):  # fill while the next chunk fits
                    k, a, c = chunks[order[nxt]]
                    if count + (c - a) > size:
                        break
                    self._read(k, a, c, buf_x[count:count + c - a],
                               None if buf_y is None else buf_y[count:count + c - a])
                    ids[count:count + c - a] = np.arange(self.offsets[k] + a, self.offsets[k] + c)
                    count += c - a
                    self._hold(c - a)
                    nxt += 1
                if count < b and (nxt < len(order) or count == 0 or self.drop_last):
                    if nxt < len(order):  # unreachable: chunk_size <= buffer_size - batch_size + 1
                        raise AssertionError("ParticleStream: buffer cannot take the next chunk")
                    break
                take = min(b, count)
                pick = np.sort(rng.choice(count, size=take, replace=False))
                if take < b:  # the last, smaller batch: emit it in random order
                    pick = rng.permutation(pick)
                x = buf_x[pick]
                y = None if buf_y is None else buf_y[pick]
                idx = ids[pick]
                # Compact: the occupied slots at the end that were not picked move into the holes left by `pick`.
                tail = np.setdiff1d(np.arange(count - take, count), pick, assume_unique=True)
                holes = pick[pick < count - take]
                if holes.size:
                    buf_x[holes] = buf_x[tail]
                    if buf_y is not None:
                        buf_y[holes] = buf_y[tail]
                    ids[holes] = ids[tail]
                count -= take
                self._hold(-take)
                yield self._emit(x, y, idx, with_indices)
        finally:
            self._hold(-count)


def _name(stack) -> str:
    return str(stack.path) if getattr(stack, "path", None) is not None else stack.name


def _shape_text(stack) -> str:
    n, h, w = stack.shape
    return f"{n} x {h} x {w}"
