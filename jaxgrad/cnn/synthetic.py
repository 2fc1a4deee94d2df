r"""Synthetic cryo-EM particles: projections of a random 3-D density under uniformly random rotations, plus white
Gaussian noise, with two independent noise realisations per particle (Noise2Noise pairs). NumPy only.

Conventions
-----------
* A density is a float32 array ``V[z, y, x]`` of shape ``[D, D, D]`` (the MRC axis order); an image is
  ``I[y, x]`` of shape ``[D, D]``. The centre of the box is the voxel ``(D // 2, D // 2, D // 2)`` (the usual
  cryo-EM convention; for even ``D`` it is the voxel just past the middle). Voxels are 1 unit apart.
* A rotation ``R`` (3 x 3, acting on column vectors ``(x, y, z)`` relative to the centre) turns ``V`` into
  ``V_R(p) = V(R^T p)``: a feature at offset ``r`` moves to ``R r``. Example: 90 degrees about z,
  ``R = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]``, moves a blob on the +x axis to the +y axis.
* :func:`project` is the line integral along z of the rotated density, as a Riemann sum over the ``D`` voxel
  planes: ``I(x, y) = sum_z V_R(x, y, z)``, where ``V_R`` is sampled on the voxel grid by trilinear interpolation
  of ``V`` with zeros outside the box. For a density that vanishes near the box's faces and is smooth on the voxel
  scale (blobs of sigma >= 1 voxel), the image's total equals the density's total up to the interpolation error
  (a few 1e-3 relative; exactly for rotations that map the grid onto itself, such as the identity or 90 degrees
  about z).

Densities and rotations
-----------------------
:func:`random_density` sums ``n_blobs`` isotropic Gaussian blobs with centres uniform in a ball of radius
``0.25 D`` around the centre, widths ``sigma`` uniform in ``[0.04 D, 0.09 D]`` (at least 1 voxel) and amplitudes
uniform in ``[0.5, 1]``; everything lies within ``~0.45 D`` of the centre, so no rotation moves mass out of the
box. :func:`random_rotations` draws unit quaternions from a normalised 4-D standard normal, which is uniform on the
3-sphere, hence its rotations are uniform (Haar) on SO(3).

Noise and SNR
-------------
:func:`make_particles` projects one density under ``n`` random rotations and adds white Gaussian noise. For each
particle ``i`` the noise standard deviation is ``std(clean_i) / sqrt(snr)``, with the std taken over the whole
``D x D`` box; so ``var(signal) / var(noise) = snr`` for every particle (in expectation over the noise).
``noisy_a`` and ``noisy_b`` carry independent noise realisations of the same clean projection. ``snr=inf`` gives
no noise. (No CTF, no shifts, no structured background: this is the simplest denoising benchmark.)

Determinism: particle ``i``'s rotation and noise come from its own random stream derived from ``(seed, i)``, and
the density from ``(seed, "density")``; so the particles do not depend on how they are generated in chunks, and
:func:`write_synthetic_stacks` writes exactly ``make_particles(n, size, snr=snr, seed=seed)`` piece by piece.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxgrad.cnn import data as _data

__all__ = ["SyntheticPairs", "blob_density", "make_particles", "particle", "project", "quaternion_to_matrix",
           "random_density", "random_rotations", "write_synthetic_stacks"]

_DENSITY_KEY = 0
_PARTICLE_KEY = 1
_PAIRS_KEY = 2
_SLAB_POINTS = 1 << 16  # sample points per slab of planes in `project` (keeps the temporaries in cache)


def _rng(rng_or_seed) -> np.random.Generator:
    if isinstance(rng_or_seed, np.random.Generator):
        return rng_or_seed
    if isinstance(rng_or_seed, bool) or not isinstance(rng_or_seed, (int, np.integer)) or rng_or_seed < 0:
        raise ValueError(f"expected a numpy Generator or a seed (int >= 0), got {rng_or_seed!r}")
    return np.random.default_rng(int(rng_or_seed))


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=tuple(int(k) for k in key)))


def _check_size(size, name: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
        raise ValueError(f"'{name}' must be an integer >= 2, got {size!r}")
    return int(size)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"'seed' must be an integer >= 0, got {seed!r}")
    return int(seed)


def _check_snr(snr) -> float:
    snr = float(snr)
    if not snr > 0:  # also rejects NaN
        raise ValueError(f"'snr' must be > 0 (inf: no noise), got {snr!r}")
    return snr


# ----------------------------------------------------------------------------------------------------------------
# Densities and rotations
# ----------------------------------------------------------------------------------------------------------------

def blob_density(size: int, centers, sigmas, amplitudes) -> np.ndarray:
    """Sum of isotropic Gaussian blobs ``a exp(-|p - c|^2 / (2 sigma^2))`` on a ``[size]^3`` grid (float32 [z, y, x]).

    ``centers [k, 3]`` are ``(x, y, z)`` offsets in voxels from the box centre ``size // 2``; ``sigmas [k]`` and
    ``amplitudes [k]`` are in voxels and density units.
    """
    size = _check_size(size)
    centers = np.asarray(centers, np.float64).reshape(-1, 3)
    sigmas = np.broadcast_to(np.asarray(sigmas, np.float64), centers.shape[:1])
    amps = np.broadcast_to(np.asarray(amplitudes, np.float64), centers.shape[:1])
    if np.any(sigmas <= 0):
        raise ValueError(f"blob_density: 'sigmas' must be > 0, got {sigmas}")
    ax = np.arange(size, dtype=np.float64) - size // 2
    out = np.zeros((size, size, size), np.float32)
    for (cx, cy, cz), s, a in zip(centers, sigmas, amps):
        gx, gy, gz = (np.exp(-0.5 * ((ax - c) / s) ** 2) for c in (cx, cy, cz))
        out += (a * gz[:, None, None] * gy[None, :, None] * gx[None, None, :]).astype(np.float32)
    return out


def random_density(rng_or_seed, size: int, n_blobs: int = 12) -> np.ndarray:
    """A random 3-D density ``[size]^3`` (float32 [z, y, x]): a sum of ``n_blobs`` Gaussian blobs (module doc)."""
    rng = _rng(rng_or_seed)
    size = _check_size(size)
    if isinstance(n_blobs, bool) or not isinstance(n_blobs, (int, np.integer)) or n_blobs < 1:
        raise ValueError(f"random_density: 'n_blobs' must be an integer >= 1, got {n_blobs!r}")
    direction = rng.standard_normal((n_blobs, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    radius = 0.25 * size * rng.uniform(0, 1, n_blobs) ** (1 / 3)  # uniform in the ball
    sigmas = np.maximum(rng.uniform(0.04, 0.09, n_blobs) * size, 1.0)
    amps = rng.uniform(0.5, 1.0, n_blobs)
    return blob_density(size, direction * radius[:, None], sigmas, amps)


def quaternion_to_matrix(q) -> np.ndarray:
    """Rotation matrices ``[..., 3, 3]`` of quaternions ``q [..., 4] = (w, x, y, z)`` (normalised here)."""
    q = np.asarray(q, np.float64)
    norm = np.linalg.norm(q, axis=-1, keepdims=True)
    if np.any(norm == 0):
        raise ValueError("quaternion_to_matrix: zero quaternion")
    w, x, y, z = np.moveaxis(q / norm, -1, 0)
    return np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1),
    ], -2)


def random_rotations(rng_or_seed, n: int) -> np.ndarray:
    """``n`` rotation matrices ``[n, 3, 3]`` (float64), uniformly distributed on SO(3) (random unit quaternions)."""
    rng = _rng(rng_or_seed)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"random_rotations: 'n' must be an integer >= 0, got {n!r}")
    return quaternion_to_matrix(rng.standard_normal((int(n), 4)))


# ----------------------------------------------------------------------------------------------------------------
# Projection
# ----------------------------------------------------------------------------------------------------------------

def _check_rotation(rotation) -> np.ndarray:
    r = np.asarray(rotation, np.float64)
    if r.shape != (3, 3):
        raise ValueError(f"project: 'rotation' must be a 3 x 3 matrix, got shape {r.shape}")
    if not np.allclose(r @ r.T, np.eye(3), atol=1e-5) or np.linalg.det(r) < 0:
        raise ValueError("project: 'rotation' must be a proper rotation (orthonormal, det +1)")
    return r


def _project_slab(flat: np.ndarray, size: int, rt: np.ndarray, z: np.ndarray, image: np.ndarray) -> None:
    """Add ``sum_z V_R(x, y, z)`` over the planes ``z`` (offsets from the centre) to ``image`` (flat, float64)."""
    d, s = size, size + 2  # `flat` is the volume padded by one zero voxel on each side
    c = d // 2
    ax = np.arange(d, dtype=np.float32) - c
    q = [(rt[k, 0] * ax[None, None, :] + rt[k, 1] * ax[None, :, None] + rt[k, 2] * z[:, None, None] + c).ravel()
         for k in range(3)]  # source coordinates (x, y, z) of every sample point, in voxels
    inside = (q[0] > -1) & (q[0] < d) & (q[1] > -1) & (q[1] < d) & (q[2] > -1) & (q[2] < d)
    sel = np.flatnonzero(inside)
    if sel.size == 0:
        return
    q = [qk[sel] for qk in q]
    floor = [np.floor(qk) for qk in q]
    wx1, wy1, wz1 = (qk - fk for qk, fk in zip(q, floor))
    wx0, wy0, wz0 = 1 - wx1, 1 - wy1, 1 - wz1
    ix, iy, iz = (fk.astype(np.intp) + 1 for fk in floor)
    base = (iz * s + iy) * s + ix
    values = np.zeros(sel.size, np.float32)
    for dz, wz in ((0, wz0), (1, wz1)):
        for dy, wy in ((0, wy0), (1, wy1)):
            off = (dz * s + dy) * s
            values += (wz * wy) * (wx0 * flat[base + off] + wx1 * flat[base + (off + 1)])
    image += np.bincount(sel % (d * d), weights=values, minlength=d * d)


def project(density, rotation) -> np.ndarray:
    """Projection along z of ``density [D, D, D]`` rotated by ``rotation`` (3 x 3): float32 image ``[D, D]``.

    Trilinear interpolation, zeros outside the box; conventions in the module docstring.
    """
    v = np.asarray(density, np.float32)
    if v.ndim != 3 or len(set(v.shape)) != 1:
        raise ValueError(f"project: 'density' must be a cube [D, D, D], got shape {v.shape}")
    r = _check_rotation(rotation)
    d = v.shape[0]
    flat = np.pad(v, 1).ravel()
    rt = r.T.astype(np.float32)
    image = np.zeros(d * d, np.float64)
    step = max(1, _SLAB_POINTS // (d * d))
    planes = np.arange(d, dtype=np.float32) - d // 2
    for z0 in range(0, d, step):
        _project_slab(flat, d, rt, planes[z0:z0 + step], image)
    return image.reshape(d, d).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Particles
# ----------------------------------------------------------------------------------------------------------------

def particle(density: np.ndarray, seed: int, index: int, snr: float) -> dict[str, np.ndarray]:
    """Particle ``index`` of the dataset ``seed``: ``clean``, ``noisy_a``, ``noisy_b`` ``[D, D]`` and ``rotation``."""
    rng = _stream(seed, _PARTICLE_KEY, index)
    rotation = random_rotations(rng, 1)[0]
    clean = project(density, rotation)
    sigma = float(clean.std(dtype=np.float64)) / math.sqrt(snr)
    noise = rng.standard_normal((2,) + clean.shape, dtype=np.float32)
    noise *= np.float32(sigma)
    return {"clean": clean, "noisy_a": clean + noise[0], "noisy_b": clean + noise[1], "rotation": rotation}


def _density_for(seed: int, size: int, density, n_blobs: int) -> np.ndarray:
    if density is None:
        return random_density(_stream(seed, _DENSITY_KEY), size, n_blobs)
    density = np.asarray(density, np.float32)
    if density.shape != (size, size, size):
        raise ValueError(f"'density' must have shape ({size}, {size}, {size}) for size={size}, got {density.shape}")
    return density


def _particles(density, seed: int, start: int, stop: int, snr: float) -> dict[str, np.ndarray]:
    items = [particle(density, seed, i, snr) for i in range(start, stop)]
    return {k: np.stack([it[k] for it in items]) for k in ("clean", "noisy_a", "noisy_b", "rotation")}


def make_particles(n: int, size: int, *, snr: float, seed: int, density=None,
                   n_blobs: int = 12) -> dict[str, np.ndarray]:
    """``n`` synthetic particles of ``size x size`` pixels, in memory.

    Returns ``clean``, ``noisy_a``, ``noisy_b`` (float32 ``[n, size, size]``; a and b with independent noise at
    ``var(clean_i) / var(noise) = snr``), ``rotations [n, 3, 3]`` and the ``density [size]^3`` they project
    (``random_density`` from ``seed`` unless given).
    """
    size, seed, snr = _check_size(size), _check_seed(seed), _check_snr(snr)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"make_particles: 'n' must be an integer >= 1, got {n!r}")
    density = _density_for(seed, size, density, n_blobs)
    out = _particles(density, seed, 0, int(n), snr)
    out["rotations"] = out.pop("rotation")
    out["density"] = density
    return out


def write_synthetic_stacks(directory, n: int, size: int, snr: float, seed: int, chunk: int = 256, *,
                           density=None, n_blobs: int = 12, voxel_size: float = 1.0,
                           overwrite: bool = False) -> dict[str, Path]:
    """Write ``clean.mrc``, ``noisy_a.mrc``, ``noisy_b.mrc`` (``[n, size, size]`` float32 stacks) and ``density.mrc``
    (the ``[size]^3`` ground truth) into ``directory``, generating ``chunk`` particles at a time: memory use is
    ``O(chunk * size^2 + size^3)`` whatever ``n``. The stacks equal ``make_particles(n, size, snr=snr, seed=seed)``.

    Refuses existing files unless ``overwrite=True`` (checked for all four before anything is written). Returns
    ``{"clean": path, "noisy_a": path, "noisy_b": path, "density": path}``.
    """
    size, seed, snr = _check_size(size), _check_seed(seed), _check_snr(snr)
    for name, v in (("n", n), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"write_synthetic_stacks: '{name}' must be an integer >= 1, got {v!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"write_synthetic_stacks: directory {directory} does not exist")
    paths = {k: directory / f"{k}.mrc" for k in ("clean", "noisy_a", "noisy_b", "density")}
    if not overwrite:
        existing = [str(p) for p in paths.values() if p.exists()]
        if existing:
            raise FileExistsError(f"write_synthetic_stacks: {', '.join(existing)} exist(s); pass overwrite=True to "
                                  f"replace")
    density = _density_for(seed, size, density, n_blobs)
    shape = (int(n), size, size)
    kw = {"voxel_size": voxel_size, "overwrite": overwrite}
    with _data.stack_writer(paths["clean"], shape, **kw) as w_clean, \
            _data.stack_writer(paths["noisy_a"], shape, **kw) as w_a, \
            _data.stack_writer(paths["noisy_b"], shape, **kw) as w_b:
        for start in range(0, int(n), int(chunk)):
            part = _particles(density, seed, start, min(start + int(chunk), int(n)), snr)
            w_clean.write(start, part["clean"])
            w_a.write(start, part["noisy_a"])
            w_b.write(start, part["noisy_b"])
    _write_volume(paths["density"], density, voxel_size, overwrite)
    return paths


def _write_volume(path: Path, volume: np.ndarray, voxel_size: float, overwrite: bool) -> None:
    import mrcfile

    if path.exists() and not overwrite:
        raise FileExistsError(f"{path}: file exists; pass overwrite=True to replace it")
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with mrcfile.new(tmp, data=volume.astype(np.float32), overwrite=True) as mrc:
            mrc.set_volume()
            mrc.voxel_size = voxel_size
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# Noise2Noise pairs generated on the fly
# ----------------------------------------------------------------------------------------------------------------

class SyntheticPairs:
    """Noise2Noise training pairs generated on the fly, with the ``epoch(e)`` interface of
    :class:`jaxgrad.cnn.data.ParticleStream`.

    Every epoch has ``batches_per_epoch`` batches of fresh views and fresh noise of one density (from ``seed``):
    batch ``k`` of epoch ``e`` yields ``(x, y)`` float32 ``[B, size, size, 1]``, two independent noise realisations
    of the same clean projections (``(x, y, clean)`` with ``with_clean=True``), deterministic in
    ``(seed, e, k)``. ``normalize="per_particle"`` normalises x and y (and clean) per image as the stream does.
    """

    def __init__(self, size: int, batch_size: int, *, snr: float, seed: int, batches_per_epoch: int,
                 density=None, n_blobs: int = 12, normalize: str | None = "per_particle"):
        self.size, self.seed, self.snr = _check_size(size), _check_seed(seed), _check_snr(snr)
        for name, v in (("batch_size", batch_size), ("batches_per_epoch", batches_per_epoch)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"SyntheticPairs: '{name}' must be an integer >= 1, got {v!r}")
        if normalize not in ("per_particle", None):
            raise ValueError(f"SyntheticPairs: 'normalize' must be 'per_particle' or None, got {normalize!r}")
        self.batch_size, self.batches_per_epoch = int(batch_size), int(batches_per_epoch)
        self.normalize = normalize
        self.density = _density_for(self.seed, self.size, density, n_blobs)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch(self, epoch: int, *, with_clean: bool = False) -> Iterator[tuple[np.ndarray, ...]]:
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"SyntheticPairs.epoch: 'epoch' must be an integer >= 0, got {epoch!r}")
        b = self.batch_size
        # Particle j of batch k of epoch e is particle k * B + j of a dataset whose seed is drawn from (seed, e).
        ds_seed = int(np.random.SeedSequence(self.seed, spawn_key=(_PAIRS_KEY, int(epoch))).generate_state(1)[0])
        for k in range(self.batches_per_epoch):
            part = _particles(self.density, ds_seed, k * b, (k + 1) * b, self.snr)
            arrays = [part["noisy_a"], part["noisy_b"]] + ([part["clean"]] if with_clean else [])
            if self.normalize == "per_particle":
                arrays = [_data.normalize_per_particle(a) for a in arrays]
            yield tuple(a[..., None] for a in arrays)
