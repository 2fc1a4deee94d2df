"""Bad input anywhere in jaxgrad's public API or CLI gets one clear error naming the argument, and no user file is
changed.

Every case below calls a public function (KAN, CNN, LoRA, ``jaxgrad.verify``) or the ``jaxgrad`` command line with
an input that is wrong in one way -- a shape, a dtype, a range, a type, a file that is missing, truncated or
corrupt, an output path that already holds the user's files -- and asserts the contract:

* **API**: the call raises a ``ValueError`` / ``TypeError`` / ``OSError`` (or one of the package's subclasses:
  ``AdapterError``, ``CheckpointError``, ``MRCFormatError``, ...) whose message is one short line that names the
  argument (or the file) and what was expected, raised by jaxgrad's own checks -- never a raw ``KeyError``,
  ``AttributeError`` or an error from deep inside JAX, NumPy or safetensors (the innermost frame of the traceback
  must be in the ``jaxgrad`` package);
* **CLI**: exit status 2, exactly one ``error:`` line on stderr, no traceback;
* **files**: the SHA-256 of every file in the user's directory is the same before and after the failed call.

Shapes, dtypes and truncation points are drawn by hypothesis where a family of inputs shares one rule. Cases that
still fail the contract because of code in modules this file does not fix are marked ``xfail(strict=True)`` with
the reason: when the module is fixed, the strict xfail turns into a failure and the mark must go.
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import re
import shutil
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxgrad

PKG = pathlib.Path(jaxgrad.__file__).resolve().parent
DATA = pathlib.Path(__file__).parent / "fixtures"
PEFT_DIR, BASE_DIR = DATA / "lora_peft_adapter", DATA / "lora_peft_base"
API_ERRORS = (ValueError, TypeError, OSError, LookupError)
HYP = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------------------------
def raises_clearly(fn, names: str, types=API_ERRORS) -> Exception:
    """``fn()`` raises one of ``types`` from jaxgrad's own code, with a one-line message matching ``names``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- the point is to inspect whatever came out
        error = exc
    else:
        raise AssertionError(f"no error raised (expected one naming {names!r})")
    msg = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    where = traceback.extract_tb(error.__traceback__)[-1]
    origin = f"{type(error).__name__} from {where.filename}:{where.lineno}: {msg[:300]}"
    assert isinstance(error, types), origin
    assert pathlib.Path(where.filename).resolve().is_relative_to(PKG), f"raw error from outside jaxgrad: {origin}"
    assert msg and "\n" not in msg.strip() and len(msg) <= 400, f"not one short line: {origin}"
    assert " " in msg.strip(), f"a bare key or value, not a message (a raw KeyError?): {origin}"
    assert re.search(names, msg), f"the message does not name {names!r}: {origin}"
    return error


def digest(directory: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def unchanged(directory: pathlib.Path):
    """Every file under ``directory`` has the same bytes afterwards, and none was added or removed."""
    before = digest(directory)
    yield
    assert digest(directory) == before, f"files under {directory} changed"


@pytest.fixture
def user_dir(tmp_path):
    """A user's directory: notes, a config, a PEFT adapter and a Hugging Face checkpoint they care about."""
    d = tmp_path / "user"
    d.mkdir()
    (d / "notes.txt").write_text("my notes\n")
    (d / "kan.toml").write_text("[train]\nsteps = 3\n")
    shutil.copytree(PEFT_DIR, d / "adapter")
    shutil.copytree(BASE_DIR, d / "base")
    return d


def xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


def named(rows):
    """Parametrize rows ``(..., names)`` (tuples or ``pytest.param``), each with the id of what it must name."""
    out = []
    for row in rows:
        values, marks = (row.values, row.marks) if hasattr(row, "values") else (row, ())
        slug = re.sub(r"[^A-Za-z0-9_'.=]+", " ", values[-1]).strip()[:48]
        out.append(pytest.param(*values, marks=marks, id=slug))
    return out


KEY = jax.random.key(0)
NONFLOAT = st.sampled_from([jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64])


# ---------------------------------------------------------------------------------------------------------------
# KAN
# ---------------------------------------------------------------------------------------------------------------
def _kan_layer(in_f=2, out_f=3):
    from jaxgrad.kan import KANConfig, init

    return init(KEY, KANConfig(in_f, out_f))


@pytest.mark.parametrize("call, names", named([
    (lambda k: k.init(KEY, 4, 3), r"'cfg' must be a KANConfig.*KANConfig\(4, 3\)"),
    (lambda k: k.init(KEY, {"in_features": 4, "out_features": 3}), "'cfg' must be a KANConfig"),
    (lambda k: k.init(3, k.KANConfig(2, 3)), "'key' must be a JAX PRNG key"),
    (lambda k: k.init(KEY, k.KANConfig(2, 3), jnp.int32), "'dtype' must be a floating dtype"),
    (lambda k: k.KANConfig("4", 3), "in_features must be an int"),
    (lambda k: k.KANConfig(2.5, 3), "in_features must be an int"),
    (lambda k: k.KANConfig(True, 3), "in_features must be an int"),
    (lambda k: k.KANConfig(2, 3, grid_size=0), "grid_size must be >= 1"),
    (lambda k: k.KANConfig(2, 3, spline_order=6), "spline_order must be in 1..5"),
    (lambda k: k.KANConfig(2, 3, grid_range=(0, 1, 2)), "grid_range must be a pair"),
    (lambda k: k.KANConfig(2, 3, grid_range=(1.0, float("nan"))), "grid_range must satisfy lo < hi"),
    (lambda k: k.KANConfig(2, 3, grid_eps=2.0), r"grid_eps must be in \[0, 1\]"),
    (lambda k: k.KANConfig(2, 3, scale_noise=float("inf")), "scale_noise must be a finite number"),
    (lambda k: k.KANConfig(2, 3, bias="yes"), "bias must be True or False"),
    (lambda k: k.kan_init(KEY, 4), "'widths' must be a list"),
    (lambda k: k.kan_init(KEY, [4]), "'widths' needs at least"),
    (lambda k: k.kan_init(KEY, [4, 0]), "'widths' must be >= 1"),
    (lambda k: k.kan_init(KEY, [4, 3], grid=5), "unknown layer setting 'grid'"),
    (lambda k: k.kan_init(KEY, [4, 3], in_features=4), "in_features"),
    (lambda k: k.kan_init(0, [4, 3]), "'key' must be a JAX PRNG key"),
    (lambda k: k.kan_init(KEY, [4, 3], dtype="int8"), "'dtype' must be a floating dtype"),
]))
def test_kan_construction(call, names):
    from jaxgrad import kan

    raises_clearly(lambda: call(kan), names)


def test_kan_grid_range_from_a_toml_list_is_accepted():
    # a TOML array arrives as a list; the config is a static (hashed) argument of the compiled init
    from jaxgrad import kan

    assert kan.kan_init(KEY, [2, 3], grid_range=[-2, 2])[0]["grid"].shape == (2, 12)


@HYP
@given(in_f=st.integers(1, 4), wrong=st.integers(1, 6), lead=st.lists(st.integers(0, 3), max_size=2))
def test_kan_linear_x_with_the_wrong_feature_count_is_named(in_f, wrong, lead):
    from jaxgrad.kan import kan_apply, kan_linear

    if wrong == in_f:
        wrong += 1
    p = _kan_layer(in_f, 2)
    x = jnp.zeros((*lead, wrong))
    raises_clearly(lambda: kan_linear(p, x), rf"'x' must have shape \[\.\.\., {in_f}\]")
    raises_clearly(lambda: kan_apply([p], x), rf"'x' must have shape \[\.\.\., {in_f}\]")


@HYP
@given(dtype=NONFLOAT)
def test_kan_linear_non_float_x_is_named(dtype):
    from jaxgrad.kan import kan_linear

    raises_clearly(lambda: kan_linear(_kan_layer(), jnp.zeros((3, 2), dtype)), "'x' must be floating point")


@pytest.mark.parametrize("change, names", named([
    (lambda p: {k: v for k, v in p.items() if k != "spline_scaler"}, "missing 'spline_scaler'"),
    (lambda p: {**p, "base_weight": p["base_weight"][0]}, r"'base_weight' must have shape \[out, in\]"),
    (lambda p: {**p, "spline_weight": p["spline_weight"][..., 0]}, r"'spline_weight' must have shape"),
    (lambda p: {**p, "spline_scaler": p["spline_scaler"][:1]}, "'spline_scaler' must have shape"),
    (lambda p: {**p, "grid": p["grid"][:, ::-1]}, "'grid' must be non-decreasing"),
    (lambda p: {**p, "spline_weight": p["spline_weight"].astype(jnp.int32)}, "'spline_weight' must be floating"),
    (lambda p: [p], "'params' must be a dict"),
]))
def test_kan_linear_bad_params_are_named(change, names):
    from jaxgrad.kan import kan_linear

    raises_clearly(lambda: kan_linear(change(_kan_layer()), jnp.zeros((3, 2))), names)


@pytest.mark.parametrize("kwargs, names", named([
    (dict(backend="cuda"), "backend"), (dict(precision="ultra"), "'precision' must be"),
    (dict(spline_order=4), "'grid' has 12 knots"), (dict(spline_order=0), "'spline_order' must be an int in 1..5"),
]))
def test_kan_linear_bad_options_are_named(kwargs, names):
    from jaxgrad.kan import kan_linear

    raises_clearly(lambda: kan_linear(_kan_layer(), jnp.zeros((3, 2)), **kwargs), names)


@pytest.mark.parametrize("call, names", named([
    (lambda s, g: s.bspline_basis(jnp.zeros((4, 2), jnp.int32), g, 3), "'x' must be a floating-point array"),
    (lambda s, g: s.bspline_basis(jnp.zeros((4, 2)), g, 6), "'spline_order'"),
    (lambda s, g: s.bspline_basis(jnp.zeros((4, 2)), g[0], 3), "'grid' must have shape"),
    (lambda s, g: s.bspline_basis_derivative(jnp.zeros((4, 2)), g, 0), "'spline_order'"),
    (lambda s, g: s.make_grid(2, 0, 3), "grid_size must be >= 1"),
    (lambda s, g: s.make_grid(2, 5, 3, (1.0, -1.0)), "grid_range must satisfy lo < hi"),
    (lambda s, g: s.bspline_basis(jnp.zeros((4, 3)), g, 3), r"'x' must have shape \[\.\.\., in\] with in = 2"),
    (lambda s, g: s.bspline_basis_derivative(jnp.zeros(()), g, 3), r"'x' must have shape \[\.\.\., in\]"),
    (lambda s, g: s.make_grid(2, 5, 3, 1.0), "grid_range must be a pair of numbers"),
    (lambda s, g: s.make_grid(2, 5, 3, (-1.0, float("inf"))), "grid_range must satisfy lo < hi"),
    (lambda s, g: s.make_grid(2.5, 5, 3), "in_features must be an int"),
    (lambda s, g: s.make_grid(True, 5, 3), "in_features must be an int"),
    (lambda s, g: s.make_grid(0, 5, 3), "in_features must be >= 1"),
    (lambda s, g: s.make_grid(2, 2.5, 3), "grid_size must be an int"),
    (lambda s, g: s.curve_to_coefficients(jnp.zeros((6, 2)), jnp.zeros((6, 3, 1)), g, 3),
     r"'y' must have shape \[n, in, out\] = \[6, 2, out\]"),
    (lambda s, g: s.curve_to_coefficients(jnp.zeros((6, 3)), jnp.zeros((6, 3, 1)), g, 3),
     r"'x' must have shape \[\.\.\., in\] with in = 2"),
    (lambda s, g: s.curve_to_coefficients(jnp.zeros(6), jnp.zeros((6, 2, 1)), g, 3), r"'x' must have shape \[n, in\]"),
    (lambda s, g: s.curve_to_coefficients(jnp.zeros((6, 2)), jnp.zeros((6, 2, 1), jnp.int32), g, 3),
     "'y' must be a floating-point array"),
    (lambda s, g: s.curve_to_coefficients(jnp.zeros((6, 2)), jnp.zeros((6, 2, 1)), g, 3, ridge=-1.0), "'ridge'"),
]))
def test_bspline_helpers(call, names):
    from jaxgrad.kan import spline

    raises_clearly(lambda: call(spline, spline.make_grid(2, 5, 3)), names)


# ---------------------------------------------------------------------------------------------------------------
# CNN: conv2d, layout helpers, the denoiser, MRC files
# ---------------------------------------------------------------------------------------------------------------
@HYP
@given(cin=st.integers(1, 5), xc=st.integers(1, 5), k=st.sampled_from([1, 3]), cout=st.integers(1, 4))
def test_conv2d_channel_mismatch_is_named(cin, xc, k, cout):
    from jaxgrad.cnn import conv2d

    if xc == cin:
        xc += 1
    raises_clearly(lambda: conv2d(jnp.zeros((1, 6, 6, xc)), jnp.zeros((k, k, cin, cout))),
                   rf"x has {xc} channels .* but w expects Cin={cin}")


@HYP
@given(c=st.integers(1, 4), k=st.integers(1, 4), cout=st.integers(1, 9), bias=st.booleans())
def test_conv2d_a_pytorch_weight_is_never_silently_misread(c, k, cout, bias):
    """nn.Conv2d(c, cout, k).weight [cout, c, k, k] passed as it is: either it fails the shape checks, or (when
    it also reads as HWIO) the error names layout.torch_weight_to_hwio -- except [c, c, c, c], the same shape in
    both layouts (documented)."""
    from jaxgrad.cnn import conv2d

    w = jnp.ones((cout, c, k, k))
    b = jnp.ones((cout,)) if bias else None
    x = jnp.ones((1, 6, 6, c))
    if (cout, k) == (c, c):
        return
    err = raises_clearly(lambda: conv2d(x, w, b, padding="SAME"), r"\bw\b|\bb\b|kernel")
    if k == c:  # the one family whose OIHW shape is also a valid HWIO shape for x: named as OIHW
        assert "torch_weight_to_hwio" in str(err)


@pytest.mark.parametrize("kwargs, names", named([
    (dict(stride=0), "stride"), (dict(stride=1.5), "stride"), (dict(dilation=(1, 0)), "dilation"),
    (dict(padding="FULL"), "padding"), (dict(padding=(1, 1)), "padding"), (dict(padding=-1), "padding"),
    (dict(activation="gelu"), "activation"), (dict(backend="cudnn"), "backend"),
    (dict(precision="ultra"), "'precision' must be"), (dict(layout="OIHW"), "layout must be None or 'HWIO'"),
]))
def test_conv2d_bad_options_are_named(kwargs, names):
    from jaxgrad.cnn import conv2d

    raises_clearly(lambda: conv2d(jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4)), **kwargs), names)


@pytest.mark.parametrize("args, padding, names", named([
    ((jnp.ones((1, 6, 6, 2)), jnp.ones((0, 3, 2, 4))), "SAME", "kernel must be at least 1x1"),
    ((jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4)), jnp.ones((3,))), "SAME", r"b must have shape \(Cout,\)"),
    ((jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4)), jnp.ones((4,), jnp.int32)), "SAME", "b must be floating"),
    ((jnp.ones((6, 6, 2)), jnp.ones((3, 3, 2, 4))), "SAME", "x must have rank 4"),
    (([[1.0]], jnp.ones((3, 3, 2, 4))), "SAME", "x must be an array"),
    ((jnp.ones((1, 6, 6, 2), jnp.bfloat16), jnp.ones((3, 3, 2, 4))), "SAME", "x and w must have the same dtype"),
    ((jnp.ones((1, 2, 6, 2)), jnp.ones((5, 3, 2, 4))), "VALID", "kernel spans 5 pixels along H"),
]))
def test_conv2d_bad_arrays_are_named(args, padding, names):
    from jaxgrad.cnn import conv2d

    raises_clearly(lambda: conv2d(*args, padding=padding), names)


@pytest.mark.parametrize("call, names", named([
    (lambda L: L.torch_weight_to_hwio(np.zeros((3, 3, 3))), "torch_weight_to_hwio: 'w_oihw' must be a 4-D"),
    (lambda L: L.hwio_to_torch_weight(np.zeros(3)), "hwio_to_torch_weight: 'w_hwio' must be a 4-D"),
    (lambda L: L.nchw_to_nhwc(np.zeros((2, 3))), "nchw_to_nhwc: 'x' must be a 4-D"),
    (lambda L: L.flip_kernel(np.zeros((3, 3))), "flip_kernel: 'w_hwio' must be a 4-D"),
    (lambda L: L.from_torch_state_dict([np.zeros((4, 3, 3, 3))]), "'state_dict' must be a mapping"),
    (lambda L: L.from_torch_state_dict({"fc.weight": np.zeros((3, 4))}), "no 4-D '\\*.weight' entries"),
    (lambda L: L.from_torch_state_dict({"0.weight": np.zeros((4, 3, 3, 3)), "0.bias": np.zeros(5)}),
     r"'0.bias' has shape \(5,\).*Cout=4"),
    (lambda L: L.to_torch_state_dict({"w": np.zeros((3, 3, 1, 4))}), "'layers' must be a list"),
    (lambda L: L.to_torch_state_dict([{"b": np.zeros(4)}]), "'layers' must be a list of \\{'w'"),
    (lambda L: L.to_torch_state_dict([{"w": np.zeros((3, 3, 1, 4))}], names=["a", "b"]), "1 layers but 2 names"),
]))
def test_layout_helpers(call, names):
    from jaxgrad.cnn import layout

    raises_clearly(lambda: call(layout), names)


@pytest.mark.parametrize("call, names", named([
    (lambda d: d.DenoiserConfig(3), "channels must be a sequence"),
    (lambda d: d.DenoiserConfig((1, 0, 1)), "channels must be >= 2 positive ints"),
    (lambda d: d.DenoiserConfig((1, 2.5, 1)), "channels must be >= 2 positive ints"),
    (lambda d: d.DenoiserConfig(kernel_size=4), "kernel_size must be a positive odd int"),
    (lambda d: d.DenoiserConfig(kernel_size="3"), "kernel_size must be a positive odd int"),
    (lambda d: d.DenoiserConfig(residual="yes"), "residual must be True or False"),
    (lambda d: d.DenoiserConfig((1, 4, 2), residual=True), "residual=True needs channels"),
    (lambda d: d.init(KEY, (1, 16, 1)), r"'cfg' must be a DenoiserConfig.*DenoiserConfig\(channels=\(1, 16, 1\)\)"),
    (lambda d: d.init(0), "'key' must be a JAX PRNG key"),
    (lambda d: d.init(KEY, d.DenoiserConfig(), jnp.int32), "'dtype' must be a floating dtype"),
]))
def test_denoiser_construction(call, names):
    from jaxgrad.cnn import denoiser

    raises_clearly(lambda: call(denoiser), names)


def _denoiser_params():
    from jaxgrad.cnn import denoiser

    return denoiser.init(KEY, denoiser.DenoiserConfig((1, 4, 1)))


@pytest.mark.parametrize("call, names", named([
    (lambda d, p: d.apply(p, jnp.ones((1, 1, 8, 8))), "looks like NCHW"),
    (lambda d, p: d.apply(p, jnp.ones((1, 8, 8, 1), jnp.int32)), "x must be floating"),
    (lambda d, p: d.apply(p, [[1.0]]), r"x must be \[N, H, W, 1\]"),
    (lambda d, p: d.apply(p[0], jnp.ones((1, 8, 8, 1))), "params must be a non-empty list"),
    (lambda d, p: d.apply([p[0], p[0]], jnp.ones((1, 8, 8, 1))), r"params\[1\]\['w'\] expects Cin=1"),
    (lambda d, p: d.apply([{"w": jnp.transpose(q["w"], (3, 2, 0, 1)), "b": q["b"]} for q in p],
                          jnp.ones((1, 8, 8, 1))), r"params\[0\]\['w'\].*torch_weight_to_hwio"),
    (lambda d, p: d.apply(p, jnp.ones((1, 8, 8, 1)), backend="cuda"), "backend"),
    (lambda d, p: d.mse_loss(p, jnp.ones((1, 8, 8, 1)), jnp.ones((1, 8, 8, 2))), "target must have x's shape"),
    (lambda d, p: d.check_batch(np.full((1, 2, 2, 1), np.nan)), "x has 4 non-finite pixel"),
]))
def test_denoiser_apply(call, names):
    from jaxgrad.cnn import denoiser

    raises_clearly(lambda: call(denoiser, _denoiser_params()), names)


def test_mrc_files_missing_truncated_corrupt_are_named_and_left_alone(user_dir):
    from jaxgrad.cnn import data

    stack = data.write_stack(user_dir / "particles.mrc", np.ones((3, 8, 8), np.float32))
    good = stack.read_bytes()
    (user_dir / "truncated.mrc").write_bytes(good[:-10])
    (user_dir / "garbage.mrc").write_bytes(b"x" * 2000)
    (user_dir / "short.mrc").write_bytes(b"MAP ")
    with unchanged(user_dir):
        raises_clearly(lambda: data.open_stack(user_dir / "nope.mrc"), "nope.mrc does not exist")
        raises_clearly(lambda: data.open_stack(user_dir), "is a directory; expected an MRC file")
        raises_clearly(lambda: data.open_stack(3), "'path' must be a str or os.PathLike")
        raises_clearly(lambda: data.open_stack(user_dir / "truncated.mrc"), "truncated.mrc: truncated MRC file")
        raises_clearly(lambda: data.open_stack(user_dir / "garbage.mrc"), "garbage.mrc: not a readable MRC file")
        raises_clearly(lambda: data.open_stack(user_dir / "short.mrc"), "short.mrc: not an MRC file")
        raises_clearly(lambda: data.write_stack(stack, np.zeros((2, 8, 8), np.float32)), "particles.mrc: file exists")
        raises_clearly(lambda: data.write_stack(user_dir / "v.mrc", np.zeros((2, 8, 8), np.float32), voxel_size=-1),
                       "'voxel_size' must be a positive number")
        raises_clearly(lambda: data.write_stack(user_dir / "c.mrc", np.zeros((2, 8, 8), np.complex64)),
                       "'array' has dtype complex64")
        raises_clearly(lambda: data.stack_writer(user_dir / "w.mrc", 5).__enter__(), "'shape' must be \\(n, H, W\\)")
        raises_clearly(lambda: data.ParticleStream(stack, 0, buffer_size=2, seed=0), "'batch_size' must be")
        raises_clearly(lambda: data.ParticleStream([stack, np.ones((2, 5, 5), np.float32)], 1, buffer_size=2, seed=0),
                       "all stacks must share H x W")
        with data.open_stack(stack) as s:
            raises_clearly(lambda: s.read([5]), "particle index 5 out of range")


# ---------------------------------------------------------------------------------------------------------------
# LoRA: model, block, PEFT adapters, HF checkpoints, NF4
# ---------------------------------------------------------------------------------------------------------------
def _llama():
    from jaxgrad.lora import LlamaConfig, LoraConfig, init, init_lora

    cfg = LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=4, vocab_size=29, num_hidden_layers=2, max_position_embeddings=32)
    lcfg = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")
    return cfg, lcfg, init(KEY, cfg), init_lora(KEY, cfg, lcfg)


def _without_lora_a(lora):
    layer = {g: {m: dict(f) for m, f in mods.items()} for g, mods in lora["layers"][0].items()}
    del layer["self_attn"]["q_proj"]["lora_A"]
    return {"layers": [layer, *lora["layers"][1:]]}


@pytest.mark.parametrize("call, names", named([
    (lambda L, cfg, lc, p, lo: L.apply(p, lo, jnp.zeros((2, 8)), cfg, lc), "'input_ids' must be integers"),
    (lambda L, cfg, lc, p, lo: L.apply(p, lo, jnp.zeros(8, jnp.int32), cfg, lc), r"'input_ids' must be \[batch, seq\]"),
    (lambda L, cfg, lc, p, lo: L.apply(p, lo, jnp.zeros((1, 40), jnp.int32), cfg, lc), "max_position_embeddings"),
    (lambda L, cfg, lc, p, lo: L.apply(p, lo, jnp.zeros((2, 8), jnp.int32), cfg, lc, attention_mask=jnp.ones((2, 7))),
     "'attention_mask' must be"),
    (lambda L, cfg, lc, p, lo: L.apply({**p, "layers": p["layers"][:1]}, lo, jnp.zeros((2, 8), jnp.int32), cfg, lc),
     "params\\['layers'\\] has 1 blocks"),
    (lambda L, cfg, lc, p, lo: L.apply(p, lo, jnp.zeros((2, 8), jnp.int32), cfg, lc, backend="cuda"), "'backend'"),
    (lambda L, cfg, lc, p, lo: L.block(p["layers"][0], lo["layers"][0], jnp.zeros((2, 8, 15)), cfg, lc), "'x' must be"),
    (lambda L, cfg, lc, p, lo: L.causal_lm_loss(jnp.zeros((2, 8, 29)), jnp.zeros((2, 7), jnp.int32), 10),
     "'labels' must be"),
    (lambda L, cfg, lc, p, lo: L.init(KEY, {"hidden_size": 16}), "init: 'cfg' must be a LlamaConfig"),
    (lambda L, cfg, lc, p, lo: L.init(0, cfg), r"init: 'key' must be a JAX PRNG key \(jax.random.key\(seed\)\)"),
    (lambda L, cfg, lc, p, lo: L.init_lora(KEY, cfg, None), "init_lora: 'lcfg' must be a LoraConfig"),
    (lambda L, cfg, lc, p, lo: L.init_lora(KEY, lc, lc), "init_lora: 'cfg' must be a LlamaConfig"),
    (lambda L, cfg, lc, p, lo: L.init_lora(np.zeros(3), cfg, lc), "init_lora: 'key' must be a JAX PRNG key"),
    (lambda L, cfg, lc, p, lo: L.apply(p, _without_lora_a(lo), jnp.zeros((2, 8), jnp.int32), cfg, lc),
     r"lora\['layers'\]\[0\]\['self_attn'\]\['q_proj'\] has no 'lora_A'"),
    (lambda L, cfg, lc, p, lo: L.apply(p, _without_lora_a(lo), jnp.zeros((2, 8), jnp.int32), cfg, lc,
                                       backend="reference"), r"\['q_proj'\] has no 'lora_A'"),
    (lambda L, cfg, lc, p, lo: L.block(p["layers"][0], _without_lora_a(lo)["layers"][0], jnp.zeros((2, 8, 16)), cfg,
                                       lc), r"block: lora\['self_attn'\]\['q_proj'\] must hold 'lora_A' \[r, in\]"),
    (lambda L, cfg, lc, p, lo: L.block(p["layers"][0], {**lo["layers"][0], "mlp": 3}, jnp.zeros((2, 8, 16)), cfg, lc),
     r"block: lora\['mlp'\] must be a dict"),
]))
def test_lora_model_and_block(call, names):
    from jaxgrad import lora

    raises_clearly(lambda: call(lora, *_llama()), names)


def test_peft_save_onto_the_users_files_is_refused_and_changes_nothing(user_dir):
    from jaxgrad.lora.peft import load_adapter, save_adapter

    adapters, lcfg = load_adapter(PEFT_DIR)
    with unchanged(user_dir):
        raises_clearly(lambda: save_adapter(user_dir / "adapter", adapters, lcfg),
                       r"'.*/adapter' already holds an adapter .*overwrite=True", (FileExistsError,))
        for target in (user_dir / "notes.txt", user_dir / "notes.txt" / "sub"):
            raises_clearly(lambda: save_adapter(target, adapters, lcfg, overwrite=True),
                           "notes.txt' exists and is not a directory", (FileExistsError,))
        raises_clearly(lambda: save_adapter(user_dir / "new", adapters, lcfg, overwrite="yes"),
                       "'overwrite' must be True or False")


def test_hf_save_onto_the_users_checkpoint_is_refused_and_changes_nothing(user_dir):
    from jaxgrad.lora.hf import load_hf_checkpoint, save_hf_checkpoint

    cfg, params = load_hf_checkpoint(BASE_DIR)
    with unchanged(user_dir):
        raises_clearly(lambda: save_hf_checkpoint(user_dir / "base", cfg, params, max_shard_size=3000),
                       r"'.*/base' already holds a checkpoint", (FileExistsError,))
        raises_clearly(lambda: save_hf_checkpoint(user_dir / "x", cfg, params, max_shard_size=0), "max_shard_size")
        raises_clearly(lambda: save_hf_checkpoint(user_dir / "x", params, cfg), "'config' must be a LlamaConfig")


def _truncate(path: pathlib.Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(fraction * (len(data) - 1))])


@HYP
@given(fraction=st.floats(0.0, 1.0), with_params=st.booleans())
def test_a_truncated_adapter_file_is_named(tmp_path_factory, fraction, with_params):
    from jaxgrad.lora.hf import load_hf_checkpoint
    from jaxgrad.lora.peft import load_adapter

    d = tmp_path_factory.mktemp("adapter") / "a"
    shutil.copytree(PEFT_DIR, d)
    _truncate(d / "adapter_model.safetensors", fraction)
    params = load_hf_checkpoint(BASE_DIR)[1] if with_params else None
    with unchanged(d):
        raises_clearly(lambda: load_adapter(d, params), r"adapter_model\.safetensors: not a readable safetensors file")


@HYP
@given(fraction=st.floats(0.0, 1.0), which=st.sampled_from(["model.safetensors", "config.json"]))
def test_a_truncated_checkpoint_file_is_named(tmp_path_factory, fraction, which):
    from jaxgrad.lora.hf import load_hf_checkpoint

    d = tmp_path_factory.mktemp("ckpt") / "c"
    shutil.copytree(BASE_DIR, d)
    if which == "config.json":  # cut inside the JSON object (a dropped final newline would still parse)
        text = (d / which).read_bytes().rstrip()
        (d / which).write_bytes(text[: int(fraction * (len(text) - 1))])
    else:
        _truncate(d / which, fraction)
    with unchanged(d):
        raises_clearly(lambda: load_hf_checkpoint(d),
                       rf"{re.escape(which)}: not (a readable safetensors file|valid JSON)")


@pytest.mark.parametrize("corrupt, names", named([
    (lambda d: (d / "adapter_config.json").write_bytes(b"\xff\xfe{"), r"adapter_config\.json: not valid JSON"),
    (lambda d: (d / "adapter_config.json").write_text("[1, 2]"), "adapter_config.json: expected a JSON object"),
    (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json' is missing"),
    (lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_model.safetensors' is missing"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b""), "adapter_model.safetensors: not a readable"),
    (lambda d: _save_tensors(d / "adapter_model.safetensors", drop="lora_A"), r"lora_A\.weight' is missing"),
    (lambda d: _save_tensors(d / "adapter_model.safetensors", as_int=True), "LoRA weights are floating point"),
]))
def test_corrupt_adapter_directories_are_named(tmp_path, corrupt, names):
    from jaxgrad.lora.peft import load_adapter

    d = tmp_path / "adapter"
    shutil.copytree(PEFT_DIR, d)
    corrupt(d)
    with unchanged(d):
        raises_clearly(lambda: load_adapter(d), names)


def _save_tensors(path, drop=None, as_int=False):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(path))
    if drop:
        t = {k: v for k, v in t.items() if not (drop in k and "layers.0.self_attn.q_proj" in k)}
    if as_int:
        t = {k: v.astype(np.int32) for k, v in t.items()}
    save_file(t, str(path))


@pytest.mark.parametrize("call, names", named([
    (lambda hf, d: hf.load_hf_checkpoint(d / "config.json"), "is a file; expected a directory"),
    (lambda hf, d: hf.load_hf_checkpoint(d / "nowhere"), "does not exist"),
    (lambda hf, d: hf.load_hf_checkpoint(d, dtype="int32"), "'dtype' must be None .*or a floating dtype"),
    (lambda hf, d: hf.load_hf_checkpoint(d, quantize="nf8"), "quantize must be None or 'nf4'"),
    (lambda hf, d: hf.load_hf_checkpoint(d, quantize="nf4", blocksize=7), "blocksize must be a power of two"),
    (lambda hf, d: hf.load_hf_checkpoint(d, nonsense=1), "config override 'nonsense'"),
]))
def test_hf_loader_arguments(call, names, user_dir):
    from jaxgrad.lora import hf

    with unchanged(user_dir):
        raises_clearly(lambda: call(hf, user_dir / "base"), names)


def test_merge_names_an_adapter_entry_without_lora_a():
    from jaxgrad.lora.peft import merge_adapters

    cfg, lcfg, params, lora = _llama()
    raises_clearly(lambda: merge_adapters(params, _without_lora_a(lora), lcfg),
                   r"adapters\['layers'\]\[0\]\['self_attn'\]\['q_proj'\] has no 'lora_A'")


@HYP
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4).filter(lambda s: len(s) != 2))
def test_nf4_quantize_needs_a_2d_weight(shape):
    from jaxgrad.lora.nf4 import nf4_quantize

    raises_clearly(lambda: nf4_quantize(np.ones(shape, np.float32)), r"w must be a 2-D weight \[out, in\]")


@pytest.mark.parametrize("call, names", named([
    (lambda n, q: n.nf4_quantize(np.ones((4, 64), np.int32)), "w must be a floating-point array"),
    (lambda n, q: n.nf4_quantize(np.full((4, 64), np.nan, np.float32)), "w contains 256 non-finite values"),
    (lambda n, q: n.nf4_quantize(np.ones((4, 64), np.float32), blocksize=48), "blocksize must be a power of two"),
    (lambda n, q: n.nf4_quantize(np.ones((4, 64), np.float32), double_quant="yes"), "double_quant must be a bool"),
    (lambda n, q: n.nf4_dequantize(np.ones((4, 64))), "'w' must be an NF4Weight"),
    (lambda n, q: n.nf4_dequantize(q, jnp.int32), "'dtype' must be a floating dtype"),
    (lambda n, q: n.nf4_dequantize(q, "nope"), "'dtype' must be a floating dtype"),
    (lambda n, q: n.nf4_dequantize(_replace(q, packed=q.packed[:3])), r"'packed' must be uint8 \(128,\)"),
    (lambda n, q: n.nf4_dequantize(_replace(q, absmax=q.absmax[:1])), r"'absmax' must be floating \(4,\)"),
    (lambda n, q: n.nf4_dequantize(_replace(q, blocksize=7)), "blocksize must be a power of two"),
]))
def test_nf4(call, names):
    from jaxgrad.lora import nf4

    q = nf4.nf4_quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    raises_clearly(lambda: call(nf4, q), names)


def _replace(q, **changes):
    import dataclasses

    return dataclasses.replace(q, **changes)


# ---------------------------------------------------------------------------------------------------------------
# jaxgrad.verify.check_vjp
# ---------------------------------------------------------------------------------------------------------------
def _f(a):
    return jnp.sin(a) * 2


@pytest.mark.parametrize("args, kwargs, names", named([
    ((3, _f, jnp.ones(3)), {}, "'fn' must be callable"),
    ((_f, _f), {}, "pass the arguments to differentiate"),
    ((_f, _f, jnp.ones(3, jnp.int32)), {}, "has dtype int32"),
    ((_f, _f, [1.0, 2.0]), {}, "is a float, not an array"),
    ((_f, _f, jnp.ones(3)), dict(arg_names=("a", "b")), "'arg_names' names 2 arguments"),
    ((_f, _f, jnp.ones(3)), dict(precision="ultra"), "precision must be one of"),
    ((_f, lambda a: a[:2], jnp.ones(3)), {}, "fn returns shape \\(3,\\) but reference returns shape \\(2,\\)"),
    ((_f, _f, jnp.ones(3)), dict(cotangent=jnp.ones(4)), "'cotangent' must have fn's output structure"),
    ((_f, _f, jnp.ones(3)), dict(fd_directions=0), "fd_directions"),
    ((_f, _f, jnp.ones(3)), dict(safety=0), "safety"),
    ((_f, _f, jnp.ones(3)), dict(safety=-1), "safety"),
    ((_f, _f, jnp.ones(3)), dict(safety=float("nan")), "safety"),
    ((_f, _f, jnp.ones(3)), dict(replicas=0), "replicas"),
    ((_f, _f, jnp.ones(3)), dict(replicas=7), "replicas"),
    ((_f, _f, jnp.ones(3)), dict(seed=-1), "seed"),
    ((_f, _f, jnp.ones(3)), dict(seed=1.5), "seed"),
]))
def test_check_vjp(args, kwargs, names):
    from jaxgrad.verify import check_vjp

    raises_clearly(lambda: check_vjp(*args, **kwargs), names)


# ---------------------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------------------
def run_cli(argv, capsys) -> tuple[object, str]:
    """``jaxgrad argv`` in this process: (exit status, stderr); an exception escaping ``main`` is returned as the
    status (the CLI must never let one out)."""
    from jaxgrad.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    except Exception as exc:  # noqa: BLE001 -- a traceback is exactly what the contract forbids
        rc = f"traceback: {type(exc).__name__}: {exc}"
    return rc, capsys.readouterr().err


def assert_cli_error(argv, capsys, names: str) -> None:
    rc, err = run_cli(argv, capsys)
    assert rc == 2, f"exit status {rc!r}; stderr: {err[-500:]}"
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.search(names, errors[0]), errors[0]


# (id, argv with {u} = the user's directory and {out} = a fresh run directory, what the error line names,
#  xfail reason or None)
CLI_CASES = [
    ("missing config", ["train", "kan", "{u}/missing.toml", "--out", "{out}"], "missing.toml: no such config file",
     None),
    ("invalid TOML", ["train", "kan", "{u}/bad.toml", "--out", "{out}"], "bad.toml: not valid TOML", None),
    ("wrong type", ["train", "kan", "{u}/typed.toml", "--out", "{out}"], "'train.steps' must be an integer", None),
    ("out of range", ["train", "kan", "--set", "train.steps=-1", "--out", "{out}"], "'train.steps' must be an int",
     None),
    ("bad widths", ["train", "kan", "--set", "model.widths=[2,0,1]", "--out", "{out}"], "'widths'", None),
    ("unknown key", ["train", "kan", "--set", "nosuchkey=1", "--out", "{out}"], "unknown key 'nosuchkey'", None),
    ("no value", ["train", "kan", "--set", "train.lr", "--out", "{out}"], "expected key=value", None),
    ("out is a file", ["train", "kan", "--out", "{u}/notes.txt"], "notes.txt: exists and is not a directory", None),
    ("resume and overwrite", ["train", "kan", "--resume", "--overwrite", "--out", "{out}"], "not both", None),
    ("unknown family", ["train", "nosuch", "--out", "{out}"], "invalid choice: 'nosuch'", None),
    ("bad channels", ["train", "cnn", "--set", "model.channels=[1,0,1]", "--out", "{out}"], "channels", None),
    ("missing base", ["train", "lora", "--set", "model.base='/nonexistent/model'", "--out", "{out}"],
     "'/nonexistent/model' does not exist", None),
    ("unknown command", ["nosuchcommand"], "invalid choice: 'nosuchcommand'", None),
    ("bench suite", ["bench", "nosuch"], "invalid choice: 'nosuch'", None),
    ("bench repeats", ["bench", "kan", "--repeats", "0"], "--repeats: expected an integer >= 1", None),
    ("bench out is a file", ["bench", "kan", "--out", "{u}/notes.txt"], "notes.txt exists and is not a directory",
     None),
    ("demo out is a file", ["demo", "--out", "{u}/notes.txt"], "notes.txt: exists and is not a directory", None),
    ("non-UTF-8 config", ["train", "kan", "{u}/latin1.toml", "--out", "{out}"],
     r"latin1.toml: not valid TOML \(not UTF-8", None),
    ("out through a file", ["train", "kan", "--set", "train.steps=1", "--out", "{u}/notes.txt/run"],
     "--out .*notes.txt/run: .*notes.txt exists and is not a directory", None),
    ("audit unknown op", ["audit", "--op", "no-such-op"], r"jaxgrad audit: error: no op matches 'no-such-op'.*swiglu",
     None),
    ("audit json through a file", ["audit", "--op", "swiglu[xla]", "--json", "{u}/notes.txt/a.json"],
     "--json .*notes.txt/a.json: .*notes.txt exists and is not a directory", None),
    ("audit json is a directory", ["audit", "--op", "swiglu[xla]", "--json", "{u}"], "--json .*: is a directory",
     None),
    ("audit planted unknown op", ["audit", "--planted", "--op", "no-such-case"], "no planted case matches", None),
    ("audit planted json", ["audit", "--planted", "--json", "{u}/p.json"], "--planted has none", None),
]


@pytest.mark.parametrize("argv, names", [
    pytest.param(argv, names, id=case, marks=[xfail(reason)] if reason else [])
    for case, argv, names, reason in CLI_CASES])
def test_cli_bad_input_is_one_error_line_with_status_2_and_leaves_user_files_alone(argv, names, user_dir,
                                                                                    tmp_path, capsys):
    (user_dir / "bad.toml").write_text("[train\nsteps = 3\n")
    (user_dir / "typed.toml").write_text("[train]\nsteps = 'three'\n")
    (user_dir / "latin1.toml").write_bytes(b"[train]\n# caf\xe9\nsteps = 3\n")
    argv = [a.format(u=user_dir, out=tmp_path / "run") for a in argv]
    with unchanged(user_dir):
        assert_cli_error(argv, capsys, names)
