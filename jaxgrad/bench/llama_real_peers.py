"""The ``llama_real`` benchmark's processes and its PyTorch peers (:mod:`jaxgrad.bench.llama_real`, module docstring).

Each variant runs in a child process (:func:`run_child`: ``python -m jaxgrad.bench.llama_real --child NAME --spec
JSON``), which prints its row after :data:`jaxgrad.bench.fresh_process.ROW_TAG`; a crash or a timeout comes back as
a row saying so. The constants both sides share live here. The peers, each as its users run it: transformers ``LlamaForCausalLM`` (SDPA attention, bf16, built on the GPU
with HF's N(0, 0.02^2) init), gradient checkpointing on (non-reentrant), ``peft.get_peft_model`` (r 16, alpha 32,
all 7 projections, no dropout, PEFT's default init and fp32 adapters), fused ``torch.optim.AdamW`` on the adapters;
a step is ``model(input_ids, labels=input_ids)`` (HF shifts), ``loss.backward()``, ``opt.step()``,
``opt.zero_grad(set_to_none=True)``. ``--qlora``: every projection becomes a bitsandbytes ``Linear4bit`` (nf4,
``compress_statistics=True`` = double quantisation, blocksize 64, bf16 compute) quantised on the GPU, then the
peak counter is reset (a checkpoint load quantises tensor by tensor and never holds the dense model); the other
weights stay bf16 (``prepare_model_for_kbit_training``'s fp32 upcast of them is not applied). ``+Liger``:
``liger_kernel.transformers.apply_liger_kernel_to_llama()`` before the model is built (fused RMSNorm, SwiGLU, RoPE,
linear cross-entropy).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from jaxgrad.bench import fresh_process, peers

ROW_TAG = fresh_process.ROW_TAG
SUITE = "llama_real"
TORCH_VARIANTS = ("transformers+PEFT", "transformers+PEFT+Liger")
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
RMS_EPS = 1e-5
INIT_STD = 0.02
NF4_BLOCKSIZE = 64
ADAMW = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)


def host_tokens(s: dict, seed: int = 1) -> np.ndarray:
    """Tokens uniform in the vocabulary, ``[batch, seq]`` int32 (the same for every variant)."""
    return np.random.default_rng(seed).integers(0, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)


def missing(variant: str, s: dict) -> str | None:
    """Why a torch ``variant`` cannot run here (None if its imports are there); checked without importing torch."""
    needed = ["torch", "transformers", "peft"] + (["bitsandbytes"] if s["qlora"] else []) + \
        (["liger_kernel"] if "Liger" in variant else [])
    return peers.missing_modules(needed)


def skip_reason(variant: str, s: dict) -> str | None:
    return missing(variant, s) if variant in TORCH_VARIANTS else None


# ------------------------------------------------------------------------------------------------- the peers
def hf_config(transformers, s: dict):
    """A transformers ``LlamaConfig`` of the spec: SDPA, the llama3 RoPE scaling in whichever field the version
    keeps it."""
    from jaxgrad.bench.peers import sdpa_llama_config

    kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
              num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
              head_dim=s["head_dim"], rms_norm_eps=RMS_EPS, max_position_embeddings=max(131072, s["seq"]),
              tie_word_embeddings=s["tied"], attention_bias=False, mlp_bias=False, hidden_act="silu",
              attention_dropout=0.0, use_cache=False, initializer_range=INIT_STD)
    cfg = sdpa_llama_config(transformers, s["rope_theta"], **kw)
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        cfg.rope_parameters = {**rp, **s["rope_scaling"], "rope_theta": s["rope_theta"]}
    else:
        cfg.rope_scaling = dict(s["rope_scaling"])
    return cfg


def quantize_to_nf4(model, torch) -> int:
    """Replace every projection of every layer by a bitsandbytes ``Linear4bit`` quantised on the GPU (module
    docstring); returns how many were replaced."""
    import bitsandbytes as bnb

    n = 0
    for layer in model.model.layers:
        for name, group in PROJ.items():
            parent = getattr(layer, group)
            lin = getattr(parent, name)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4", device="meta")
            # Params4bit quantises as it moves (bitsandbytes' quantize_4bit on the GPU), as transformers loads it
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", blocksize=NF4_BLOCKSIZE).to("cuda")
            setattr(parent, name, q)
            del lin
            n += 1
    torch.cuda.empty_cache()
    return n


def run_torch_variant(variant: str, s: dict, row, *, repeats: int, warmup: int):
    """Build, time and measure one torch peer in this process into ``row`` (CUDA only; an OOM is a result)."""
    why = peers.cuda_unavailable(missing(variant, s))
    if why:
        row.notes = why
        return row
    import torch

    import peft
    import transformers

    from jaxgrad.bench.peers import time_torch

    notes = [f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
             "attn sdpa, gradient checkpointing (non-reentrant), adapters fp32, AdamW fused"]
    if "Liger" in variant:
        import liger_kernel
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches transformers' Llama modules: build the model after
        notes.append(f"liger_kernel {getattr(liger_kernel, '__version__', '?')}: rope, rms_norm, swiglu, "
                     "fused_linear_cross_entropy")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(hf_config(transformers, s))
    finally:
        torch.set_default_dtype(default_dtype)
    if s["qlora"]:
        import bitsandbytes

        replaced = quantize_to_nf4(model, torch)
        torch.cuda.reset_peak_memory_stats()
        notes.append(f"bitsandbytes {bitsandbytes.__version__}: {replaced} Linear4bit nf4 double-quant; peak reset "
                     "after quantising")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    lcfg = peft.LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=0.0, target_modules=list(PROJ),
                           bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lcfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len(trainable) != 14 * s["layers"] or {str(p.dtype) for p in trainable} != {"torch.float32"}:
        raise RuntimeError(f"PEFT: {len(trainable)} trainable tensors of {sorted({str(p.dtype) for p in trainable})},"
                           f" expected {14 * s['layers']} float32 LoRA factors")
    model.train()
    opt = torch.optim.AdamW(trainable, lr=ADAMW["lr"], betas=(ADAMW["b1"], ADAMW["b2"]),
                            eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], fused=True)
    ids = torch.from_numpy(host_tokens(s)).to(torch.long).to("cuda")
    losses = []

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if len(losses) < 3:
            losses.append(out.loss.detach())

    try:
        time_torch(step, row, warmup=max(warmup, 2), repeats=repeats)  # the first 3 calls give the 3 losses
    except torch.cuda.OutOfMemoryError as err:
        row.peak_bytes = int(torch.cuda.max_memory_allocated())
        row.notes = f"out of memory: {str(err).splitlines()[0][:200]}; " + "; ".join(notes)
        return row
    notes.append(f"first step {row.compile_ms:.0f} ms; losses of steps 1-3: "
                 + ", ".join(f"{float(v):.5g}" for v in losses))
    row.notes = "; ".join(notes)
    return row


# ----------------------------------------------------------------------------------------------- the processes
def run_child(variant: str, s: dict, failed, *, module: str, repeats: int, warmup: int, timeout: float):
    """One variant in a fresh process (``python -m <module> --child ...``: module docstring); ``failed``: the row
    returned, its notes saying why, when the child gives none."""
    cmd = [sys.executable, "-m", module, "--child", variant, "--spec", json.dumps(s), "--repeats", str(repeats),
           "--warmup", str(warmup)]
    return fresh_process.run_child_process(cmd, failed, timeout=timeout, label=f"{SUITE} child {variant!r}")
