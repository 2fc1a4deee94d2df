r"""The ``llama_real`` benchmark: **one whole LoRA training step** (forward, backward, AdamW on the adapters) of a
Llama at the shapes users fine-tune, random weights built on the device (nothing is downloaded); each variant in a
fresh process (its peak device memory is its own).

    python -m jaxgrad.bench llama_real --model 1b|8b [--qlora] [--batch B] [--seq T] [--layers N]
                                       [--variants SUBSTR,...] [--checkpointing POLICY] [--backend auto|xla|mosaic|
                                       pallas] [--repeats N] [--warmup N] [--budget-s S] [--out DIR] [--tiny]
    python -m jaxgrad.bench llama_real --model 8b --qlora --max-context [--checkpointing full] [--context-step T]

Models (:data:`MODELS`): ``1b`` is Llama-3.2-1B (16 layers, hidden 2048, 32 / 8 heads of 64, intermediate 8192, tied
vocabulary 128,256), ``8b`` Llama-3.1-8B (32 layers, hidden 4096, 32 / 8 heads of 128, intermediate 14,336, untied
vocabulary 128,256); both RoPE base 500,000 with the ``llama3`` scaling, RMSNorm eps 1e-5. Base bf16 (``--qlora``:
the 7 projections of every layer NF4 with double quantisation, blocksize 64, bitsandbytes' layout), LoRA r = 16,
alpha = 32 on all 7 projections, adapters float32 (PEFT's default on a bf16 model), no dropout; seq 4096,
micro-batch 2 (NeMo AutoModel's setting). ``--layers N`` runs the first N layers only (embedding, head and loss
kept): every figure is then of the N-layer model, said in the result; an estimate at full depth is printed beside
it, labelled as one. ``--tiny`` shrinks the widths, the vocabulary and the sequence (:data:`TINY`) for the CPU.

Weights: N(0, 0.02^2) (HF's ``initializer_range``) for the embedding, the head and every projection, norms 1;
the NF4 projections are random codes with the block statistics of a real quantised N(0, 0.02^2) weight (the same
storage and the same work as a quantised checkpoint); adapters PEFT's default (A Kaiming-uniform, B = 0); tokens
uniform in the vocabulary, labels = inputs.

Variants (:data:`VARIANTS`), each as its users run it:

* ``jaxgrad``: the whole-block custom VJP (:func:`jaxgrad.lora.model.hidden_states`, ``backend`` mosaic on a Hopper
  GPU with bf16, else xla; cuDNN attention on a GPU, ``jax.nn.dot_product_attention(implementation="xla")``
  elsewhere), the fused LM-head loss (:func:`jaxgrad.ops.lm_head_loss.lm_head_loss`, no ``[tokens, vocab]``
  logits; the head frozen, so ``dh`` is formed in the forward; on the blocks' backend where that is mosaic:
  :func:`jaxgrad.ops.lm_head_loss.backend_beside`), ``gradient_checkpointing`` as ``--checkpointing``
  (default none: the VJP already recomputes inside each block), ``block_recompute="shared"`` (the VJP's recompute
  shared with the forward by XLA: fastest, the forward's activations alive until the backward), ``optax.adamw`` with
  the adapters and their moments donated;
* ``jaxgrad recompute=mlp``, ``jaxgrad recompute=all``: the same with ``block_recompute`` ``"mlp"`` / ``"all"``
  (:data:`jaxgrad.lora.config.BLOCK_RECOMPUTE`: the MLP half, or both halves, recomputed for real in the backward:
  less memory, more time); ``jaxgrad checkpointing=full``: the same with every block under ``jax.checkpoint``
  (only each block's input kept);
* ``jax.grad``: ``jax.grad`` of the plain model (reference block, the same attention, ``[tokens, vocab]`` logits
  and the plain loss); expected out of memory at full size: reported as a result (``out of memory: ...``);
* ``transformers+PEFT``: ``LlamaForCausalLM`` (SDPA, bf16) + ``peft.get_peft_model``, gradient checkpointing on
  (non-reentrant), fused ``torch.optim.AdamW``; ``--qlora``: the projections as bitsandbytes ``Linear4bit`` (nf4,
  double quantisation); :mod:`jaxgrad.bench.llama_real_peers`;
* ``transformers+PEFT+Liger``: the same after ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` (fused
  RMSNorm, SwiGLU, RoPE and linear cross-entropy).

A peer out of memory at the micro-batch asked for runs again at batch 1 (a row of its own, ``... batch 1``), as
its users would run it.

A variant that cannot run here (no CUDA, a library missing) gets a row whose notes say why (``skipped: ...``).

Accounting (:func:`accounting`), ``N = batch * seq`` tokens, ``P`` the base parameters of the model run (embedding
and head, tied counted once, and the norms; adapters not counted):

.. math::

    F_\mathrm{NeMo} = 4 P N, \qquad
    F_\mathrm{attn} = F_\mathrm{NeMo} + 12\, L\, B\, H_q\, d\, \tfrac{T (T + 1)}{2}

``4 P N``: the forward ``2 P N`` and the input gradient ``2 P N`` (the base is frozen: no weight gradient), as NeMo
counts its LoRA tables (402 TFLOP/s / 12,473 tokens/s = 32.2 GFLOP per token = 4 x 8.03 B); the causal attention
adds ``4 B H_q d`` per (query, key) pair forward and twice that backward. Model TFLOP/s = F / step time (the
recomputation of checkpointing is work done, not counted). Peak memory: the device's high-water mark since the
variant's process started, weights included (JAX ``peak_bytes_in_use``, torch ``max_memory_allocated``; torch's
QLoRA peak is reset after quantising, as a checkpoint load never holds the dense model); frozen weights
(:func:`frozen_weight_bytes`): bf16 2 bytes a parameter, NF4 with double quantisation 0.5 + 1/64 + 4/(64 * 256)
bytes a projection parameter; ``peak - frozen`` is what the step itself costs.

``--max-context``: the longest sequence at batch 1 whose compiled ``jaxgrad`` step fits the device: compiled
(never run) at abstract arguments, ``memory_analysis()`` temp + arguments + outputs against the device's memory
(``bytes_limit``: JAX's allocator limit, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device, 0.95 unless set, as
for the runs; ``--device-memory-gib`` elsewhere), doubling from ``--context-start`` then bisecting to a multiple of
``--context-step``. Nothing is offloaded to the host (the host bytes a compiled step holds, XLA's
``host_temp_size_in_bytes``, are printed beside a size where there are any).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from jaxgrad.bench import fresh_process
from jaxgrad.bench import llama_real_peers as peers
from jaxgrad.bench.llama_real_peers import ADAMW, INIT_STD, NF4_BLOCKSIZE, PROJ, RMS_EPS, SUITE, TORCH_VARIANTS

MODULE = "jaxgrad.bench.llama_real"
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
MODELS = {
    "1b": dict(name="Llama-3.2-1B", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
               vocab=128256, tied=True, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=32.0)),
    "8b": dict(name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
               vocab=128256, tied=False, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
}
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, seq=64)
LORA = dict(r=16, alpha=32.0)
#: run order: ours (the block VJP's recompute choices, :data:`jaxgrad.lora.config.BLOCK_RECOMPUTE`), peers, OOM
VARIANTS = ("jaxgrad", "jaxgrad recompute=mlp", "jaxgrad recompute=all", "jaxgrad checkpointing=full",
            "transformers+PEFT", "transformers+PEFT+Liger", "jax.grad")
NEMO_8B = "NeMo AutoModel, Llama-3-8B LoRA r=16 bf16 seq 4096 micro-batch 2, one H100: 12,473 tokens/s, 402 TFLOP/s"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
UNSLOTH_CONTEXT = "Unsloth (published): 342,733 tokens, Llama-3.1-8B QLoRA on 80 GB"


# ------------------------------------------------------------------------------------------------- the shapes
def make_spec(model: str, *, layers: int | None = None, batch: int = 2, seq: int | None = None, qlora: bool = False,
              tiny: bool = False, checkpointing: str = "none", backend: str = "auto",
              chunk_tokens: int = 1024) -> dict:
    """Everything a variant needs to rebuild the step (JSON-able: it is passed to the child processes)."""
    if model not in MODELS:
        raise ValueError(f"{SUITE}: 'model' must be one of {sorted(MODELS)}, got {model!r}")
    m = dict(MODELS[model], **({k: v for k, v in TINY.items() if k != "seq"} if tiny else {}))
    full = m["layers"]
    layers = full if layers is None else layers
    if not isinstance(layers, int) or not 1 <= layers <= full:
        raise ValueError(f"{SUITE}: 'layers' must be an int in [1, {full}] ({m['name']}), got {layers!r}")
    seq = (TINY["seq"] if tiny else 4096) if seq is None else seq
    for name, v in (("batch", batch), ("seq", seq), ("chunk_tokens", chunk_tokens)):
        if not isinstance(v, int) or v < (2 if name == "seq" else 1):
            raise ValueError(f"{SUITE}: '{name}' must be an int >= {2 if name == 'seq' else 1}, got {v!r}")
    from jaxgrad.lora.config import CHECKPOINT_POLICIES

    if checkpointing not in CHECKPOINT_POLICIES:
        raise ValueError(f"{SUITE}: 'checkpointing' must be one of {CHECKPOINT_POLICIES}, got {checkpointing!r}")
    if backend not in ("auto", "xla", "mosaic", "pallas"):
        raise ValueError(f"{SUITE}: 'backend' must be auto, xla, mosaic or pallas, got {backend!r}")
    return dict(m, model=model, layers=layers, full_layers=full, batch=batch, seq=seq, qlora=bool(qlora),
                tiny=bool(tiny), checkpointing=checkpointing, backend=backend, chunk_tokens=chunk_tokens, **LORA)


def proj_shapes(s: dict) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of the 7 projections."""
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["intermediate"]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def parameter_counts(s: dict, layers: int | None = None) -> dict:
    """Base parameters of the model with ``layers`` layers (default: those run): projections, the rest, total."""
    layers = s["layers"] if layers is None else layers
    proj = layers * sum(o * i for o, i in proj_shapes(s).values())
    rest = (1 if s["tied"] else 2) * s["vocab"] * s["hidden"] + (2 * layers + 1) * s["hidden"]
    adapters = layers * sum(s["r"] * (o + i) for o, i in proj_shapes(s).values())
    return {"projections": proj, "embedding_head_norms": rest, "total": proj + rest, "adapters": adapters}


def frozen_weight_bytes(s: dict, layers: int | None = None) -> float:
    """Bytes of the frozen base: bf16, or NF4 projections (0.5 byte + one uint8 absmax per 64 + one float32 per 256
    absmax) and the rest bf16 (module docstring)."""
    p = parameter_counts(s, layers)
    per_proj = (0.5 + 1 / NF4_BLOCKSIZE + 4 / (NF4_BLOCKSIZE * 256)) if s["qlora"] else 2.0
    return per_proj * p["projections"] + 2.0 * p["embedding_head_norms"]


def accounting(s: dict, layers: int | None = None) -> dict:
    """FLOPs of one step: NeMo's ``4 P N`` and that plus the causal attention (module docstring)."""
    layers = s["layers"] if layers is None else layers
    n, t = s["batch"] * s["seq"], s["seq"]
    p = parameter_counts(s, layers)["total"]
    attention = 12.0 * layers * s["batch"] * s["heads"] * s["head_dim"] * t * (t + 1) / 2
    return {"tokens_per_step": n, "parameters": p, "flops_nemo": 4.0 * p * n, "flops_attention": attention,
            "flops_with_attention": 4.0 * p * n + attention, "layers": layers,
            "rule_nemo": "4 x base parameters (embedding and head included, tied counted once) x tokens; "
                         "attention not counted",
            "rule_with_attention": "4 P N + 12 L B Hq d T(T+1)/2 (causal attention forward 4, backward 8 per pair)"}


def metrics(s: dict, median_ms: float | None, peak_bytes: int | None) -> dict:
    """tokens/s, model TFLOP/s both ways, peak and peak minus frozen weights of a measured step; the full-depth
    estimate (``--layers`` below the model's) assumes the measured TFLOP/s holds at full depth: not measured."""
    a, frozen = accounting(s), frozen_weight_bytes(s)
    out = {"layers_run": s["layers"], "layers_model": s["full_layers"], "frozen_weight_bytes": frozen,
           "tokens_per_s": None, "step_ms": median_ms, "model_tflops_nemo": None, "model_tflops_with_attention": None,
           "peak_bytes": peak_bytes, "peak_minus_frozen_bytes": None if peak_bytes is None else peak_bytes - frozen}
    if median_ms:
        sec = median_ms * 1e-3
        out.update(tokens_per_s=a["tokens_per_step"] / sec, model_tflops_nemo=a["flops_nemo"] / sec / 1e12,
                   model_tflops_with_attention=a["flops_with_attention"] / sec / 1e12)
        if s["layers"] < s["full_layers"]:
            full = accounting(s, s["full_layers"])
            est_sec = full["flops_nemo"] / (a["flops_nemo"] / sec)
            out["estimate_full_depth_tokens_per_s"] = a["tokens_per_step"] / est_sec
            out["estimate_rule"] = "full-depth 4PN / measured model-TFLOP/s (NeMo's accounting); not measured"
    return out


def header_lines(s: dict) -> list[str]:
    a, p = accounting(s), parameter_counts(s)
    depth = f"{s['layers']} of {s['full_layers']} layers" + ("" if s["layers"] == s["full_layers"] else
                                                               " (--layers: every figure is of this model)")
    return [f"{SUITE}: one LoRA training step (forward, backward, AdamW on the adapters) of {s['name']}"
            f"{' (tiny widths)' if s['tiny'] else ''}, {depth}; base {'NF4 (double quant) + bf16' if s['qlora'] else
            'bf16'}, LoRA r={s['r']} alpha={s['alpha']:g} on all 7 projections, adapters fp32; batch {s['batch']} x "
            f"seq {s['seq']} = {a['tokens_per_step']} tokens; random weights built on the device",
            f"P = {p['total']:,} base parameters ({p['projections']:,} in projections), {p['adapters']:,} adapter "
            f"parameters; frozen weights {frozen_weight_bytes(s) / 2**30:.2f} GiB",
            f"model FLOPs per step: NeMo's accounting ({a['rule_nemo']}) {a['flops_nemo']:.4g}; with attention "
            f"({a['rule_with_attention']}) {a['flops_with_attention']:.4g}",
            f"published: {NEMO_8B}",
            "each variant runs in a fresh process; tokens/s = batch*seq / median step; peak = the device's high-water "
            f"mark since that process started, weights included; JAX's memory fraction "
            f"{os.environ.get(MEM_FRACTION, '0.75 (default)')}"]


# ---------------------------------------------------------------------------------------------- the JAX model
def variant_memory(variant: str, s: dict) -> tuple[str, str]:
    """``(block_recompute, gradient_checkpointing)`` of a variant: ``recompute=`` and ``checkpointing=`` in its
    name, else ``"shared"`` and the run's ``--checkpointing``."""
    words = dict(w.split("=", 1) for w in variant.split()[1:] if "=" in w)
    return words.get("recompute", "shared"), words.get("checkpointing", s["checkpointing"])


def configs(s: dict, variant: str = "jaxgrad"):
    from jaxgrad.lora.config import LlamaConfig, LoraConfig

    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rope_theta=s["rope_theta"],
                      rope_scaling=s["rope_scaling"], max_position_embeddings=max(131072, s["seq"]),
                      vocab_size=s["vocab"], rms_norm_eps=RMS_EPS, num_hidden_layers=s["layers"],
                      tie_word_embeddings=s["tied"], gradient_checkpointing=variant_memory(variant, s)[1],
                      block_recompute=variant_memory(variant, s)[0])
    lcfg = LoraConfig(r=s["r"], lora_alpha=s["alpha"], target_modules="all-linear")
    return cfg, lcfg


def _nf4_template():
    """A real NF4 (double quant) weight of N(0, 0.02^2): the block statistics the random codes borrow."""
    from jaxgrad.ops.nf4 import nf4_quantize

    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32) * INIT_STD
    return nf4_quantize(w, NF4_BLOCKSIZE, True)  # 1024 blocks = 4 second-level blocks of 256


def random_nf4(key, shape, template):
    """An NF4 weight ``[out, in]`` of uniform random codes, its absmax codes, absmax2 and offset tiled from
    ``template`` (whole second-level blocks, so each absmax code keeps its own scale)."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.ops.nf4 import NF4Weight

    n = shape[0] * shape[1]
    n_blocks = -(-n // NF4_BLOCKSIZE)
    n_blocks2 = -(-n_blocks // 256)
    reps = -(-n_blocks // template.absmax.size)
    absmax = jnp.tile(jnp.asarray(template.absmax), reps)[:n_blocks]
    absmax2 = jnp.tile(jnp.asarray(template.absmax2), reps)[:n_blocks2]
    packed = jax.random.bits(key, (-(-n // 2),), jnp.uint8)
    return NF4Weight(packed=packed, absmax=absmax, absmax2=absmax2, offset=jnp.asarray(template.offset),
                     shape=tuple(shape), blocksize=NF4_BLOCKSIZE, dtype="bfloat16")


def build_params(s: dict, key, place=None):
    """The base on the default device, layer by layer (an NF4 model never holds its dense projections).
    ``place``: applied to each weight as soon as it is made (``jax.device_get``: the base in host memory, no device
    ever holding more than one weight of it)."""
    import jax
    import jax.numpy as jnp

    place = (lambda w: w) if place is None else place
    bf16 = jnp.bfloat16
    template = _nf4_template() if s["qlora"] else None
    normal = jax.jit(lambda k, shape: (INIT_STD * jax.random.normal(k, shape, jnp.float32)).astype(bf16),
                     static_argnums=1)
    keys = iter(jax.random.split(key, 2 + 7 * s["layers"]))

    def ones():
        return place(jnp.ones((s["hidden"],), bf16))

    params = {"embed_tokens": {"weight": place(normal(next(keys), (s["vocab"], s["hidden"])))}, "layers": [],
              "norm": {"weight": ones()}}
    head_key = next(keys)
    if not s["tied"]:
        params["lm_head"] = {"weight": place(normal(head_key, (s["vocab"], s["hidden"])))}
    for _ in range(s["layers"]):
        layer = {"self_attn": {}, "mlp": {}, "input_layernorm": {"weight": ones()},
                 "post_attention_layernorm": {"weight": ones()}}
        for p, shape in proj_shapes(s).items():
            k = next(keys)
            layer[PROJ[p]][p] = {"weight": place(random_nf4(k, shape, template) if s["qlora"] else normal(k, shape))}
        params["layers"].append(layer)
    return params


def resolve_backend(s: dict, variant: str) -> tuple[str, str]:
    """``(backend, attention)`` of a JAX variant on this device (module docstring)."""
    import jax

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    if variant == "jax.grad":
        return "reference", "cudnn" if gpu else "sdpa:xla"
    backend = s["backend"]
    if backend == "auto":
        hopper = gpu and str(getattr(dev, "compute_capability", "")).startswith("9")
        backend = "mosaic" if hopper else "xla"
    if backend in ("mosaic", "pallas") and not gpu:
        raise ValueError(f"{SUITE}: backend {backend!r} needs a GPU")
    return backend, "cudnn" if gpu else "sdpa:xla"


def make_step(s: dict, variant: str):
    """``(step, (backend, attention))``: ``step(lora, opt_state, params, ids, n_items) -> (lora, opt_state,
    loss)``, pure; the loss is the fused head + cross-entropy (``jaxgrad``) or the plain logits loss
    (``jax.grad``), each the window mean over ``n_items``."""
    import jax
    import optax

    from jaxgrad.lora.model import _hidden_states, _loss_fn, head_weight
    from jaxgrad.ops.lm_head_loss import backend_beside, lm_head_loss

    cfg, lcfg = configs(s, variant)
    backend, attention = resolve_backend(s, variant)
    opt = optax.adamw(ADAMW["lr"], b1=ADAMW["b1"], b2=ADAMW["b2"], eps=ADAMW["eps"],
                      weight_decay=ADAMW["weight_decay"])

    def loss(lora, params, ids, n_items):
        if variant == "jax.grad":
            return _loss_fn(lora, params, ids, ids, n_items, cfg, lcfg, backend=backend, attention=attention)
        h = _hidden_states(params, lora, ids, cfg, lcfg, backend=backend, attention=attention)
        total, _ = lm_head_loss(h, head_weight(params, cfg).astype(h.dtype), ids, chunk_tokens=s["chunk_tokens"],
                                head_grad=False,  # LoRA: the head is frozen, dh is formed in the forward
                                backend=backend_beside(backend, h.dtype, False))  # the model's own choice
        return total / n_items

    def step(lora, opt_state, params, ids, n_items):
        value, grads = jax.value_and_grad(loss)(lora, params, ids, n_items)
        updates, opt_state = opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, value

    return step, opt, (backend, attention)


def _is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return "resource_exhausted" in text or "out of memory" in text or "outofmemory" in text


def run_jax_variant(variant: str, s: dict, *, repeats: int, warmup: int):
    """Build, compile and time one JAX variant in this process; an out-of-memory compile or run is a result."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.bench import harness as bm
    from jaxgrad.lora.model import count_items, init_lora

    row = _row(variant, s)
    step, opt, (backend, attention) = make_step(s, variant)
    cfg, lcfg = configs(s)
    params = build_params(s, jax.random.key(0))
    lora = init_lora(jax.random.key(1), cfg, lcfg, jnp.float32)
    opt_state = opt.init(lora)
    ids_host = peers.host_tokens(s)
    ids, n_items = jax.device_put(ids_host), jnp.asarray(count_items(ids_host), jnp.int32)
    jax.block_until_ready((params, lora, opt_state))
    recompute, checkpointing = variant_memory(variant, s)
    notes = [f"backend={backend}, attention={attention}, checkpointing={checkpointing}, "
             + (f"block_recompute={recompute}, fused LM-head loss (chunk {s['chunk_tokens']} tokens, head frozen: dh "
                "in the forward)" if variant.startswith("jaxgrad") else "plain [tokens, vocab] logits loss")
             + ", adapters and Adam moments donated"]
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(lora, opt_state, params, ids, n_items).compile()
        row.compile_ms = (time.perf_counter() - t0) * 1e3
        mem = bm.compiled_memory(compiled)
        row.argument_bytes, row.output_bytes = mem["argument_bytes"], mem["output_bytes"]
        row.temp_bytes, row.compiled_bytes = mem["temp_bytes"], mem["total_bytes"]
        state, losses, times = (lora, opt_state), [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            new_lora, new_opt, value = compiled(*state, params, ids, n_items)
            value.block_until_ready()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            state = (new_lora, new_opt)
            if len(losses) < 3:
                losses.append(float(value))
    except Exception as err:  # noqa: BLE001 - an OOM is a result; anything else goes up
        if not _is_oom(err):
            raise
        row.peak_bytes = bm.device_peak_bytes()
        row.notes = f"out of memory: {str(err).splitlines()[0][:200]}; " + "; ".join(notes)
        return row
    _timed(row, np.asarray(times))
    row.peak_bytes = bm.device_peak_bytes()
    notes.append("losses of steps 1-3: " + ", ".join(f"{v:.5g}" for v in losses))
    row.notes = "; ".join(notes)
    return row


def _timed(row, times: np.ndarray) -> None:
    row.median_ms, row.p10_ms = float(np.median(times)), float(np.percentile(times, 10))
    row.p90_ms, row.min_ms, row.repeats = float(np.percentile(times, 90)), float(times.min()), len(times)


def _row(variant: str, s: dict):
    from jaxgrad.bench import harness as bm

    sizes = {k: s[k] for k in ("model", "layers", "full_layers", "batch", "seq", "hidden", "vocab", "r", "qlora",
                               "tiny", "checkpointing")}
    return bm.Row(suite=SUITE, variant=variant, sizes=sizes, dtype="bf16", precision="default",
                  flops=accounting(s)["flops_nemo"])


# ----------------------------------------------------------------------------------------------- --max-context
def compiled_bytes_at(s: dict, seq: int) -> int | None:
    """temp + arguments + outputs of the ``jaxgrad`` step compiled at batch 1, sequence ``seq`` (abstract
    arguments: nothing is built or run); None if it does not compile (out of memory at compile time)."""
    import jax
    import jax.numpy as jnp

    from jaxgrad.bench import harness as bm
    from jaxgrad.lora.model import init_lora

    t = dict(s, batch=1, seq=seq)
    step, opt, _ = make_step(t, "jaxgrad")
    cfg, lcfg = configs(t)
    params = jax.eval_shape(lambda k: build_params(t, k), jax.random.key(0))
    lora = jax.eval_shape(lambda k: init_lora(k, cfg, lcfg, jnp.float32), jax.random.key(1))
    opt_state = jax.eval_shape(opt.init, lora)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(lora, opt_state, params, ids, n).compile()
    except Exception as err:  # noqa: BLE001
        if _is_oom(err):
            return None
        raise
    host = getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", None)
    if host:
        print(f"#     host memory of the compiled step at seq {seq}: {host / 2**30:.2f} GiB", flush=True)
    return bm.compiled_memory(compiled)["total_bytes"]


def device_memory_bytes(override_gib: float | None = None) -> int:
    import jax

    if override_gib is not None:
        return int(override_gib * 2**30)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"{SUITE}: --max-context needs the device's memory: this device reports none; pass "
                         "--device-memory-gib")
    return int(stats["bytes_limit"])


def check_context_args(step: int, start: int | None) -> int:
    """The first sequence tried (``start``, default ``step``); a ``ValueError`` naming the option if it is not a
    multiple of ``step >= 2``."""
    start = step if start is None else start
    if step < 2 or start < step or start % step:
        raise ValueError(f"{SUITE}: --context-start must be a multiple of --context-step (>= 2) and >= it, got "
                         f"{start} and {step}")
    return start


def max_context(s: dict, *, step: int, limit_bytes: int, start: int | None = None, budget_s: float | None = None,
                say=print) -> dict:
    """The largest multiple of ``step`` whose compiled step fits ``limit_bytes``: doubling from ``start`` (default
    ``step``; a multiple of it), then bisecting between the last that fit and the first that did not."""
    start = check_context_args(step, start)
    t_start, tried, longest = time.perf_counter(), {}, [0.0]

    def fits(seq):  # a compile is not started unless the longest one so far still fits the budget
        if budget_s is not None and time.perf_counter() - t_start + 1.2 * longest[0] > budget_s:
            raise TimeoutError
        t0 = time.perf_counter()
        b = compiled_bytes_at(s, seq)
        longest[0] = max(longest[0], time.perf_counter() - t0)
        tried[seq] = b
        say(f"#   seq {seq}: {'does not compile' if b is None else f'{b / 2**30:.2f} GiB'} "
            f"({'fits' if b is not None and b <= limit_bytes else 'too big'}; {time.perf_counter() - t0:.0f} s)")
        return b is not None and b <= limit_bytes

    lo, hi, complete = 0, None, True
    try:
        seq = start
        while fits(seq):
            lo, seq = seq, seq * 2
        hi = seq
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    except TimeoutError:
        complete = False
    return {"max_seq": lo, "first_too_big": hi, "step": step, "limit_bytes": limit_bytes, "complete": complete,
            "compiled_bytes": {str(k): v for k, v in sorted(tried.items())}, "published": UNSLOTH_CONTEXT,
            "rule": "largest multiple of step whose compiled jaxgrad step (batch 1) has temp + arguments + outputs "
                    "<= the device's bytes_limit; no host offload"}


# ----------------------------------------------------------------------------------------------------- the CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m jaxgrad.bench {SUITE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--qlora", action="store_true", help="the projections in NF4 with double quantisation")
    p.add_argument("--batch", type=int, default=2, help="micro-batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096; --tiny: 64)")
    p.add_argument("--layers", type=int, default=None, help="run the first N layers only (default: all)")
    p.add_argument("--tiny", action="store_true", help="tiny widths, vocabulary and sequence (CPU tests)")
    p.add_argument("--variants", default=None, help=f"comma-separated substrings of {list(VARIANTS)} (=name: exact)")
    p.add_argument("--checkpointing", default="none", help="jax.checkpoint policy of every block (jaxgrad, jax.grad)")
    p.add_argument("--backend", default="auto", help="jaxgrad's block backend: auto (mosaic on Hopper), xla, "
                                                     "mosaic, pallas")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="the fused loss's token chunk")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run; a variant "
                                                                 "with < 15 s left is not started (default: 540)")
    p.add_argument("--max-context", action="store_true", help="the longest batch-1 sequence whose compiled "
                                                              "jaxgrad step fits the device (nothing is run)")
    p.add_argument("--context-step", type=int, default=8192, help="--max-context granularity (default: 8192)")
    p.add_argument("--context-start", type=int, default=None,
                   help="--max-context: the first sequence tried, doubled while it fits (default: --context-step)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="--max-context: the memory to fit (default: the device's bytes_limit)")
    p.add_argument("--out", default="runs/bench", help="results directory (default: %(default)s, git-ignored)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    # before JAX starts: the children measure the device, not this process; JAX may take 95 % of the device's memory
    # (its default 75 % would leave a quarter to nobody where torch's allocator takes it all)
    os.environ.setdefault(MEM_FRACTION, "0.95")
    fresh_process.parent_setup()
    try:
        s = make_spec(a.model, layers=a.layers, batch=1 if a.max_context else a.batch, seq=a.seq, qlora=a.qlora,
                      tiny=a.tiny, checkpointing=a.checkpointing, backend=a.backend, chunk_tokens=a.chunk_tokens)
        if a.max_context:
            check_context_args(a.context_step, a.context_start)
    except ValueError as err:
        parser.error(str(err))
    from jaxgrad.bench import fresh_process as fp
    from jaxgrad.bench import harness as bm

    env = bm.environment()
    name = f"{SUITE}_{a.model}" + ("_qlora" if a.qlora else "") + ("_tiny" if a.tiny else "")
    if a.max_context:
        return _main_max_context(a, s, env, name + "_max_context", bm)
    names = fp.select_variants(list(VARIANTS), [v.strip() for v in (a.variants or "").split(",") if v.strip()],
                               SUITE)
    notes = header_lines(s)
    for line in notes:
        print(f"# {line}")
    rows, t_start = [], time.perf_counter()
    for variant in names:
        t0 = time.perf_counter()
        left = a.budget_s - (t0 - t_start)
        why = peers.skip_reason(variant, s)
        if why:
            row = _row(variant, s)
            row.notes = why
        elif left < 15:
            row = _row(variant, s)
            row.notes = f"error: not run: the run's time budget ({a.budget_s:.0f} s) is spent"
        else:
            row = peers.run_child(variant, s, _row(variant, s), module=MODULE, repeats=a.repeats, warmup=a.warmup,
                                  timeout=left)
        rows.append(row)
        print(f"#   {variant}: {_summary(s, row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        left = a.budget_s - (time.perf_counter() - t_start)
        if variant in TORCH_VARIANTS and status(row) == "out of memory" and s["batch"] > 1 and left >= 15:
            t0, one = time.perf_counter(), dict(s, batch=1)  # a peer that does not fit: as its users would, batch 1
            row = peers.run_child(variant, one, _row(variant, one), module=MODULE, repeats=a.repeats,
                                  warmup=a.warmup, timeout=left)
            row.variant = f"{variant} batch 1"
            rows.append(row)
            print(f"#   {row.variant}: {_summary(one, row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    per_variant = {r.variant: dict(metrics(_spec_of(s, r), r.median_ms, r.peak_bytes), status=status(r),
                                   batch=r.sizes["batch"], reason=None if r.median_ms is not None else r.notes)
                   for r in rows}
    env["suite_notes"] = notes + [f"{r.variant}: {_summary(_spec_of(s, r), r)}" for r in rows]
    env[SUITE] = {"spec": s, "accounting": accounting(s), "parameters": parameter_counts(s),
                  "frozen_weight_bytes": frozen_weight_bytes(s), "published": NEMO_8B, "variants": per_variant}
    return _write(rows, env, name, a.out, bm, failed=[r.variant for r in rows if status(r) == "error"])


def _spec_of(s: dict, row) -> dict:
    """The spec a row ran at (a peer retried at batch 1 has its own batch)."""
    return dict(s, batch=row.sizes["batch"])


def status(row) -> str:
    """``measured``, ``out of memory`` (a result), ``skipped`` (with its reason) or ``error``."""
    if row.median_ms is not None:
        return "measured"
    for word in ("out of memory", "skipped"):
        if row.notes.startswith(word):
            return word
    return "error"


def _summary(s: dict, row) -> str:
    m = metrics(s, row.median_ms, row.peak_bytes)
    peak = "-" if row.peak_bytes is None else f"{row.peak_bytes / 2**30:.2f} GiB"
    if row.median_ms is None:
        return f"{row.notes}{'' if row.notes.startswith(status(row)) else ' (' + status(row) + ')'} (peak {peak})"
    est = "" if "estimate_full_depth_tokens_per_s" not in m else (
        f"; estimate at {s['full_layers']} layers {m['estimate_full_depth_tokens_per_s']:,.0f} tokens/s (not "
        "measured: same model-TFLOP/s assumed)")
    return (f"{m['tokens_per_s']:,.0f} tokens/s ({row.median_ms:.1f} ms/step, {s['layers']} layers), "
            f"{m['model_tflops_nemo']:.1f} model TFLOP/s (NeMo: 4PN, no attention), "
            f"{m['model_tflops_with_attention']:.1f} with attention; peak {peak}, minus frozen weights "
            f"{m['peak_minus_frozen_bytes'] / 2**30:.2f} GiB{est}" if row.peak_bytes is not None else
            f"{m['tokens_per_s']:,.0f} tokens/s ({row.median_ms:.1f} ms/step), {m['model_tflops_nemo']:.1f} model "
            f"TFLOP/s (NeMo), {m['model_tflops_with_attention']:.1f} with attention; peak - (no device stats){est}")


def _main_max_context(a, s: dict, env: dict, name: str, bm) -> int:
    limit = device_memory_bytes(a.device_memory_gib)
    notes = header_lines(s)[:3] + [f"--max-context: batch 1, multiples of {a.context_step}, against "
                                   f"{limit / 2**30:.2f} GiB; {UNSLOTH_CONTEXT}"]
    for line in notes:
        print(f"# {line}")
    res = max_context(s, step=a.context_step, limit_bytes=limit, start=a.context_start, budget_s=a.budget_s)
    row = _row("jaxgrad max context", dict(s, seq=res["max_seq"]))
    row.compiled_bytes = res["compiled_bytes"].get(str(res["max_seq"]))
    row.notes = (f"max_seq={res['max_seq']} (first too big: {res['first_too_big']}; "
                 f"{'complete' if res['complete'] else 'budget spent before the bisection ended'}); {res['rule']}")
    print(f"# {row.notes}")
    env["suite_notes"] = notes + [row.notes]
    env[SUITE] = {"spec": s, "max_context": res}
    return _write([row], env, name, a.out, bm, failed=[] if res["max_seq"] else ["jaxgrad max context"])


def _write(rows, env, name, out, bm, *, failed) -> int:
    table = bm.format_table(rows, env) + "".join(f"# {line}\n" for line in env["suite_notes"])
    print(table, end="")
    path = bm.write_results(rows, name, out, env=env, precision="nf4" if env[SUITE]["spec"]["qlora"] else "bf16")
    path.with_suffix(".txt").write_text(table)
    print(f"wrote {path.resolve()} and {path.with_suffix('.txt').name}")
    if failed:
        print(f"error: {len(failed)} variant run(s) failed: {failed}", file=sys.stderr)
        return 1
    return 0


def child_main(argv: list[str]) -> int:
    """A child process's entry (:func:`jaxgrad.bench.llama_real_peers.run_child`): runs one variant, prints its row
    after :data:`jaxgrad.bench.fresh_process.ROW_TAG`."""
    import json

    from jaxgrad.bench import harness as bm

    p = argparse.ArgumentParser(description=f"one {SUITE} variant (python -m jaxgrad.bench {SUITE})")
    p.add_argument("--child", required=True, choices=VARIANTS)
    p.add_argument("--spec", required=True, help="the JSON of make_spec")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    s = json.loads(a.spec)
    if a.child in TORCH_VARIANTS:
        row = peers.run_torch_variant(a.child, s, _row(a.child, s), repeats=a.repeats, warmup=a.warmup)
    else:
        row = run_jax_variant(a.child, s, repeats=a.repeats, warmup=a.warmup)
    print(fresh_process.ROW_TAG + json.dumps(bm._jsonable(row.to_dict())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]) if "--child" in sys.argv[1:] else main())
