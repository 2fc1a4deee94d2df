"""Cryo-EM particle data for the denoising CNN: MRC stacks, the bounded-memory shuffled stream, Noise2Noise pairs
(jaxgrad.cnn.data) and synthetic particles (jaxgrad.cnn.synthetic)."""

import gc
import sys

import mrcfile
import numpy as np
import pytest

from jaxgrad.cnn import data, synthetic

# mrcfile 1.5.4 sets the dtype of its header record arrays, which NumPy >= 2.5 deprecates (harmless here).
pytestmark = pytest.mark.filterwarnings("ignore:Setting the dtype on a NumPy array:DeprecationWarning")


def index_stack(path, n, h=6, w=5, start=0, dtype=np.float32):
    """A stack whose particle i is the constant image ``start + i``: batches reveal which particles they hold."""
    values = np.arange(start, start + n, dtype=np.float64)[:, None, None] * np.ones((1, h, w))
    return data.write_stack(path, values.astype(dtype))


def ids_of(batch):
    """Particle ids of a batch of constant images [B, H, W, 1]."""
    assert np.all(batch == batch[:, :1, :1, :])
    return batch[:, 0, 0, 0].astype(np.int64)


# ------------------------------------------------------------------------------------------------------------------
# Reading and writing MRC stacks
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,dtype", [(0, np.int8), (1, np.int16), (2, np.float32), (6, np.uint16),
                                        (12, np.float16)])
def test_every_supported_mode_round_trips_and_reads_as_float32(tmp_path, mode, dtype):
    rng = np.random.default_rng(mode)
    lo, hi = (0, 100) if dtype == np.uint16 else (-100, 100)
    images = rng.integers(lo, hi, size=(7, 9, 11)).astype(dtype)
    path = data.write_stack(tmp_path / "s.mrc", images, voxel_size=1.25)
    with data.open_stack(path) as stack:
        assert (stack.path, stack.shape, stack.dtype, stack.mode, len(stack)) == (path, (7, 9, 11), dtype, mode, 7)
        assert stack.voxel_size == pytest.approx(1.25)
        out = stack.read(np.arange(7))
    assert out.dtype == np.float32 and out.shape == (7, 9, 11)
    np.testing.assert_array_equal(out, images.astype(np.float32))


def test_a_single_2d_image_is_a_stack_of_one(tmp_path):
    image = np.arange(20, dtype=np.float32).reshape(4, 5)
    with mrcfile.new(tmp_path / "one.mrc", data=image) as mrc:
        mrc.voxel_size = 2.0
    with data.open_stack(tmp_path / "one.mrc") as stack:
        assert stack.shape == (1, 4, 5) and len(stack) == 1
        np.testing.assert_array_equal(stack.read(0), image[None])


def test_big_endian_files_are_read_in_native_float32(tmp_path):
    images = np.arange(24, dtype=">f4").reshape(2, 3, 4)
    with mrcfile.new(tmp_path / "be.mrc", data=images):
        pass
    with data.open_stack(tmp_path / "be.mrc") as stack:
        assert stack.dtype == np.float32
        np.testing.assert_array_equal(stack.read([1, 0]), images[::-1].astype(np.float32))


def test_read_takes_ints_slices_negative_indices_and_arrays_in_the_order_given(tmp_path):
    index_stack(tmp_path / "s.mrc", 10)
    with data.open_stack(tmp_path / "s.mrc") as stack:
        assert ids_of(stack.read(3)[..., None]).tolist() == [3]
        assert ids_of(stack.read(slice(2, 8, 3))[..., None]).tolist() == [2, 5]
        assert ids_of(stack.read([9, -1, 0, 4, 4])[..., None]).tolist() == [9, 9, 0, 4, 4]
        assert stack.read([]).shape == (0, 6, 5)
        with pytest.raises(IndexError, match=r"s\.mrc.*index 10 out of range for a stack of 10"):
            stack.read([1, 10])
    with pytest.raises(ValueError, match="closed"):
        stack.read(0)


def test_complex_modes_are_rejected_naming_the_file_the_mode_and_the_supported_modes(tmp_path):
    with mrcfile.new(tmp_path / "c64.mrc", data=np.ones((2, 4, 4), np.complex64)):
        pass
    with pytest.raises(data.MRCFormatError, match=r"c64\.mrc: unsupported MRC mode 4 \(complex float32\); "
                                                  r"supported modes are 0 \(int8\), 1 \(int16\), 2 \(float32\), "
                                                  r"6 \(uint16\), 12 \(float16\)"):
        data.open_stack(tmp_path / "c64.mrc")
    # Mode 3 (complex int16) cannot even be written by mrcfile: patch the mode word of a valid int16 stack.
    data.write_stack(tmp_path / "c16.mrc", np.ones((2, 4, 4), np.int16))
    raw = bytearray((tmp_path / "c16.mrc").read_bytes())
    raw[12:16] = np.int32(3).tobytes()
    (tmp_path / "c16.mrc").write_bytes(bytes(raw))
    with pytest.raises(data.MRCFormatError, match=r"c16\.mrc: unsupported MRC mode 3 \(complex int16\)"):
        data.open_stack(tmp_path / "c16.mrc")


def test_a_truncated_file_is_rejected_naming_the_file_and_the_complete_particles(tmp_path):
    path = data.write_stack(tmp_path / "cut.mrc", np.ones((10, 8, 8), np.float32))
    full = path.read_bytes()
    path.write_bytes(full[:-(2 * 8 * 8 * 4 + 5)])  # loses 2 particles and a bit of a third
    with pytest.raises(data.MRCFormatError, match=r"cut\.mrc: truncated MRC file.*10 image\(s\) of 8 x 8 float32"
                                                  r".*7 complete image\(s\)"):
        data.open_stack(path)
    path.write_bytes(full[:1024])  # header only
    with pytest.raises(data.MRCFormatError, match=r"cut\.mrc: truncated.*has 0 \(0 complete"):
        data.open_stack(path)


def test_files_that_are_not_mrc_are_rejected_naming_the_file(tmp_path):
    (tmp_path / "tiny.mrc").write_bytes(b"not an mrc file")
    with pytest.raises(data.MRCFormatError, match=r"tiny\.mrc: not an MRC file: 15 bytes, shorter than the 1024"):
        data.open_stack(tmp_path / "tiny.mrc")
    (tmp_path / "junk.mrc").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(data.MRCFormatError, match=r"junk\.mrc: not a readable MRC file.*Map ID"):
        data.open_stack(tmp_path / "junk.mrc")
    path = data.write_stack(tmp_path / "dims.mrc", np.ones((2, 4, 4), np.float32))
    raw = bytearray(path.read_bytes())
    raw[0:4] = np.int32(-4).tobytes()  # nx
    path.write_bytes(bytes(raw))
    with pytest.raises(data.MRCFormatError, match=r"dims\.mrc: bad MRC header: nx=-4"):
        data.open_stack(path)
    path = data.write_stack(tmp_path / "nomap.mrc", np.ones((2, 4, 4), np.float32))
    raw = bytearray(path.read_bytes())
    raw[208:212] = bytes(4)  # the "MAP " identifier
    path.write_bytes(bytes(raw))
    with pytest.raises(data.MRCFormatError, match=r"nomap\.mrc: not a readable MRC file: Map ID string not found"):
        data.open_stack(path)
    with pytest.warns(RuntimeWarning, match="Map ID"), data.open_stack(path, permissive=True) as stack:
        np.testing.assert_array_equal(stack.read(1), 1)
    with pytest.raises(FileNotFoundError, match="missing.mrc"):
        data.open_stack(tmp_path / "missing.mrc")


def test_non_finite_pixels_are_reported_with_the_file_and_the_particle_index(tmp_path):
    images = np.zeros((6, 4, 4), np.float32)
    images[4, 1, 2] = np.nan
    images[5, 0, 0] = np.inf
    path = data.write_stack(tmp_path / "nan.mrc", images)
    with data.open_stack(path) as stack:
        np.testing.assert_array_equal(stack.read([0, 1, 2, 3]), 0)
        with pytest.raises(data.MRCFormatError, match=r"nan\.mrc: particle 4 \(0-based\) contains 1 non-finite"):
            stack.read([1, 4, 5])
        with pytest.raises(data.MRCFormatError, match=r"nan\.mrc: particle 5 "):
            stack.read([5])
        assert np.isnan(stack.read([4], check_finite=False)).sum() == 1
    with data.ParticleStream(path, 2, buffer_size=4, seed=0) as stream:
        with pytest.raises(data.MRCFormatError, match=r"nan\.mrc: particle [45] \(0-based\)"):
            list(stream.epoch(0))


def test_write_stack_never_overwrites_an_existing_file_unless_told(tmp_path):
    path = data.write_stack(tmp_path / "keep.mrc", np.ones((2, 4, 4), np.float32))
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match=r"keep\.mrc: file exists; pass overwrite=True"):
        data.write_stack(path, np.zeros((3, 4, 4), np.float32))
    assert path.read_bytes() == before
    data.write_stack(path, np.zeros((3, 4, 4), np.float32), overwrite=True)
    with data.open_stack(path) as stack:
        assert stack.shape == (3, 4, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.mrc"]  # no temporary files left behind


def test_an_interrupted_or_incomplete_write_leaves_the_previous_file_intact(tmp_path):
    path = data.write_stack(tmp_path / "old.mrc", np.full((2, 4, 4), 7, np.float32))
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with data.stack_writer(path, (5, 4, 4), overwrite=True) as w:
            w.write(0, np.zeros((3, 4, 4)))
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match=r"2 particle\(s\) never written \(first: 3\)"):
        with data.stack_writer(path, (5, 4, 4), overwrite=True) as w:
            w.write(0, np.zeros((3, 4, 4)))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.mrc"]


def test_stack_writer_fills_a_stack_in_pieces_and_sets_the_header_statistics(tmp_path):
    images = np.random.default_rng(1).normal(3.0, 2.0, size=(10, 8, 6)).astype(np.float32)
    with data.stack_writer(tmp_path / "w.mrc", (10, 8, 6), voxel_size=0.8) as w:
        for start in (6, 0, 3):  # any order
            w.write(start, images[start:start + (4 if start == 6 else 3)])
    with mrcfile.open(tmp_path / "w.mrc") as mrc:
        np.testing.assert_array_equal(mrc.data, images)
        assert mrc.header.ispg == 0  # an image stack, not a volume
        assert mrc.voxel_size.x == pytest.approx(0.8)
        np.testing.assert_allclose([mrc.header.dmin, mrc.header.dmax, mrc.header.dmean, mrc.header.rms],
                                   [images.min(), images.max(), images.mean(), images.std()], rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------------
# The chunked shuffle-buffer stream
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def three_stacks(tmp_path):
    """Three stacks of 101, 37 and 65 particles (ids 0..202): 203 particles, far more than the buffers below."""
    return [index_stack(tmp_path / "a.mrc", 101), index_stack(tmp_path / "b.mrc", 37, start=101),
            index_stack(tmp_path / "c.mrc", 65, start=138)]


def test_each_particle_appears_exactly_once_per_epoch_and_the_buffer_never_exceeds_buffer_size(three_stacks):
    with data.ParticleStream(three_stacks, 16, buffer_size=40, chunk_size=5, seed=3, drop_last=False,
                             normalize=None) as stream:
        assert stream.n_particles == 203 and len(stream) == 13
        assert stream.buffer_nbytes == 40 * 6 * 5 * 4
        for epoch in range(3):
            batches = list(stream.epoch(epoch, with_indices=True))
            assert [len(x) for x, _ in batches] == [16] * 12 + [11]
            for x, idx in batches:
                assert x.shape[1:] == (6, 5, 1) and x.dtype == np.float32
                np.testing.assert_array_equal(ids_of(x), idx)  # the indices name the particles yielded
            seen = np.concatenate([idx for _, idx in batches])
            np.testing.assert_array_equal(np.sort(seen), np.arange(203))
        assert stream.peak_buffered == 40  # the buffer fills up, and never beyond


def test_the_same_seed_and_epoch_repeat_exactly_while_epochs_and_seeds_differ(three_stacks):
    def order(seed, epoch):
        with data.ParticleStream(three_stacks, 8, buffer_size=32, seed=seed, normalize=None) as stream:
            return np.concatenate([ids_of(x) for x in stream.epoch(epoch)])

    first = order(0, 1)
    np.testing.assert_array_equal(first, order(0, 1))
    with data.ParticleStream(three_stacks, 8, buffer_size=32, seed=0, normalize=None) as stream:
        list(stream.epoch(5))  # other epochs in between change nothing
        np.testing.assert_array_equal(np.concatenate([ids_of(x) for x in stream.epoch(1)]), first)
    assert not np.array_equal(first, order(0, 2))
    assert not np.array_equal(first, order(1, 1))
    assert not np.array_equal(first, np.sort(first))


def test_drop_last_drops_only_the_final_partial_batch(three_stacks):
    with data.ParticleStream(three_stacks, 16, buffer_size=40, seed=0, normalize=None) as stream:
        batches = [ids_of(x) for x in stream.epoch(0)]
    assert len(batches) == 203 // 16 and all(len(b) == 16 for b in batches)
    assert len(np.unique(np.concatenate(batches))) == 192  # 11 particles dropped, none repeated


def test_without_shuffle_batches_follow_file_order_across_files(three_stacks):
    with data.ParticleStream(three_stacks, 30, buffer_size=30, seed=0, shuffle=False, drop_last=False,
                             normalize=None) as stream:
        batches = [ids_of(x) for x in stream.epoch(0)]
        assert stream.peak_buffered == 30
    np.testing.assert_array_equal(np.concatenate(batches), np.arange(203))
    assert [len(b) for b in batches] == [30] * 6 + [23]


def test_a_batch_mixes_many_chunks_as_the_docstring_predicts(tmp_path):
    # S = 256, c = 8, B = 32: a particle has about (c - 1) B / (2 S - B) = 0.47 same-chunk companions in its batch.
    index_stack(tmp_path / "s.mrc", 2048, h=2, w=2)
    with data.ParticleStream(tmp_path / "s.mrc", 32, buffer_size=256, chunk_size=8, seed=0,
                             normalize=None) as stream:
        companions = []
        positions = np.empty(2048)
        for k, x in enumerate(stream.epoch(0)):
            chunk = ids_of(x) // 8
            companions.append(np.mean([np.sum(chunk == c) - 1 for c in chunk]))
            positions[ids_of(x)] = k
    assert 0.35 < np.mean(companions) < 0.6
    # Particles travel far from their file position: the order is not close to the identity.
    assert abs(np.corrcoef(np.arange(2048), positions)[0, 1]) < 0.5


def test_stacks_must_share_the_image_size_and_the_error_names_the_odd_file(tmp_path):
    index_stack(tmp_path / "a.mrc", 5)
    index_stack(tmp_path / "odd.mrc", 5, h=7)
    with pytest.raises(ValueError, match=r"odd\.mrc has images of 7 x 5 but .*a\.mrc has 6 x 5"):
        data.ParticleStream([tmp_path / "a.mrc", tmp_path / "odd.mrc"], 2, buffer_size=4, seed=0)


def test_bad_stream_arguments_are_named(tmp_path):
    index_stack(tmp_path / "a.mrc", 5)
    with pytest.raises(ValueError, match=r"'buffer_size' \(4\) must be >= 'batch_size' \(8\)"):
        data.ParticleStream(tmp_path / "a.mrc", 8, buffer_size=4, seed=0)
    with pytest.raises(ValueError, match=r"'chunk_size' must be an integer in \[1, buffer_size - batch_size \+ 1 = 5"):
        data.ParticleStream(tmp_path / "a.mrc", 4, buffer_size=8, chunk_size=6, seed=0)
    with pytest.raises(ValueError, match="'normalize' must be 'per_particle' or None"):
        data.ParticleStream(tmp_path / "a.mrc", 4, buffer_size=8, seed=0, normalize="global")
    with pytest.raises(ValueError, match="'seed' must be an integer >= 0"):
        data.ParticleStream(tmp_path / "a.mrc", 4, buffer_size=8, seed=-1)


def test_the_stream_closes_the_stacks_it_opened_but_not_the_ones_it_was_given(tmp_path):
    index_stack(tmp_path / "a.mrc", 5)
    with data.open_stack(index_stack(tmp_path / "b.mrc", 5)) as given:
        with data.ParticleStream([tmp_path / "a.mrc", given], 2, buffer_size=4, seed=0) as stream:
            opened = stream.sources[0]
        assert opened.closed and not given.closed


def test_per_particle_normalization_gives_zero_mean_unit_std_and_zeros_for_constant_images():
    rng = np.random.default_rng(0)
    images = rng.normal(5.0, 3.0, size=(4, 16, 16)).astype(np.float32)
    images[1] = 1234.5  # constant
    images[2] = 1e-3 * rng.normal(size=(16, 16))  # small but genuine variation
    out = data.normalize_per_particle(images)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[1], 0)
    for k in (0, 2, 3):
        assert abs(out[k].mean()) < 1e-6 and out[k].std() == pytest.approx(1, rel=1e-5)
    stream = data.ParticleStream(images, 4, buffer_size=4, seed=0, shuffle=False)
    np.testing.assert_array_equal(next(stream.epoch(0))[..., 0], out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_streaming_a_200_mb_stack_grows_the_rss_by_about_the_buffer_not_the_file(tmp_path):
    """The resident set size grows by at most the buffer + a few batches + allocator slack, not by the 200 MB.

    Control at the end: reading the same file through a plain memory map (no page release) does grow it by ~200 MB,
    which shows the measurement would catch mapped pages that are never given back."""
    n, h, w, b, s = 3200, 128, 128, 32, 256  # 3200 x 64 KiB = 200 MiB; buffer 16 MiB; batch 2 MiB
    path = tmp_path / "big.mrc"
    with data.stack_writer(path, (n, h, w)) as writer:
        for start in range(0, n, 400):
            writer.write(start, np.random.default_rng(start).standard_normal((400, h, w), dtype=np.float32))

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    with data.ParticleStream(path, b, buffer_size=s, seed=0) as stream:
        gc.collect()
        base = rss()
        peak, seen = base, 0
        for x in stream.epoch(0):
            seen += len(x)
            peak = max(peak, rss())
            del x
        assert seen == n and stream.peak_buffered <= s
        bound = stream.buffer_nbytes + 8 * b * h * w * 4 + (32 << 20)
        assert peak - base < bound, f"RSS grew by {(peak - base) >> 20} MiB (bound {bound >> 20} MiB)"
    with mrcfile.mmap(path, mode="r") as mrc:  # control: a plain memory map keeps every page it touched
        base = rss()
        for start in range(0, n, 400):
            float(mrc.data[start:start + 400].sum(dtype=np.float64))
        grown = rss() - base
    assert grown > (150 << 20), f"control: plain mmap only grew the RSS by {grown >> 20} MiB"


# ------------------------------------------------------------------------------------------------------------------
# Noise2Noise pairs
# ------------------------------------------------------------------------------------------------------------------

def test_pairs_from_two_aligned_stacks_stay_aligned_and_are_shuffled_jointly(tmp_path):
    a = [index_stack(tmp_path / "even0.mrc", 50), index_stack(tmp_path / "even1.mrc", 30, start=50)]
    # the targets of particle i are the constant images -i
    b = [data.write_stack(tmp_path / f"odd{k}.mrc", -np.arange(lo, hi)[:, None, None] * np.ones((1, 6, 5)))
         for k, (lo, hi) in enumerate([(0, 50), (50, 80)])]
    with data.ParticleStream(None, 8, pairs=(a, b), buffer_size=24, seed=1, drop_last=False,
                             normalize=None) as stream:
        assert stream.buffer_nbytes == 2 * 24 * 6 * 5 * 4  # a slot holds the input and the target
        seen = []
        for x, y, idx in stream.epoch(0, with_indices=True):
            assert x.shape == y.shape and x.shape[1:] == (6, 5, 1)
            np.testing.assert_array_equal(ids_of(x), idx)
            np.testing.assert_array_equal(ids_of(-y), idx)
            seen.append(idx)
        assert stream.peak_buffered <= 24
    seen = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(seen), np.arange(80))
    assert not np.array_equal(seen, np.arange(80))


def test_paired_stacks_of_different_length_or_size_are_rejected_naming_both_files(tmp_path):
    index_stack(tmp_path / "even.mrc", 10)
    index_stack(tmp_path / "odd.mrc", 9)
    with pytest.raises(ValueError, match=r"paired stacks differ: .*even\.mrc is 10 x 6 x 5 but .*odd\.mrc is "
                                         r"9 x 6 x 5"):
        data.ParticleStream(None, 2, pairs=(tmp_path / "even.mrc", tmp_path / "odd.mrc"), buffer_size=4, seed=0)
    with pytest.raises(ValueError, match=r"1 input stack\(s\) but 2 target"):
        data.ParticleStream(None, 2, pairs=([tmp_path / "even.mrc"], [tmp_path / "odd.mrc"] * 2), buffer_size=4,
                            seed=0)
    with pytest.raises(ValueError, match="either 'paths_or_stacks' or 'pairs"):
        data.ParticleStream(tmp_path / "even.mrc", 2, pairs=(tmp_path / "even.mrc", tmp_path / "odd.mrc"),
                            buffer_size=4, seed=0)


def test_synthetic_stacks_stream_as_noise2noise_pairs_of_the_same_clean_projection(tmp_path):
    paths = synthetic.write_synthetic_stacks(tmp_path, 24, 16, snr=1.0, seed=5, chunk=10)
    with data.ParticleStream(None, 4, pairs=(paths["noisy_a"], paths["noisy_b"]), buffer_size=12, seed=0,
                             normalize=None) as stream, data.open_stack(paths["clean"]) as clean:
        for x, y, idx in stream.epoch(0, with_indices=True):
            c = clean.read(idx)[..., None]
            noise_x, noise_y = x - c, y - c
            assert np.all(np.abs(noise_x) > 0) and not np.allclose(noise_x, noise_y)


def test_synthetic_pairs_on_the_fly_are_deterministic_per_epoch_and_fresh_across_epochs():
    pairs = synthetic.SyntheticPairs(16, 4, snr=2.0, seed=1, batches_per_epoch=3, normalize=None)
    e0 = list(pairs.epoch(0, with_clean=True))
    assert len(e0) == len(pairs) == 3
    for x, y, c in e0:
        assert x.shape == y.shape == c.shape == (4, 16, 16, 1) and x.dtype == np.float32
        noise = (x - c).ravel(), (y - c).ravel()
        assert abs(np.corrcoef(*noise)[0, 1]) < 0.1  # independent noise, same clean image
    for (x, y, c), (x2, y2, c2) in zip(e0, pairs.epoch(0, with_clean=True)):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(e0[0][2], next(pairs.epoch(1, with_clean=True))[2])  # new views next epoch
    x, y = next(synthetic.SyntheticPairs(16, 4, snr=2.0, seed=1, batches_per_epoch=1).epoch(0))
    assert abs(x[0].mean()) < 1e-5 and x[0].std() == pytest.approx(1, rel=1e-4)


# ------------------------------------------------------------------------------------------------------------------
# Synthetic particles
# ------------------------------------------------------------------------------------------------------------------

def gaussian_image(size, sigma, amplitude=1.0, center=(0.0, 0.0)):
    """Line integral along z of a centred 3-D Gaussian: a 2-D Gaussian of mass a (2 pi)^(3/2) sigma^3."""
    ax = np.arange(size) - size // 2
    yy, xx = np.meshgrid(ax - center[1], ax - center[0], indexing="ij")
    return amplitude * np.sqrt(2 * np.pi) * sigma * np.exp(-(xx ** 2 + yy ** 2) / (2 * sigma ** 2))


def test_the_projection_of_a_centred_blob_is_a_2d_gaussian_of_the_same_mass():
    size, sigma = 32, 2.5
    blob = synthetic.blob_density(size, [(0, 0, 0)], sigma, 1.0)
    mass = blob.sum(dtype=np.float64)
    assert mass == pytest.approx((2 * np.pi) ** 1.5 * sigma ** 3, rel=1e-6)
    image = synthetic.project(blob, np.eye(3))
    np.testing.assert_allclose(image, blob.sum(axis=0), rtol=1e-6)  # identity: a plain sum over z
    np.testing.assert_allclose(image, gaussian_image(size, sigma), atol=1e-5)
    for rotation in synthetic.random_rotations(0, 3):  # an isotropic blob looks the same from every direction
        image = synthetic.project(blob, rotation)
        assert image.sum(dtype=np.float64) == pytest.approx(mass, rel=2e-3)
        np.testing.assert_allclose(image, gaussian_image(size, sigma), atol=0.03 * image.max())


def test_projection_conserves_the_mass_of_a_random_density_under_random_rotations():
    density = synthetic.random_density(7, 24)
    mass = density.sum(dtype=np.float64)
    for rotation in synthetic.random_rotations(1, 4):
        assert synthetic.project(density, rotation).sum(dtype=np.float64) == pytest.approx(mass, rel=5e-3)


def test_a_90_degree_rotation_about_z_rotates_the_image_and_moves_plus_x_to_plus_y():
    size = 24
    c = size // 2
    rz90 = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    blob = synthetic.blob_density(size, [(6, 0, 2)], 1.5, 1.0)  # on the +x axis (z offset projects away)
    assert np.unravel_index(synthetic.project(blob, np.eye(3)).argmax(), (size, size)) == (c, c + 6)
    assert np.unravel_index(synthetic.project(blob, rz90).argmax(), (size, size)) == (c + 6, c)
    density = synthetic.random_density(3, size)
    plain, turned = synthetic.project(density, np.eye(3)), synthetic.project(density, rz90)
    # image[y, x] -> image[x', y'] with (x', y') = (-y, x) about the centre: one np.rot90 of the centred grid.
    np.testing.assert_allclose(turned[1:, 1:], np.rot90(plain[1:, 1:], k=1, axes=(1, 0)), rtol=1e-5, atol=1e-6)


def test_random_rotations_are_proper_and_uniformly_distributed():
    rotations = synthetic.random_rotations(np.random.default_rng(0), 4000)
    assert rotations.shape == (4000, 3, 3)
    np.testing.assert_allclose(rotations @ rotations.transpose(0, 2, 1), np.broadcast_to(np.eye(3), (4000, 3, 3)),
                               atol=1e-12)
    np.testing.assert_allclose(np.linalg.det(rotations), 1, atol=1e-12)
    # Haar measure: every column is uniform on the sphere (mean 0, second moments I/3) and, the trace of R being
    # 1 + 2 cos(angle), E[trace] = 0 and E[trace^2] = 1.
    se = 1 / np.sqrt(4000)
    for col in range(3):
        v = rotations[:, :, col]
        np.testing.assert_allclose(v.mean(0), 0, atol=5 * se)
        np.testing.assert_allclose(v.T @ v / 4000, np.eye(3) / 3, atol=5 * se)
    trace = np.trace(rotations, axis1=1, axis2=2)
    assert abs(trace.mean()) < 5 * se and trace.var() == pytest.approx(1, abs=5 * 1.5 * se)
    np.testing.assert_array_equal(synthetic.random_rotations(5, 3), synthetic.random_rotations(5, 3))


def test_make_particles_has_the_requested_snr_and_independent_noise_in_a_and_b():
    n, size, snr = 64, 24, 0.25
    p = synthetic.make_particles(n, size, snr=snr, seed=0)
    assert {k: p[k].shape for k in ("clean", "noisy_a", "noisy_b")} == {k: (n, size, size)
                                                                        for k in ("clean", "noisy_a", "noisy_b")}
    assert p["clean"].dtype == np.float32 and p["rotations"].shape == (n, 3, 3)
    signal = p["clean"].var(axis=(1, 2), dtype=np.float64)
    for noisy in (p["noisy_a"], p["noisy_b"]):
        measured = signal / (noisy - p["clean"]).var(axis=(1, 2), dtype=np.float64)
        # the variance of m = size^2 Gaussian samples has relative std sqrt(2 / m)
        rel = np.sqrt(2 / size ** 2)
        assert np.all(np.abs(measured / snr - 1) < 5 * rel)
        assert abs(measured.mean() / snr - 1) < 5 * rel / np.sqrt(n)
    noise_a, noise_b = (p["noisy_a"] - p["clean"]).ravel(), (p["noisy_b"] - p["clean"]).ravel()
    assert abs(np.corrcoef(noise_a, noise_b)[0, 1]) < 5 / np.sqrt(noise_a.size)
    # the clean images are projections of the returned density
    np.testing.assert_allclose(p["clean"][3], synthetic.project(p["density"], p["rotations"][3]), rtol=1e-6)


def test_make_particles_is_deterministic_by_seed():
    a = synthetic.make_particles(4, 16, snr=1.0, seed=11)
    b = synthetic.make_particles(4, 16, snr=1.0, seed=11)
    c = synthetic.make_particles(4, 16, snr=1.0, seed=12)
    for k in ("clean", "noisy_a", "noisy_b", "rotations", "density"):
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["density"], c["density"]) and not np.array_equal(a["noisy_a"], c["noisy_a"])
    np.testing.assert_array_equal(synthetic.random_density(3, 16), synthetic.random_density(3, 16))


def test_write_synthetic_stacks_writes_make_particles_chunk_by_chunk_and_refuses_to_overwrite(tmp_path):
    expected = synthetic.make_particles(21, 16, snr=0.5, seed=2)
    paths = synthetic.write_synthetic_stacks(tmp_path, 21, 16, 0.5, 2, chunk=8, voxel_size=1.7)
    for key in ("clean", "noisy_a", "noisy_b"):
        with data.open_stack(paths[key]) as stack:
            assert stack.shape == (21, 16, 16) and stack.voxel_size == pytest.approx(1.7)
            np.testing.assert_array_equal(stack.read(slice(None)), expected[key])
    with mrcfile.open(paths["density"]) as mrc:
        np.testing.assert_array_equal(mrc.data, expected["density"])
    stamp = paths["clean"].read_bytes()
    with pytest.raises(FileExistsError, match="clean.mrc"):
        synthetic.write_synthetic_stacks(tmp_path, 5, 16, 0.5, 3)
    assert paths["clean"].read_bytes() == stamp
    synthetic.write_synthetic_stacks(tmp_path, 5, 16, 0.5, 3, overwrite=True)
    with data.open_stack(paths["clean"]) as stack:
        assert len(stack) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left behind


def test_synthetic_arguments_are_validated_with_their_names():
    with pytest.raises(ValueError, match="'snr' must be > 0"):
        synthetic.make_particles(2, 8, snr=0, seed=0)
    with pytest.raises(ValueError, match="'rotation' must be a proper rotation"):
        synthetic.project(np.zeros((8, 8, 8)), np.diag([1.0, 1.0, -1.0]))
    with pytest.raises(ValueError, match=r"'density' must be a cube \[D, D, D\]"):
        synthetic.project(np.zeros((8, 8, 4)), np.eye(3))
