"""Hugging Face checkpoints (``jaxgrad.lora.hf``) and PEFT adapters (``jaxgrad.lora.peft``): loading, saving,
merge / unmerge, refusals; round trip against real PEFT 0.21 / transformers 5.17 (fixtures made on the GPU
machine's CPU by ``tests/fixtures/make_lora_peft_fixture.py``).

Logits are checked twice: with an independent NumPy (float64) forward of ``LlamaForCausalLM`` written below (so
the IO is tested on its own) and with jaxgrad's model (``jaxgrad.lora.model.apply``, both backends).
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.hf import (
    CheckpointError,
    dequantize_projections,
    expected_shapes,
    load_hf_checkpoint,
    quantize_projections,
    read_llama_config,
    save_hf_checkpoint,
)
from jaxgrad.lora.nf4 import NF4Weight, nf4_dequantize, nf4_quantize
from jaxgrad.lora.peft import (
    AdapterError,
    adapter_key,
    load_adapter,
    merge_adapters,
    parse_adapter_config,
    resolve_target_modules,
    save_adapter,
    unmerge_adapters,
)

DATA = pathlib.Path(__file__).parent / "fixtures"
BASE_DIR, PEFT_DIR, OURS_DIR = DATA / "lora_peft_base", DATA / "lora_peft_adapter", DATA / "lora_peft_ours"
FIXTURE = DATA / "lora_peft_fixture.npz"
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


# --------------------------------------------------------------------------------------------- helpers


def numpy_llama_logits(params, cfg: LlamaConfig, tokens, adapters=None, scale=0.0):
    """LlamaForCausalLM's forward in float64 NumPy (default RoPE, causal GQA attention, SwiGLU, RMSNorm), with
    LoRA as PEFT applies it: ``x W^T + s (x A^T) B^T``. Independent of jaxgrad's own model."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * f(w)

    def linear(x, layer, group, module, lora):
        y = x @ f(layer[group][module]["weight"]).T
        if lora and module in lora.get(group, {}):
            ab = lora[group][module]
            y = y + scale * (x @ f(ab["lora_A"]).T) @ f(ab["lora_B"]).T
        return y

    b, t = tokens.shape
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [b, h, t, d]
        half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + half * sin

    x = f(params["embed_tokens"]["weight"])[tokens]
    for i, layer in enumerate(params["layers"]):
        lora = adapters["layers"][i] if adapters else None
        h = rms(x, layer["input_layernorm"]["weight"])
        q = linear(h, layer, "self_attn", "q_proj", lora).reshape(b, t, nq, d).transpose(0, 2, 1, 3)
        k = linear(h, layer, "self_attn", "k_proj", lora).reshape(b, t, nkv, d).transpose(0, 2, 1, 3)
        v = linear(h, layer, "self_attn", "v_proj", lora).reshape(b, t, nkv, d).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nq // nkv, axis=1), np.repeat(v, nq // nkv, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ v
        x = x + linear(o.transpose(0, 2, 1, 3).reshape(b, t, nq * d), layer, "self_attn", "o_proj", lora)
        h = rms(x, layer["post_attention_layernorm"]["weight"])
        g = linear(h, layer, "mlp", "gate_proj", lora)
        x = x + linear(g / (1 + np.exp(-g)) * linear(h, layer, "mlp", "up_proj", lora), layer, "mlp", "down_proj", lora)
    x = rms(x, params["norm"]["weight"])
    head = params["lm_head"]["weight"] if "lm_head" in params else params["embed_tokens"]["weight"]
    return x @ f(head).T


def fixture():
    z = np.load(FIXTURE)
    return z, json.loads(str(z["meta"]))


def tiny_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                vocab_size=29, num_hidden_layers=2, max_position_embeddings=32, rms_norm_eps=1e-6)
    return LlamaConfig(**{**base, **kw})


def random_params(cfg: LlamaConfig, seed=0, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    tensors = {n: (0.1 * rng.standard_normal(s)).astype(dtype) for n, s in expected_shapes(cfg).items()}
    from jaxgrad.lora.hf import params_from_state_dict

    return params_from_state_dict(tensors, cfg)


def random_adapters(cfg: LlamaConfig, r: int, targets=tuple(PROJ), seed=1, std=0.05) -> dict:
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(cfg)
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer: dict = {}
        for m in targets:
            out_f, in_f = shapes[f"model.layers.{i}.{PROJ[m]}.{m}.weight"]
            layer.setdefault(PROJ[m], {})[m] = {
                "lora_A": (std * rng.standard_normal((r, in_f))).astype(np.float32),
                "lora_B": (std * rng.standard_normal((out_f, r))).astype(np.float32),
            }
        layers.append(layer)
    return {"layers": layers}


def write_config(directory: pathlib.Path, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (directory / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


@pytest.fixture
def base_copy(tmp_path):
    d = tmp_path / "base"
    shutil.copytree(BASE_DIR, d)
    return d


@pytest.fixture
def peft_copy(tmp_path):
    d = tmp_path / "adapter"
    shutil.copytree(PEFT_DIR, d)
    return d


# --------------------------------------------------------------------------------------------- HF checkpoints


def test_load_transformers5_checkpoint():
    cfg, params = load_hf_checkpoint(BASE_DIR)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 10, 4, 2)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None and not cfg.tie_word_embeddings
    raw = load_file(str(BASE_DIR / "model.safetensors"))
    assert len(raw) == 2 + 9 * 2 + 1
    np.testing.assert_array_equal(params["layers"][1]["self_attn"]["q_proj"]["weight"],
                                  raw["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(params["layers"][0]["mlp"]["down_proj"]["weight"],
                                  raw["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_array_equal(params["layers"][0]["post_attention_layernorm"]["weight"],
                                  raw["model.layers.0.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(params["lm_head"]["weight"], raw["lm_head.weight"])
    np.testing.assert_array_equal(params["norm"]["weight"], raw["model.norm.weight"])
    assert params["layers"][0]["self_attn"]["k_proj"]["weight"].shape == (20, 32)


def test_base_logits_match_transformers():
    """Our loader + the NumPy forward reproduce transformers' own base-model logits (so the forward used by the
    adapter tests below is right)."""
    z, _ = fixture()
    cfg, params = load_hf_checkpoint(BASE_DIR)
    ours = numpy_llama_logits(params, cfg, z["tokens"])
    ref = z["logits/base"]
    assert np.max(np.abs(ours - ref)) <= 1e-5 * np.max(np.abs(ref)), np.max(np.abs(ours - ref))


def test_roundtrip_single_sharded_tied(tmp_path):
    for tied in (False, True):
        cfg = tiny_config(tie_word_embeddings=tied)
        params = random_params(cfg, seed=int(tied))
        assert ("lm_head" in params) != tied
        one = save_hf_checkpoint(tmp_path / f"one{tied}", cfg, params)
        sharded = save_hf_checkpoint(tmp_path / f"sharded{tied}", cfg, params, max_shard_size=3000)
        shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
        assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert not (sharded / "model.safetensors").exists()
        for d in (one, sharded):
            cfg2, params2 = load_hf_checkpoint(d)
            assert cfg2 == cfg
            assert jax.tree_util.tree_structure(params2) == jax.tree_util.tree_structure(params)
            for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
                np.testing.assert_array_equal(a, b)


def test_tied_checkpoint_with_lm_head(tmp_path):
    cfg = tiny_config(tie_word_embeddings=True)
    params = random_params(cfg)
    d = save_hf_checkpoint(tmp_path / "tied", cfg, params)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # some checkpoints store it anyway
    save_file(tensors, str(d / "model.safetensors"))
    _, loaded = load_hf_checkpoint(d)
    assert "lm_head" not in loaded
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs"):
        load_hf_checkpoint(d)


def test_llama3_rope_scaling_and_rope_parameters(tmp_path):
    cfg = tiny_config()
    d = save_hf_checkpoint(tmp_path / "m", cfg, random_params(cfg))
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
    write_config(d, rope_scaling=rs, rope_theta=500000.0)
    c = read_llama_config(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling_dict["rope_type"] == "llama3"
    write_config(d, rope_scaling=_DELETE, rope_theta=_DELETE, rope_parameters={**rs, "rope_theta": 500000.0})
    c2 = read_llama_config(d)  # transformers 5 spelling
    assert c2.rope_theta == 500000.0 and c2.rope_scaling_dict == rs
    write_config(d, torch_dtype="bfloat16", transformers_version="4.45.0", bos_token_id=128000,
                 eos_token_id=[128001, 128009], architectures=["LlamaForCausalLM"], use_cache=True)
    read_llama_config(d)  # metadata accepted


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(pretraining_tp=2), "pretraining_tp"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "linear"),
        (dict(sliding_window=4096), "sliding_window"),
        (dict(model_type="mistral"), "model_type"),
        (dict(num_attention_heads=3), "num_attention_heads"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(base_copy, changes, needle):
    write_config(base_copy, **changes)
    with pytest.raises((CheckpointError, ValueError), match=needle):
        load_hf_checkpoint(base_copy)


def test_missing_files(tmp_path, base_copy):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (base_copy / "config.json").rename(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(base_copy)
    (tmp_path / "config.json").rename(base_copy / "config.json")
    (base_copy / "model.safetensors").rename(base_copy / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a pickle"):
        load_hf_checkpoint(base_copy)


def test_bad_weights(base_copy):
    path = base_copy / "model.safetensors"
    good = load_file(str(path))
    bad = {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(bad, str(path))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf_checkpoint(base_copy)
    save_file({**good, "model.layers.0.self_attn.q_proj.bias": np.zeros(40, np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected key 'model.layers.0.self_attn.q_proj.bias'"):
        load_hf_checkpoint(base_copy)
    save_file({**good, "model.layers.2.input_layernorm.weight": np.zeros(32, np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected key 'model.layers.2.input_layernorm.weight'"):
        load_hf_checkpoint(base_copy)
    save_file({**good, "model.layers.0.self_attn.k_proj.weight": np.zeros((40, 32), np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(40, 32\), expected \(20, 32\)"):
        load_hf_checkpoint(base_copy)
    save_file({**good, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(5, np.float32)}, str(path))
    load_hf_checkpoint(base_copy)  # an old checkpoint's RoPE buffer is recomputed from the config, not an error
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_hf_checkpoint(base_copy)


def test_bad_shards(tmp_path):
    cfg = tiny_config()
    d = save_hf_checkpoint(tmp_path / "s", cfg, random_params(cfg), max_shard_size=3000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(d.glob("model-*.safetensors"))[1]
    moved = shard.rename(tmp_path / shard.name)
    with pytest.raises(FileNotFoundError, match=f"shard '{shard.name}'"):
        load_hf_checkpoint(d)
    moved.rename(shard)
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard.name  # listed in the wrong shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_hf_checkpoint(d)


def test_dtype_and_nf4_loading():
    cfg, f32 = load_hf_checkpoint(BASE_DIR)
    _, bf16 = load_hf_checkpoint(BASE_DIR, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(bf16))
    _, q = load_hf_checkpoint(BASE_DIR, dtype=jnp.bfloat16, quantize="nf4", double_quant=True)
    w = q["layers"][1]["mlp"]["gate_proj"]["weight"]
    assert isinstance(w, NF4Weight) and w.dtype == "bfloat16" and w.double_quant and w.blocksize == 64
    expect = nf4_quantize(np.asarray(bf16["layers"][1]["mlp"]["gate_proj"]["weight"]), 64, True)
    assert w.packed.tobytes() == expect.packed.tobytes()
    assert q["embed_tokens"]["weight"].dtype == jnp.bfloat16  # never quantised
    assert not isinstance(q["layers"][0]["input_layernorm"]["weight"], NF4Weight)
    n_nf4 = sum(isinstance(x, NF4Weight) for x in jax.tree_util.tree_leaves(q, is_leaf=lambda x: isinstance(x, NF4Weight)))
    assert n_nf4 == 7 * cfg.num_hidden_layers
    dq = dequantize_projections(q)
    assert dq["layers"][1]["mlp"]["gate_proj"]["weight"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="quantize must be None or 'nf4'"):
        load_hf_checkpoint(BASE_DIR, quantize="int8")


# --------------------------------------------------------------------------------------------- PEFT adapters


def test_reads_peft_adapter():
    z, meta = fixture()
    _, params = load_hf_checkpoint(BASE_DIR)
    adapters, lcfg = load_adapter(PEFT_DIR, params)
    assert (lcfg.r, lcfg.lora_alpha, lcfg.use_rslora, lcfg.lora_dropout) == (4, 8, False, 0.0)
    assert lcfg.scale == meta["scaling_peft"] == 2.0
    assert set(lcfg.target_modules) == set(PROJ)
    raw = load_file(str(PEFT_DIR / "adapter_model.safetensors"))
    assert sorted(raw) == meta["peft_saved_keys"]
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    assert key == adapter_key(1, "o_proj", "lora_B")
    np.testing.assert_array_equal(adapters["layers"][1]["self_attn"]["o_proj"]["lora_B"], raw[key])
    assert adapters["layers"][0]["mlp"]["down_proj"]["lora_A"].shape == (4, 52)
    assert adapters["layers"][0]["mlp"]["down_proj"]["lora_B"].shape == (32, 4)


@pytest.mark.parametrize("which", ["peft", "ours"])
def test_logits_match_peft(which):
    """PEFT's adapter in our loader, and our adapter in PEFT: the same logits within 1e-5 (relative to the largest
    logit), f32 PEFT against the float64 NumPy forward on our loaded weights."""
    z, _ = fixture()
    cfg, params = load_hf_checkpoint(BASE_DIR)
    adapters, lcfg = load_adapter(PEFT_DIR if which == "peft" else OURS_DIR, params)
    ours = numpy_llama_logits(params, cfg, z["tokens"], adapters, lcfg.scale)
    ref = z[f"logits/{which}"]
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= 1e-5, err
    assert np.max(np.abs(ref - z["logits/base"])) > 0.1  # the adapter matters
    # and merging gives the same logits (the merged model has no adapter left)
    merged = merge_adapters(params, adapters, lcfg)
    err_merged = np.max(np.abs(numpy_llama_logits(merged, cfg, z["tokens"]) - ref)) / np.max(np.abs(ref))
    assert err_merged <= 1e-5, err_merged


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("which", ["peft", "ours"])
def test_model_logits_match_peft(which, backend):
    """jaxgrad's own model (``jaxgrad.lora.model.apply``, float32) on the loaded checkpoint and adapter gives
    PEFT's float32 logits within 1e-5 (relative to the largest logit), for PEFT's adapter and for ours."""
    from jaxgrad.lora import model

    z, _ = fixture()
    cfg, params = load_hf_checkpoint(BASE_DIR)
    adapters, lcfg = load_adapter(PEFT_DIR if which == "peft" else OURS_DIR, params)
    got = np.asarray(model.apply(params, adapters, jnp.asarray(z["tokens"]), cfg, lcfg, backend=backend))
    ref = z[f"logits/{which}"]
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= 1e-5, err


def test_qlora_model_runs_on_the_dequantised_weights():
    """A checkpoint loaded with ``quantize="nf4"`` gives exactly the logits of its dequantised dense weights in
    jaxgrad's model (the block dequantises ``code[nibble] * absmax`` in f32, as bitsandbytes does)."""
    from jaxgrad.lora import model

    z, _ = fixture()
    cfg, q = load_hf_checkpoint(BASE_DIR, quantize="nf4", double_quant=True)
    adapters, lcfg = load_adapter(PEFT_DIR, q)
    tokens = jnp.asarray(z["tokens"])
    got = np.asarray(model.apply(q, adapters, tokens, cfg, lcfg))
    dense = np.asarray(model.apply(dequantize_projections(q), adapters, tokens, cfg, lcfg))
    np.testing.assert_array_equal(got, dense)
    assert np.max(np.abs(got - z["logits/peft"])) > 1e-3  # NF4 changes the model: the comparison is not vacuous


@pytest.mark.parametrize("which", ["peft", "ours"])
def test_merged_weights_match_peft_merge_and_unload(which):
    """Our merge equals PEFT's ``merge_and_unload`` to within the rounding both sides are allowed.

    PEFT computes ``W + (B @ A) * s`` in f32; so do we (same order of operations, no FMA between the product and
    the scale). The order of the r-term sums inside ``B @ A`` is the matmul kernel's and differs between CPUs
    (the fixture was made by torch on the GPU machine's CPU; XLA on an AVX-512 CPU sums in another order), so
    the two merges may differ, per entry, by at most the rounding model of both sides:
    ``|diff| <= 2 (gamma_r |s| (|B| @ |A|) + u |s B A| + u |W + s B A|)``, u = 2^-24, gamma_r = r u / (1 - r u).
    A merge with the wrong scale, a transposed product or a missing adapter is off by O(|s B A|), orders of
    magnitude above this bound (the last assertion checks that the bound is far below the delta itself)."""
    z, _ = fixture()
    _, params = load_hf_checkpoint(BASE_DIR)
    adapters, lcfg = load_adapter(PEFT_DIR if which == "peft" else OURS_DIR, params)
    merged = merge_adapters(params, adapters, lcfg)
    u = 2.0**-24
    n = 0
    for key in z.files:
        if not key.startswith(f"merged_{which}/"):
            continue
        name = key.split("/", 1)[1]  # model.layers.{i}.{group}.{module}.weight
        _, _, i, group, module, _ = name.split(".")
        got = np.asarray(merged["layers"][int(i)][group][module]["weight"], np.float64)
        want = np.asarray(z[key], np.float64)
        f = adapters["layers"][int(i)][group][module]
        a, b = np.asarray(f["lora_A"], np.float64), np.asarray(f["lora_B"], np.float64)
        s, r = abs(lcfg.scale), a.shape[0]
        w = np.asarray(params["layers"][int(i)][group][module]["weight"], np.float64)
        delta = s * (b @ a)
        gamma = r * u / (1 - r * u)
        bound = 2 * (gamma * s * (np.abs(b) @ np.abs(a)) + u * np.abs(delta) + u * np.abs(w + delta))
        excess = np.abs(got - want) - bound
        assert excess.max() <= 0, f"{name}: merged weight off by {np.abs(got - want).max():.3g}, beyond rounding"
        assert np.median(bound) < 1e-3 * np.median(np.abs(delta)), "the bound must be far below the delta"
        n += 1
    assert n == 14


def test_our_writer_is_the_committed_fixture(tmp_path):
    """The committed ``lora_peft_ours`` (which PEFT loaded on the GPU machine) is what our writer writes."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent / "fixtures"))
    try:
        import make_lora_peft_fixture as maker
    finally:
        sys.path.pop(0)
    maker.write_ours(str(tmp_path / "ours"))
    maker.write_ours(str(tmp_path / "ours"))  # regenerating the fixture replaces its own adapter files
    assert json.loads((tmp_path / "ours/adapter_config.json").read_text()) == json.loads(
        (OURS_DIR / "adapter_config.json").read_text())
    a, b = load_file(str(tmp_path / "ours/adapter_model.safetensors")), load_file(str(OURS_DIR / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_save_load_roundtrip(tmp_path):
    cfg = tiny_config()
    params = random_params(cfg)
    lcfg = LoraConfig(r=3, lora_alpha=5, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True,
                      lora_dropout=0.1, init_lora_weights="gaussian")
    adapters = random_adapters(cfg, 3, targets=("q_proj", "v_proj", "down_proj"))
    save_adapter(tmp_path / "a", adapters, lcfg, base_model_name_or_path="tiny/llama")
    raw_cfg = json.loads((tmp_path / "a/adapter_config.json").read_text())
    assert raw_cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"] and raw_cfg["peft_type"] == "LORA"
    assert raw_cfg["lora_dropout"] == 0.1 and raw_cfg["init_lora_weights"] == "gaussian"
    loaded, lcfg2 = load_adapter(tmp_path / "a", params, base_model_name_or_path="tiny/llama")
    assert lcfg2 == lcfg and lcfg2.scale == 5 / math.sqrt(3)
    for x, y in zip(jax.tree_util.tree_leaves(adapters), jax.tree_util.tree_leaves(loaded)):
        np.testing.assert_array_equal(x, y)
    assert loaded["layers"][0]["self_attn"].keys() == {"q_proj", "v_proj"} and "k_proj" not in loaded["layers"][1]["self_attn"]
    bf, _ = load_adapter(tmp_path / "a", params, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(bf))
    with pytest.raises(AdapterError, match="selects"):  # the weights must be what target_modules selects
        save_adapter(tmp_path / "b", adapters, LoraConfig(r=3, lora_alpha=5, target_modules="all-linear"))


@pytest.mark.parametrize(
    "field, value",
    [
        ("bias", "all"),
        ("bias", "lora_only"),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 8}),
        ("alpha_pattern", {"q_proj": 32}),
        ("use_dora", True),
        ("lora_bias", True),
        ("fan_in_fan_out", True),
        ("layers_to_transform", [0]),
        ("layer_replication", [[0, 1]]),
        ("trainable_token_indices", [1, 2]),
        ("exclude_modules", ["k_proj"]),
        ("use_qalora", True),
        ("some_future_field", {"enabled": True}),
    ],
)
def test_unsupported_peft_fields_are_refused_by_name(peft_copy, field, value):
    cfg = json.loads((peft_copy / "adapter_config.json").read_text())
    cfg[field] = value
    (peft_copy / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=field):
        load_adapter(peft_copy)


def test_peft_config_values():
    base = json.loads((PEFT_DIR / "adapter_config.json").read_text())
    assert parse_adapter_config({**base, "some_future_field": None})["r"] == 4  # an empty unknown field is fine
    for change, needle in [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r must be a positive int"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"target_modules": None}, "target_modules"),
        ({"target_modules": []}, "target_modules"),
    ]:
        with pytest.raises(AdapterError, match=needle):
            parse_adapter_config({**base, **change})


def test_target_module_rules():
    assert resolve_target_modules(["q_proj", "self_attn.v_proj"], 2) == [("q_proj", "v_proj")] * 2
    assert resolve_target_modules("all-linear", 1) == [tuple(PROJ)]
    assert resolve_target_modules(r".*\.(q_proj|down_proj)", 1) == [("q_proj", "down_proj")]
    assert resolve_target_modules(r"model\.layers\.1\.mlp\.up_proj", 2) == [(), ("up_proj",)]
    with pytest.raises(AdapterError, match="'qkv_proj' matches no module"):
        resolve_target_modules(["q_proj", "qkv_proj"], 2)
    with pytest.raises(AdapterError, match="matches no projection"):
        resolve_target_modules(r".*\.lm_head", 2)
    with pytest.raises(AdapterError, match="invalid regex"):
        resolve_target_modules("(", 2)


def test_adapter_for_another_model_is_refused(tmp_path):
    _, params = load_hf_checkpoint(BASE_DIR)
    other = tiny_config(hidden_size=24, head_dim=6, num_hidden_layers=2)
    save_adapter(tmp_path / "other", random_adapters(other, 4), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                 base_model_name_or_path="other/model")
    with pytest.raises(AdapterError, match=r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight: shape \(4, 24\), expected \(r=4, in=32\)"):
        load_adapter(tmp_path / "other", params)
    with pytest.raises(AdapterError, match="base_model_name_or_path is 'other/model'"):
        load_adapter(tmp_path / "other", params, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    deeper = tiny_config(num_hidden_layers=3)
    save_adapter(tmp_path / "deep", random_adapters(deeper, 2), LoraConfig(r=2, lora_alpha=2, target_modules="all-linear"))
    with pytest.raises(AdapterError, match="is for layer 2, but the base model has 2 layers"):
        load_adapter(tmp_path / "deep", params)


def test_bad_adapter_files(peft_copy, tmp_path):
    raw = load_file(str(peft_copy / "adapter_model.safetensors"))
    path = peft_copy / "adapter_model.safetensors"
    lm_head = {**raw, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 32), np.float32)}
    save_file(lm_head, str(path))
    with pytest.raises(AdapterError, match="'base_model.model.lm_head.lora_A.weight' is not a LoRA weight"):
        load_adapter(peft_copy)
    key_b = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    save_file({k: v for k, v in raw.items() if k != key_b}, str(path))
    with pytest.raises(AdapterError, match=key_b.replace(".", r"\.") + "' is missing"):
        load_adapter(peft_copy)
    key_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    save_file({k: v for k, v in raw.items() if "layers.0.self_attn.k_proj" not in k}, str(path))
    with pytest.raises(AdapterError, match=key_a.replace(".", r"\.") + "' is missing \\(target_modules selects it\\)"):
        load_adapter(peft_copy)
    save_file({**raw, key_a: np.zeros((5, 32), np.float32)}, str(path))
    with pytest.raises(AdapterError, match="rank r=4"):
        load_adapter(peft_copy)
    save_file({**raw, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(40, np.float32)}, str(path))
    with pytest.raises(AdapterError, match="lora_magnitude_vector"):
        load_adapter(peft_copy)
    path.unlink()
    (peft_copy / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin, a pickle"):
        load_adapter(peft_copy)
    (peft_copy / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(peft_copy)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapter(tmp_path / "missing")


# --------------------------------------------------------------------------------------------- merge / unmerge


def test_merge_unmerge_dense():
    cfg = tiny_config()
    params = random_params(cfg)
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "down_proj"))
    adapters = random_adapters(cfg, 4, targets=("q_proj", "down_proj"))
    merged = merge_adapters(params, adapters, lcfg)
    w = np.asarray(params["layers"][1]["mlp"]["down_proj"]["weight"], np.float64)
    ab = adapters["layers"][1]["mlp"]["down_proj"]
    expect = w + 2.0 * (np.float64(ab["lora_B"]) @ np.float64(ab["lora_A"]))
    np.testing.assert_allclose(merged["layers"][1]["mlp"]["down_proj"]["weight"], expect, rtol=0, atol=1e-6)
    assert merged["layers"][1]["self_attn"]["k_proj"]["weight"] is params["layers"][1]["self_attn"]["k_proj"]["weight"]
    back = unmerge_adapters(merged, adapters, lcfg)
    np.testing.assert_allclose(back["layers"][1]["mlp"]["down_proj"]["weight"], w, rtol=0, atol=1e-6)
    # bf16 weights: computed in f32, cast once
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    m16 = merge_adapters(p16, adapters, 2.0)["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert m16.dtype == jnp.bfloat16
    w16 = np.asarray(p16["layers"][0]["self_attn"]["q_proj"]["weight"], np.float32)
    a0 = adapters["layers"][0]["self_attn"]["q_proj"]
    np.testing.assert_array_equal(np.asarray(m16), (w16 + (a0["lora_B"] @ a0["lora_A"]) * np.float32(2)).astype(ml_dtypes.bfloat16))


def test_merge_onto_nf4_stays_dequantised_and_requantising_is_lossy():
    cfg = tiny_config(hidden_size=64, head_dim=16, intermediate_size=96)
    params = random_params(cfg)
    qparams = quantize_projections(jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params))
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    adapters = random_adapters(cfg, 4)
    merged = merge_adapters(qparams, adapters, lcfg)
    nf4_w = qparams["layers"][0]["mlp"]["up_proj"]["weight"]
    got = merged["layers"][0]["mlp"]["up_proj"]["weight"]
    assert not isinstance(got, NF4Weight) and got.dtype == jnp.bfloat16
    ab = adapters["layers"][0]["mlp"]["up_proj"]
    onto_dequantised = (np.asarray(nf4_dequantize(nf4_w)) + (ab["lora_B"] @ ab["lora_A"]) * np.float32(2)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), onto_dequantised)
    onto_original = np.asarray(params["layers"][0]["mlp"]["up_proj"]["weight"]) + (ab["lora_B"] @ ab["lora_A"]) * 2
    assert np.max(np.abs(np.asarray(got, np.float32) - onto_original)) > 0.01  # not the same thing: NF4's error
    back = unmerge_adapters(merged, adapters, lcfg)["layers"][0]["mlp"]["up_proj"]["weight"]
    deq = np.asarray(nf4_dequantize(nf4_w))
    assert np.max(np.abs(np.asarray(back, np.float32) - deq)) <= 2**-7 * np.max(np.abs(deq)) * 4  # bf16 casts
    requant = quantize_projections(merged)["layers"][0]["mlp"]["up_proj"]["weight"]
    assert isinstance(requant, NF4Weight)
    m32 = np.asarray(got, np.float32)
    rel = np.linalg.norm(np.asarray(nf4_dequantize(requant)) - m32) / np.linalg.norm(m32)
    assert 0.05 < rel < 0.15  # lossy: NF4's own error on the whole merged weight


def test_merge_checks_for_inf_and_shapes():
    cfg = tiny_config()
    params = random_params(cfg)
    adapters = random_adapters(cfg, 2, targets=("o_proj",))
    adapters["layers"][1]["self_attn"]["o_proj"]["lora_B"] = np.full_like(adapters["layers"][1]["self_attn"]["o_proj"]["lora_B"], 1e38)
    adapters["layers"][1]["self_attn"]["o_proj"]["lora_A"] = np.full_like(adapters["layers"][1]["self_attn"]["o_proj"]["lora_A"], 1e3)
    with pytest.raises(FloatingPointError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight"):
        merge_adapters(params, adapters, 1.0)
    bad = random_adapters(cfg, 2, targets=("o_proj",))
    bad["layers"][0]["self_attn"]["o_proj"]["lora_A"] = np.zeros((2, 7), np.float32)
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.o_proj\.lora_A\.weight: shape \(2, 7\)"):
        merge_adapters(params, bad, 1.0)
    with pytest.raises(TypeError, match="LoraConfig or the scale"):
        merge_adapters(params, random_adapters(cfg, 2, targets=("o_proj",)), "2")


# --------------------------------------------------------------------------------------------- existing paths, corrupt files


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_save_adapter_refuses_an_existing_adapter_unless_overwrite(tmp_path):
    cfg = tiny_config()
    lcfg = LoraConfig(r=2, lora_alpha=4, target_modules=("o_proj",))
    first, second = random_adapters(cfg, 2, targets=("o_proj",), seed=1), random_adapters(cfg, 2, ("o_proj",), seed=2)
    save_adapter(tmp_path / "a", first, lcfg)
    (tmp_path / "a/README.md").write_text("my notes")
    before = _snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"save_adapter: '.*/a' already holds an adapter \(adapter_config\.json, "
                                              r"adapter_model\.safetensors\); pass overwrite=True"):
        save_adapter(tmp_path / "a", second, lcfg)
    assert _snapshot(tmp_path) == before  # nothing written
    save_adapter(tmp_path / "a", second, lcfg, overwrite=True)  # PEFT's save_pretrained behaviour, asked for
    loaded, _ = load_adapter(tmp_path / "a")
    np.testing.assert_array_equal(loaded["layers"][1]["self_attn"]["o_proj"]["lora_B"],
                                  second["layers"][1]["self_attn"]["o_proj"]["lora_B"])
    assert (tmp_path / "a/README.md").read_text() == "my notes"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["README.md", "adapter_config.json",
                                                                    "adapter_model.safetensors"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b/notes.txt").write_text("x")
    save_adapter(tmp_path / "b", first, lcfg)  # a directory without an adapter is written into


def test_save_adapter_onto_a_file_is_named_and_leaves_it_alone(tmp_path):
    cfg = tiny_config()
    lcfg = LoraConfig(r=2, lora_alpha=4, target_modules=("o_proj",))
    (tmp_path / "file").write_text("user data")
    for target in (tmp_path / "file", tmp_path / "file" / "sub"):
        for overwrite in (False, True):
            with pytest.raises(FileExistsError, match=r"'.*/file' exists and is not a directory"):
                save_adapter(target, random_adapters(cfg, 2, targets=("o_proj",)), lcfg, overwrite=overwrite)
    assert (tmp_path / "file").read_text() == "user data"


@pytest.mark.parametrize("with_params", [False, True])
@pytest.mark.parametrize("content", [b"garbage", b"", "truncated"])
def test_a_corrupt_adapter_weights_file_is_named(peft_copy, with_params, content):
    path = peft_copy / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    params = load_hf_checkpoint(BASE_DIR)[1] if with_params else None
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: not a readable safetensors file \(.*\); "
                                           r"expected PEFT's adapter_model\.safetensors"):
        load_adapter(peft_copy, params)


def test_corrupt_adapter_config_and_bad_arguments_are_named(peft_copy, tmp_path):
    with pytest.raises(NotADirectoryError, match="is a file; expected a directory"):
        load_adapter(peft_copy / "adapter_config.json")
    with pytest.raises(AdapterError, match="'n_layers' must be a positive int"):
        load_adapter(peft_copy, n_layers=0)
    with pytest.raises(AdapterError, match="'params' must be the base model pytree"):
        load_adapter(peft_copy, [1, 2])
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.int32)},
              str(peft_copy / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="has dtype int32; LoRA weights are floating point"):
        load_adapter(peft_copy)
    (peft_copy / "adapter_config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(AdapterError, match=r"adapter_config\.json: not valid JSON"):
        load_adapter(peft_copy)


def test_an_adapter_entry_without_lora_a_is_named_in_merge_and_shape_checks():
    cfg = tiny_config()
    params = random_params(cfg)
    bad = random_adapters(cfg, 2, targets=("o_proj",))
    del bad["layers"][1]["self_attn"]["o_proj"]["lora_A"]
    for fn in (lambda: merge_adapters(params, bad, 1.0), lambda: unmerge_adapters(params, bad, 1.0)):
        with pytest.raises(AdapterError, match=r"adapters\['layers'\]\[1\]\['self_attn'\]\['o_proj'\] has no 'lora_A'"):
            fn()


def test_corrupt_hf_checkpoint_files_are_named(base_copy, tmp_path):
    cfg_bytes = (base_copy / "config.json").read_bytes()
    (base_copy / "config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_hf_checkpoint(base_copy)
    (base_copy / "config.json").write_bytes(cfg_bytes)
    with pytest.raises(NotADirectoryError, match="is a file; expected a directory"):
        load_hf_checkpoint(base_copy / "config.json")
    with pytest.raises(TypeError, match="'dtype' must be None .* or a floating dtype.*got 'int32'"):
        load_hf_checkpoint(base_copy, dtype="int32")  # was: every weight truncated to integers, silently
    with pytest.raises(TypeError, match="'dtype' must be None"):
        load_hf_checkpoint(base_copy, dtype="nope")
    with pytest.raises(TypeError, match="config override 'nonsense' is not a field of"):
        load_hf_checkpoint(base_copy, nonsense=1)
    cfg = tiny_config()
    d = save_hf_checkpoint(tmp_path / "s", cfg, random_params(cfg), max_shard_size=3000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    for value in (5, ["a"]):
        bad = {"weight_map": {**index["weight_map"], name: value}}
        (d / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=f"'weight_map' entry '{name}' is .*; expected a shard file name"):
            load_hf_checkpoint(d)
    (d / "model.safetensors.index.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="expected JSON with a 'weight_map' object"):
        load_hf_checkpoint(d)


def test_save_hf_checkpoint_refuses_an_existing_one_and_overwrite_replaces_either_layout(tmp_path):
    cfg = tiny_config()
    first, second = random_params(cfg, seed=1), random_params(cfg, seed=2)
    d = save_hf_checkpoint(tmp_path / "m", cfg, first)
    (d / "README.md").write_text("model card")
    before = _snapshot(tmp_path)
    with pytest.raises(FileExistsError,
                       match=r"'.*/m' already holds a checkpoint \(config\.json, model\.safetensors\)"):
        save_hf_checkpoint(d, cfg, second, max_shard_size=3000)
    with pytest.raises(ValueError, match="max_shard_size"):
        save_hf_checkpoint(tmp_path / "n", cfg, second, max_shard_size=0)
    assert _snapshot(tmp_path) == before and not (tmp_path / "n").exists()  # nothing written
    # single file -> shards: the old model.safetensors would shadow the new shards on load; it goes
    save_hf_checkpoint(d, cfg, second, max_shard_size=3000, overwrite=True)
    assert not (d / "model.safetensors").exists() and (d / "README.md").read_text() == "model card"
    np.testing.assert_array_equal(load_hf_checkpoint(d)[1]["norm"]["weight"], second["norm"]["weight"])
    save_hf_checkpoint(d, cfg, first, overwrite=True)  # and back: no shard or index left
    assert sorted(p.name for p in d.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    np.testing.assert_array_equal(load_hf_checkpoint(d)[1]["norm"]["weight"], first["norm"]["weight"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        save_hf_checkpoint(tmp_path / "file", cfg, first, overwrite=True)


@pytest.mark.parametrize("mode, output", [("lora", "adapter"), ("full", "model")])
def test_resuming_a_finished_lora_run_rewrites_the_runs_own_adapter(mode, output, tmp_path, capsys):
    """out/adapter (LoRA modes) and out/model (mode 'full') belong to the run: --resume rewrites them."""
    from jaxgrad.cli import main

    text = tmp_path / "text.txt"
    text.write_text("jaxgrad " * 600)
    run = ["train", "lora", "--set", f"model.mode='{mode}'", "--set", "train.steps=2", "--set",
           f"data.files='{text}'", "--set", "data.n_bytes=4096", "--no-progress", "--out", str(tmp_path / "run")]
    assert main(run) == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "run" / output).iterdir()}
    assert main([*run, "--resume", "--set", "train.steps=3"]) == 0
    assert json.loads((tmp_path / "run/summary.json").read_text())["step"] == 3
    second = {p.name: p.read_bytes() for p in (tmp_path / "run" / output).iterdir()}
    assert second.keys() == first.keys() and second != first  # the weights of step 3, not those of step 2
