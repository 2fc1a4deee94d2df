r"""Shuffled, memory-bounded batch streams of particles (:class:`ParticleStream`) for a denoising CNN, and their
per-particle normalisation (:func:`normalize_per_particle`).

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

import os
from collections.abc import Iterator

import numpy as np

from jaxgrad.cnn.mrc import ArrayStack, MRCStack, open_stack

__all__ = ["ParticleStream", "normalize_per_particle"]

_CONSTANT_RTOL = 1e-6


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
