"""Write ``lora_transformers_fixture.npz``: a transformers ``LlamaDecoderLayer`` + PEFT LoRA, forward and backward.

Run where torch, transformers and peft are installed (the GPU machines), on the CPU:

    PYTHONPATH=$PWD python3 scripts/make_lora_transformers_fixture.py [OUT_DIR]      # default tests/data/

Two variants, each in float64 and float32 (CPU, so no TF32):

- ``plain``: rope_theta 10000, no rope_scaling, no padding, LoRA scale alpha/r;
- ``llama3``: rope_scaling ``{"rope_type": "llama3", ...}`` chosen so the three bands of the rule (kept, smoothed,
  divided by ``factor``) are all hit at head_dim 10, a right-padded batch (lengths 7 and 4; the cotangent is zero on
  padded rows, which no loss reads), rsLoRA (scale alpha/sqrt(r)).

Shapes: batch 2, seq 7, hidden 24, 3 heads / 1 kv head (GQA 3:1), explicit head_dim 10 (!= 24/3), intermediate 40,
LoRA r 4 on all 7 projections with random non-zero A and B (``init_lora_weights=False``, then seeded values).

What is stored (HF / PEFT names): ``{variant}/{dtype}/param/<module>.weight`` (frozen base weights and norm
weights), ``.../lora/<module>.lora_A|lora_B``, ``.../x``, ``.../cotangent``, ``.../position_ids``,
``.../attention_mask_2d`` (1 = token, 0 = padding), ``.../y``, ``.../dx``, ``.../grad/<module>.lora_A|lora_B``,
``.../grad/<norm>.weight`` (the norms are made trainable to get their weight gradients too), ``.../scaling``,
``.../hf_inv_freq`` (what ``LlamaRotaryEmbedding`` computes, in its float32), ``{variant}/config`` (JSON) and the
library versions.

How the layer is called (transformers >= 4.48): the caller owns the rotary embedding and the mask. We pass
``position_embeddings=(cos, sin)`` and a 4-D additive mask (0 where a query may see a key -- causal and not padding
--, the dtype's min elsewhere), attention implementation ``"eager"``; the return value may be a tensor or a tuple.

Float64 and HF's hard-coded float32 casts: ``LlamaRMSNorm`` computes in ``float32`` and the eager attention's
softmax runs with ``dtype=torch.float32``; the rotary embedding computes cos/sin in float32. In float64 these
would cap the agreement at ~1e-7, so in the float64 runs only (i) ``LlamaRMSNorm.forward`` is replaced by the same
code with "at least float32" (``promote_types(dtype, float32)``) in place of ``float32``, (ii)
``torch.nn.functional.softmax`` gets ``dtype = promote_types(dtype, input.dtype)``, and (iii) cos/sin are computed
in float64 from the inverse frequencies of HF's rule restated below (checked against HF's own ``inv_freq``). The
float32 runs use transformers unpatched, with HF's own cos/sin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import sys

import numpy as np

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

BASE = dict(hidden_size=24, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
            rms_norm_eps=1e-5, max_position_embeddings=256, vocab_size=50, num_hidden_layers=1,
            attention_bias=False, mlp_bias=False, attention_dropout=0.0, hidden_act="silu",
            tie_word_embeddings=False)
VARIANTS = {
    "plain": dict(config=dict(rope_theta=10000.0, rope_scaling=None), lengths=(7, 7), r=4, lora_alpha=8,
                  use_rslora=False),
    "llama3": dict(config=dict(rope_theta=10000.0,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                   lengths=(7, 4), r=4, lora_alpha=8, use_rslora=True),
}
BATCH, SEQ = 2, 7


def inv_freq_float64(head_dim, theta, rope_scaling):
    """HF's default rule theta^(-2i/d), then (llama3) the band rule of ``_compute_llama3_parameters``."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not rope_scaling:
        return inv
    factor = rope_scaling["factor"]
    lo, hi = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old = rope_scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def make_config(transformers, variant):
    spec = VARIANTS[variant]["config"]
    kw = dict(BASE, rope_theta=spec["rope_theta"])
    if spec["rope_scaling"]:
        kw["rope_scaling"] = dict(spec["rope_scaling"])
    try:
        cfg = transformers.LlamaConfig(**kw, attn_implementation="eager")
    except TypeError:
        cfg = transformers.LlamaConfig(**kw)
    with contextlib.suppress(Exception):
        cfg._attn_implementation = "eager"
    # transformers 5 keeps rope settings in `rope_parameters`; make sure the llama3 rule really is on.
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        want = {"rope_type": "llama3", **spec["rope_scaling"]} if spec["rope_scaling"] else {"rope_type": "default"}
        if rp.get("rope_type") != want["rope_type"] or float(rp.get("rope_theta", spec["rope_theta"])) != spec[
                "rope_theta"]:
            cfg.rope_parameters = {**want, "rope_theta": spec["rope_theta"]}
    print(f"  [{variant}] attn_implementation={getattr(cfg, '_attn_implementation', None)!r} "
          f"rope_scaling={getattr(cfg, 'rope_scaling', None)!r} rope_parameters={rp!r}")
    return cfg


@contextlib.contextmanager
def float64_exact(torch, modeling_llama):
    """Turn HF's hard-coded float32 casts into 'at least float32' (see the module docstring)."""
    rms_cls = modeling_llama.LlamaRMSNorm
    old_forward, old_softmax = rms_cls.forward, torch.nn.functional.softmax

    def rms_forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None:
            dtype = torch.promote_types(dtype, input.dtype)
        return old_softmax(input, dim=dim, dtype=dtype)

    rms_cls.forward = rms_forward
    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        rms_cls.forward = old_forward
        torch.nn.functional.softmax = old_softmax


def compute(variant, dtype_name, seed=0):
    import peft
    import torch
    import transformers
    from transformers.models.llama import modeling_llama

    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    spec = VARIANTS[variant]
    cfg = make_config(transformers, variant)
    torch.manual_seed(seed)
    layer = modeling_llama.LlamaDecoderLayer(cfg, layer_idx=0)
    lcfg = peft.LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                           target_modules=list(TARGETS), use_rslora=spec["use_rslora"], init_lora_weights=False,
                           bias="none")
    layer = peft.inject_adapter_in_model(lcfg, layer)
    layer = layer.to(dtype).train(False)

    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)

    out, params, loras, scalings = {}, {}, {}, {}
    with torch.no_grad():
        for name, mod in layer.named_modules():
            short = name.split(".")[-1]
            if short in TARGETS:
                base = mod.base_layer if hasattr(mod, "base_layer") else mod
                o, i = base.weight.shape
                base.weight.copy_(randn(o, i, std=i ** -0.5))
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
                a.copy_(randn(*a.shape, std=i ** -0.5))
                b.copy_(randn(*b.shape, std=a.shape[0] ** -0.5))
                params[f"{name}.weight"] = base.weight
                loras[f"{name}.lora_A"], loras[f"{name}.lora_B"] = a, b
                scalings[name] = float(mod.scaling["default"])
            elif short in ("input_layernorm", "post_attention_layernorm"):
                mod.weight.copy_(1 + randn(*mod.weight.shape, std=0.2))
                params[f"{name}.weight"] = mod.weight
    assert len(loras) == 14, f"expected LoRA on 7 projections, found {sorted(loras)}"
    for p in layer.parameters():
        p.requires_grad_(False)
    trainable = {**loras, **{k: v for k, v in params.items() if "layernorm" in k}}
    for p in trainable.values():
        p.requires_grad_(True)

    lengths = spec["lengths"]
    valid = torch.tensor([[1 if t < n else 0 for t in range(SEQ)] for n in lengths], dtype=torch.int64)
    x = randn(BATCH, SEQ, BASE["hidden_size"]).requires_grad_(True)
    ct = randn(BATCH, SEQ, BASE["hidden_size"]) * valid[..., None].to(dtype)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    allowed = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))[None] & valid[:, None, :].bool()
    mask4d = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)

    rotary = modeling_llama.LlamaRotaryEmbedding(config=cfg)
    hf_inv_freq = rotary.inv_freq.detach().double().numpy()
    inv64 = inv_freq_float64(BASE["head_dim"], spec["config"]["rope_theta"], spec["config"]["rope_scaling"])
    freq_err = float(np.max(np.abs(hf_inv_freq - inv64) / inv64))
    print(f"  [{variant}/{dtype_name}] HF inv_freq vs float64 restatement: max rel err {freq_err:.2e}")
    if freq_err > 1e-6:
        raise SystemExit(f"HF's inv_freq {hf_inv_freq} does not follow the rule restated here {inv64}")
    scaling_factor = float(getattr(rotary, "attention_scaling", 1.0))
    if dtype == torch.float64:
        freqs = torch.arange(SEQ, dtype=torch.float64)[:, None] * torch.from_numpy(inv64)[None]
        emb = torch.cat((freqs, freqs), dim=-1)[None].expand(BATCH, SEQ, -1)
        cos, sin = emb.cos() * scaling_factor, emb.sin() * scaling_factor
        ctx = float64_exact(torch, modeling_llama)
    else:
        cos, sin = rotary(x, position_ids)
        ctx = contextlib.nullcontext()

    with ctx:
        try:
            res = layer(x, attention_mask=mask4d, position_ids=position_ids, position_embeddings=(cos, sin))
        except TypeError as e:  # very old signature
            print(f"  layer(..., position_embeddings=) failed ({e}); calling without it")
            res = layer(x, attention_mask=mask4d, position_ids=position_ids)
        y = res[0] if isinstance(res, (tuple, list)) else res
        (y * ct).sum().backward()

    pre = f"{variant}/{dtype_name}"

    def np_(t):
        return t.detach().cpu().numpy()

    out[f"{pre}/x"], out[f"{pre}/cotangent"], out[f"{pre}/y"], out[f"{pre}/dx"] = np_(x), np_(ct), np_(y), np_(x.grad)
    out[f"{pre}/position_ids"] = np_(position_ids)
    out[f"{pre}/attention_mask_2d"] = np_(valid)
    out[f"{pre}/hf_inv_freq"] = hf_inv_freq
    out[f"{pre}/attention_scaling"] = np.asarray(scaling_factor)
    for k, v in params.items():
        out[f"{pre}/param/{k}"] = np_(v)
    for k, v in loras.items():
        out[f"{pre}/lora/{k}"] = np_(v)
    for k, v in trainable.items():
        assert v.grad is not None and float(v.grad.abs().max()) > 0, f"no gradient reached {k}"
        out[f"{pre}/grad/{k}"] = np_(v.grad)
    (s,) = set(scalings.values())
    out[f"{pre}/scaling"] = np.asarray(s)
    print(f"  [{pre}] |y| {float(y.abs().max()):.3f}, |dx| {float(x.grad.abs().max()):.3f}, scaling {s}")
    return out


def main(argv=None):
    import peft
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(pathlib.Path(__file__).resolve().parents[1] / "tests"
                                                          / "data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    torch.use_deterministic_algorithms(True)
    arrays = {}
    for variant in VARIANTS:
        spec = VARIANTS[variant]
        arrays[f"{variant}/config"] = np.asarray(json.dumps({**BASE, **spec["config"]}))
        arrays[f"{variant}/lora_config"] = np.asarray(json.dumps(
            dict(r=spec["r"], lora_alpha=spec["lora_alpha"], use_rslora=spec["use_rslora"],
                 target_modules=list(TARGETS))))
        for dtype_name in ("float64", "float32"):
            arrays.update(compute(variant, dtype_name, args.seed))
    arrays["versions"] = np.asarray(json.dumps(dict(torch=torch.__version__, transformers=transformers.__version__,
                                                    peft=peft.__version__, python=sys.version.split()[0])))
    path = pathlib.Path(args.out_dir) / "lora_transformers_fixture.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
