"""Parity with transformers' own ``LlamaDecoderLayer`` + PEFT LoRA on all 7 projections (fixture made by
``tests/fixtures/make_lora_transformers_fixture.py`` on the GPU machine's CPU: torch 2.11, transformers 5.17, peft 0.21).

Float64 (HF's hard-coded float32 casts in RMSNorm / softmax turned into "at least float32", cos/sin in float64;
see the script): output, dx, every LoRA A/B gradient and both norm-weight gradients to 1e-12 of their max.
Float32 (transformers unpatched): to f32 rounding. Variants: plain (theta 1e4, alpha/r) and llama3 (rope_scaling
llama3 hitting all three frequency bands, right-padded batch, rsLoRA); GQA 3:1, explicit head_dim 10 != 24/3."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.block import block
from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.ops.rope import rope_inv_freq

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "lora_transformers_fixture.npz"


@pytest.fixture(scope="module")
def fixture():
    return dict(np.load(FIXTURE))


def _unflatten(arrays, prefix, leaf_names):
    out = {}
    for key, value in arrays.items():
        if not key.startswith(prefix):
            continue
        path = key[len(prefix):]
        for leaf in leaf_names:
            if path.endswith("." + leaf):
                module = path[: -len(leaf) - 1]
                node = out
                for part in module.split("."):
                    node = node.setdefault(part, {})
                node[leaf] = value
    return out


def _case(fx, variant, dtype_name):
    cfg = LlamaConfig.from_hf_dict(json.loads(str(fx[f"{variant}/config"])))
    lc = json.loads(str(fx[f"{variant}/lora_config"]))
    lcfg = LoraConfig(r=lc["r"], lora_alpha=lc["lora_alpha"], use_rslora=lc["use_rslora"],
                      target_modules=lc["target_modules"], init_lora_weights=False)
    pre = f"{variant}/{dtype_name}/"
    params = _unflatten(fx, pre + "param/", ("weight",))
    lora = _unflatten(fx, pre + "lora/", ("lora_A", "lora_B"))
    grads = {"lora": _unflatten(fx, pre + "grad/", ("lora_A", "lora_B")),
             "norms": {n: {"weight": fx[f"{pre}grad/{n}.weight"]}
                       for n in ("input_layernorm", "post_attention_layernorm")}}
    mask = fx[pre + "attention_mask_2d"]
    kw = dict(positions=fx[pre + "position_ids"], attention_mask=None if mask.all() else mask)
    return cfg, lcfg, params, lora, grads, kw, {k: fx[pre + k] for k in ("x", "cotangent", "y", "dx", "scaling",
                                                                          "hf_inv_freq")}


def _ours(cfg, lcfg, params, lora, kw, x, ct):
    def f(params, lora, x):
        return block(params, lora, x, cfg, lcfg, **kw)
    y, pb = jax.vjp(jax.jit(f), params, lora, x)
    dp, dl, dx = pb(jnp.asarray(ct))
    return y, dx, {"lora": dl, "norms": {n: dp[n] for n in ("input_layernorm", "post_attention_layernorm")}}


def _max_rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("variant", ["plain", "llama3"])
def test_float64_parity_with_transformers_llama_decoder_layer(fixture, variant):
    with jax.enable_x64(True):
        cfg, lcfg, params, lora, grads, kw, a = _case(fixture, variant, "float64")
        assert lcfg.scale == float(a["scaling"])
        np.testing.assert_allclose(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict),
                                   a["hf_inv_freq"], rtol=1e-6)  # HF computes them in float32
        params, lora = jax.tree.map(jnp.asarray, (params, lora))
        y, dx, g = _ours(cfg, lcfg, params, lora, kw, jnp.asarray(a["x"]), a["cotangent"])
        assert y.dtype == jnp.float64
        errors = {"y": _max_rel(y, a["y"]), "dx": _max_rel(dx, a["dx"]),
                  **{"/".join(str(k.key) for k in path): _max_rel(v, w) for (path, v), w in
                     zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(grads), strict=True)}}
        assert len(errors) == 2 + 14 + 2
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("variant", ["plain", "llama3"])
def test_float32_parity_with_unpatched_transformers(fixture, variant):
    cfg, lcfg, params, lora, grads, kw, a = _case(fixture, variant, "float32")
    y, dx, g = _ours(cfg, lcfg, params, lora, kw, jnp.asarray(a["x"]), a["cotangent"])
    errors = {"y": _max_rel(y, a["y"]), "dx": _max_rel(dx, a["dx"]),
              **{str(i): _max_rel(v, w) for i, (v, w) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(grads),
                                                                       strict=True))}}
    assert max(errors.values()) < 5e-5, errors  # measured 1.5e-5 (llama3 dx: HF f32 cos/sin, cancelling sums)
