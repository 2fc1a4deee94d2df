r"""MRC particle stacks: memory-mapped reading (:func:`open_stack`, :class:`MRCStack`, :class:`ArrayStack`) and
atomic writing (:func:`write_stack`, :func:`stack_writer`).

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

__all__ = ["SUPPORTED_MODES", "ArrayStack", "MRCFormatError", "MRCStack", "open_stack", "stack_writer",
           "write_stack"]

#: MRC mode -> on-disk dtype, for the modes :func:`open_stack` accepts.
SUPPORTED_MODES: dict[int, np.dtype] = {0: np.dtype(np.int8), 1: np.dtype(np.int16), 2: np.dtype(np.float32),
                                        6: np.dtype(np.uint16), 12: np.dtype(np.float16)}
_MODE_NAMES = {0: "int8", 1: "int16", 2: "float32", 3: "complex int16", 4: "complex float32", 6: "uint16",
               12: "float16", 101: "4-bit"}
_HEADER_BYTES = 1024


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
