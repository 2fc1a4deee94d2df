"""PEFT round-trip fixtures for ``jaxgrad.lora.peft`` / ``jaxgrad.lora.hf`` (tests/test_lora_io.py).

Two modes:

``--write-ours DIR`` (here, jaxgrad's venv; no torch): write an adapter with *our* writer
(``jaxgrad.lora.peft.save_adapter``) for the tiny model below: r 6, alpha 12, rsLoRA, all 7 projections, seeded
random non-zero A and B. Committed as ``tests/data/lora_peft_ours/``.

``OUT_DIR [OURS_DIR]`` (the GPU machine's CPU: torch + transformers + peft; float32, eager attention):

1. builds ``LlamaForCausalLM(TINY)`` from seed 0 (norm weights randomised too, so they matter) and saves it with
   ``save_pretrained(safe_serialization=True)`` -> ``OUT_DIR/lora_peft_base/{config.json, model.safetensors}``;
2. wraps it with PEFT LoRA (r 4, alpha 8, all 7 projections, ``init_lora_weights=False`` then seeded normal A and
   B, std 0.05), saves the adapter -> ``OUT_DIR/lora_peft_adapter/{adapter_config.json,
   adapter_model.safetensors}``;
3. records logits for fixed tokens (``TOKENS``): the base model, PEFT with its adapter, PEFT with OURS_DIR loaded by
   ``PeftModel.from_pretrained``; and every merged projection weight (``merge_and_unload``) for both adapters ->
   ``OUT_DIR/lora_peft_fixture.npz`` (keys ``logits/base``, ``logits/peft``, ``logits/ours``, ``tokens``,
   ``merged_peft/<hf weight name>``, ``merged_ours/<hf weight name>``, ``meta`` (JSON: versions, PEFT's key
   names, its adapter_config)).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=52,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)
TOKENS = np.random.default_rng(7).integers(0, TINY["vocab_size"], size=(2, 9)).astype(np.int64)
OURS = dict(r=6, lora_alpha=12, lora_dropout=0.0, target_modules=TARGETS, use_rslora=True, init_lora_weights=False)
PEFT = dict(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=False)


def projection_shapes() -> dict[str, tuple[int, int]]:
    """HF [out, in] of the 7 projections of the tiny model."""
    h, i, d = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    nq, nkv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    return {"q_proj": (nq * d, h), "k_proj": (nkv * d, h), "v_proj": (nkv * d, h), "o_proj": (h, nq * d),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def write_ours(directory: str) -> None:
    from jaxgrad.lora.peft import MODULE_GROUPS, save_adapter

    rng = np.random.default_rng(1234)
    layers = []
    for _ in range(TINY["num_hidden_layers"]):
        layer: dict = {}
        for m, (out_f, in_f) in projection_shapes().items():
            a = (0.05 * rng.standard_normal((OURS["r"], in_f))).astype(np.float32)
            b = (0.05 * rng.standard_normal((out_f, OURS["r"]))).astype(np.float32)
            layer.setdefault(MODULE_GROUPS[m], {})[m] = {"lora_A": a, "lora_B": b}
        layers.append(layer)
    # the fixture maker regenerates its own fixture: replace the adapter files already there (nothing else)
    save_adapter(directory, {"layers": layers}, OURS, base_model_name_or_path=None, overwrite=True)
    print(f"wrote {directory}")


def run_peft(out_dir: str, ours_dir: str) -> None:
    import peft
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = pathlib.Path(out_dir)
    tmp = pathlib.Path("/tmp/lora_peft_fixture")
    shutil.rmtree(tmp, ignore_errors=True)
    config = LlamaConfig(**TINY)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    try:
        model.save_pretrained(tmp / "base", safe_serialization=True)
    except TypeError:  # transformers versions that always write safetensors
        model.save_pretrained(tmp / "base")
    tokens = torch.from_numpy(TOKENS)

    def load_base():
        try:
            m = LlamaForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32, attn_implementation="eager")
        except TypeError:
            m = LlamaForCausalLM.from_pretrained(tmp / "base", torch_dtype=torch.float32, attn_implementation="eager")
        return m.eval()

    def logits(m):
        with torch.no_grad():
            return m(input_ids=tokens).logits.float().numpy()

    def merged_weights(peft_model):
        merged = peft_model.merge_and_unload()
        return {k: v.detach().float().numpy() for k, v in merged.state_dict().items()
                if any(f".{t}.weight" in k for t in TARGETS)}

    arrays: dict[str, np.ndarray] = {"tokens": TOKENS}
    arrays["logits/base"] = logits(load_base())

    # PEFT's own adapter, seeded random A and B
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", target_modules=TARGETS, init_lora_weights=False, **PEFT)
    pm = peft.get_peft_model(load_base(), cfg)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    pm.eval()
    try:
        scaling_peft = float(pm.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"])
    except Exception as exc:  # recorded, not fatal
        scaling_peft = repr(exc)
    arrays["logits/peft"] = logits(pm)
    pm.save_pretrained(tmp / "adapter", safe_serialization=True)
    keys = sorted(k for k, _ in pm.named_parameters() if "lora_" in k)

    errors: dict[str, str] = {}
    try:
        for k, v in merged_weights(pm).items():
            arrays[f"merged_peft/{k}"] = v
    except Exception as exc:  # keep what ran
        errors["merged_peft"] = repr(exc)

    # our adapter, loaded by PEFT
    loaded: dict = {}
    try:
        pm2 = peft.PeftModel.from_pretrained(load_base(), ours_dir).eval()
        arrays["logits/ours"] = logits(pm2)
        loaded = {k: v for k, v in pm2.state_dict().items() if "lora_" in k}
        for k, v in merged_weights(pm2).items():
            arrays[f"merged_ours/{k}"] = v
    except Exception as exc:
        errors["ours"] = repr(exc)

    from safetensors import safe_open

    with safe_open(str(tmp / "adapter" / "adapter_model.safetensors"), "np") as f:
        saved_keys = sorted(f.keys())
    meta = {
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "peft_saved_keys": saved_keys, "peft_param_names": keys[:4],
        "ours_loaded_param_names": sorted(loaded)[:4], "n_ours_loaded": len(loaded),
        "adapter_config": json.loads((tmp / "adapter" / "adapter_config.json").read_text()),
        "base_config": json.loads((tmp / "base" / "config.json").read_text()),
        "scaling_peft": scaling_peft, "errors": errors,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    (out / "lora_peft_base").mkdir(parents=True, exist_ok=True)
    (out / "lora_peft_adapter").mkdir(parents=True, exist_ok=True)
    for path in sorted((tmp / "base").glob("model*.safetensors*")) + [tmp / "base" / "config.json"]:
        shutil.copy(path, out / "lora_peft_base" / path.name)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(tmp / "adapter" / name, out / "lora_peft_adapter" / name)
    np.savez_compressed(out / "lora_peft_fixture.npz", **arrays)
    print(json.dumps({k: v for k, v in meta.items() if k != "base_config"}, indent=1)[:4000])
    print("base config:", json.dumps(meta["base_config"]))
    print("max |logits peft - base|:", float(np.abs(arrays["logits/peft"] - arrays["logits/base"]).max()),
          " ours - base:", float(np.abs(arrays.get("logits/ours", np.nan) - arrays["logits/base"]).max()))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--write-ours":
        write_ours(sys.argv[2])
    else:
        run_peft(sys.argv[1] if len(sys.argv) > 1 else "tests/data",
                 sys.argv[2] if len(sys.argv) > 2 else "tests/data/lora_peft_ours")
