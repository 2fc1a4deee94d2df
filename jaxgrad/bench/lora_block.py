r"""The ``lora`` benchmark suite (issue #12 item 5): one Llama decoder block with LoRA on all 7 projections, forward
and backward (the LoRA gradients and ``dx``), bf16, each variant **in a fresh process**.

    python -m jaxgrad.bench lora [--sizes small|full|long] [--repeats N] [--warmup N] [--variants SUBSTR,...]

Variants (``VARIANTS``; on a machine without a GPU the cuDNN attention is replaced by
``jax.nn.dot_product_attention(implementation="xla")``, the same code path, and the variant is named so):

* ``custom_vjp cudnn``: :func:`jaxgrad.lora.block` (the whole-block custom VJP, plain XLA) with the attention core
  through ``jax.nn.dot_product_attention(implementation="cudnn")`` and its cuDNN backward;
* ``custom_vjp cudnn nf4``: the same with the 7 projection weights in NF4 (dequantised on the fly, again in the
  backward);
* ``custom_vjp+grouped cudnn`` / ``custom_vjp+grouped cudnn nf4``: the same with ``group_projections=True``
  (q/k/v and gate/up as one GEMM each, the LoRA A rows folded into the weights; issue #13);
* ``custom_vjp+low-memory cudnn``: ``low_memory=True`` (the attention half recomputed for real after the MLP
  backward: less peak memory, more time);
* ``custom_vjp+unfolded cudnn``: ``fold_lora_b=False`` (each projection's LoRA term as a separate ``U B^T``
  product added in fp32; the default folds it into the base GEMM, ``[h | sU] [W | B]^T``);
* ``custom_vjp xla-attn``: the custom VJP with our own XLA attention (materialises ``[B, Hq, T, T]`` scores);
* ``custom_vjp pallas-attn``: the custom VJP with the flash-attention Pallas kernels
  (:mod:`jaxgrad.ops.flash_attention`; GPU only, like the other Pallas variants);
* ``jax.grad(reference) cudnn`` / ``jax.grad(reference) xla-attn``: ``jax.vjp`` of the plain reference block
  (:func:`jaxgrad.lora.block_reference`), with ``jax.nn.dot_product_attention(implementation="cudnn")`` or with
  the plain attention;
* ``torch LlamaDecoderLayer+PEFT sdpa``: transformers' ``LlamaDecoderLayer`` (``attn_implementation="sdpa"``,
  causal, no mask) with PEFT LoRA injected on all 7 projections (``inject_adapter_in_model``), everything bf16
  (the adapters too: PEFT would otherwise keep fp32 adapters), ``torch.autograd.grad`` of ``y`` with the same
  cotangent for ``x`` and the 14 LoRA factors. Skipped with a note where torch / transformers / peft or CUDA are
  missing.

Every variant gets the same inputs (NumPy, seeded: base weights N(0, 1/in), norm weights 1, LoRA A and B random
non-zero, ``x`` and the cotangent N(0, 1)), so the norms of ``y``, ``dx`` and the LoRA gradients printed in each
row's notes agree across variants up to bf16 rounding (NF4: up to its quantisation) -- a check that the torch
layer computes the same block.

Measured, per variant, in its own process: the compile time; the harness's timing (:func:`jaxgrad.bench.harness.
time_fn`: wall clock of each call until its outputs are ready, median of ``repeats`` after ``warmup`` calls; torch:
``torch.cuda.synchronize()`` after each call, the same clock); the **peak device memory since the process started**,
weights, inputs and outputs included, the same way on both sides: JAX ``device.memory_stats()["peak_bytes_in_use"]``,
torch ``torch.cuda.max_memory_allocated()`` (never reset). JAX's figure also covers what the compiler allocated while
autotuning; ``peak after compile`` in the notes is that high-water mark before the first run. The compiled
``arg+out+temp`` of the JAX executable is reported as well.

FLOPs (:func:`block_flops`), with ``N = batch * seq`` tokens, ``P`` the 7 projections' weights, ``pairs`` the
causal (query, key) pairs ``seq (seq + 1) / 2`` per batch row and head, ``d`` the head dim:

* base projections: forward ``2 N P``, backward ``2 N P`` (``dx`` only: the base is frozen, no ``dW``);
* attention: forward ``4 B Hq pairs d`` (``QK^T``, ``PV``), backward ``8 B Hq pairs d`` (``dV``, ``dP``, ``dQ``,
  ``dK``);
* LoRA: forward ``2 N r sum(in + out)``, backward ``4 N r sum(in + out)``.

Elementwise work (norms, RoPE, softmax, SwiGLU) is not counted. The floor is the harness's roofline at the
data-sheet dense bf16 peak (989 TFLOP/s on H100 SXM and H200); at the full shape, 1.782 TFLOP -> 1.80 ms there,
2.26 ms at 790 TFLOP/s (about what cuBLAS sustains on large bf16 GEMMs). Our custom VJP recomputes the forward in
the backward (one extra forward, +0.84 TFLOP of work not counted in the floor).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from jaxgrad.bench import harness as bm
from jaxgrad.bench.fresh_process import child_main, compile_and_time, run_fresh_suite, select_variants
from jaxgrad.bench.fresh_process import run_in_fresh_process as _run_in_fresh_process
from jaxgrad.bench.peers import cuda_unavailable, sdpa_llama_config, time_torch, torch_missing
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig

SIZES = {
    "full": dict(batch=4, seq=2048, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632, r=16),
    "small": dict(batch=2, seq=32, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=160, r=4),
    # issue #13's row at seq 8192: the full block's widths, one sequence of 8192 tokens (as many tokens as "full")
    "long": dict(batch=1, seq=8192, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632, r=16),
}
LORA_ALPHA_OVER_R = 1.0  # lora_alpha = r: scale 1
ROPE_THETA = 10000.0
TORCH_VARIANT = "torch LlamaDecoderLayer+PEFT sdpa"
# name -> (backend, attention, nf4); attention "cudnn" becomes "sdpa:xla" off-GPU (variant renamed)
JAX_VARIANTS = {
    "custom_vjp cudnn": ("xla", "cudnn", False),
    "custom_vjp cudnn nf4": ("xla", "cudnn", True),
    "custom_vjp xla-attn": ("xla", "xla", False),
    # issue #13 item 1: the attention core as the flash-attention Pallas kernels (jaxgrad.ops.flash_attention)
    "custom_vjp pallas-attn": ("xla", "pallas", False),
    "jax.grad(reference) cudnn": ("reference", "cudnn", False),
    "jax.grad(reference) xla-attn": ("reference", "xla", False),
    # issue #13: the block's Pallas kernels (RMSNorm; NF4 dequantise + matmul) behind the same custom VJP
    "custom_vjp cudnn pallas": ("pallas", "cudnn", False),
    "custom_vjp cudnn nf4 pallas": ("pallas", "cudnn", True),
    # issue #13: the dense projections' forward (and recompute) as one Mosaic GPU kernel each (backend="mosaic")
    "custom_vjp cudnn mosaic": ("mosaic", "cudnn", False),
    # NF4 base weights on the mosaic backend: dequantised by XLA, then the same kernels
    "custom_vjp cudnn nf4 mosaic": ("mosaic", "cudnn", True),
    "custom_vjp+low-memory cudnn mosaic": ("mosaic", "cudnn", False),
    # issue #13: the projections sharing an input as one GEMM with the LoRA A rows folded in (group_projections)
    "custom_vjp+grouped cudnn": ("xla", "cudnn", False),
    "custom_vjp+grouped cudnn nf4": ("xla", "cudnn", True),
    # the attention half recomputed for real after the MLP backward (block(low_memory=True)): peak vs time
    "custom_vjp+low-memory cudnn": ("xla", "cudnn", False),
    # each projection's LoRA term as a separate U B^T product (block(fold_lora_b=False); the default folds it)
    "custom_vjp+unfolded cudnn": ("xla", "cudnn", False),
}
#: the 7 projections' HF names, in PEFT order, and the group each sits in (the model's own table)
PROJ = tuple(name for _, name in PROJECTIONS)
GROUP = {name: group for group, name in PROJECTIONS}


RUN_ORDER = ("custom_vjp cudnn", "jax.grad(reference) cudnn", TORCH_VARIANT, "custom_vjp+low-memory cudnn",
             "custom_vjp+unfolded cudnn", "custom_vjp+grouped cudnn",
             "custom_vjp cudnn nf4", "custom_vjp+grouped cudnn nf4", "jax.grad(reference) xla-attn",
             "custom_vjp xla-attn", "custom_vjp cudnn pallas",
             "custom_vjp cudnn nf4 pallas", "custom_vjp cudnn mosaic", "custom_vjp cudnn nf4 mosaic",
             "custom_vjp+low-memory cudnn mosaic", "custom_vjp pallas-attn")  # most wanted first (a budget may cut)


def variant_names(on_gpu: bool) -> list[str]:
    """All variant names of this platform, in run order (the cuDNN ones renamed off-GPU; the Pallas ones, compiled
    kernels, and the Mosaic GPU one only on a GPU)."""
    return [name if on_gpu else name.replace("cudnn", "sdpa(xla)") for name in RUN_ORDER
            if on_gpu or ("pallas" not in name and "mosaic" not in name)]


def _jax_spec(name: str) -> tuple[str, str, bool]:
    key = name.replace("sdpa(xla)", "cudnn")
    if key not in JAX_VARIANTS:
        raise ValueError(f"lora bench: unknown variant {name!r}; known: {variant_names(True)}")
    backend, attention, nf4 = JAX_VARIANTS[key]
    if attention == "cudnn" and "sdpa(xla)" in name:
        attention = "sdpa:xla"
    return backend, attention, nf4


# ------------------------------------------------------------------------------------------------------ the model
def proj_shapes(s: dict) -> dict[str, tuple[int, int]]:
    """HF ``[out, in]`` of the 7 projections at the suite's sizes (:attr:`LlamaConfig.projection_shapes`)."""
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"])
    return {name: shape for (_, name), shape in cfg.projection_shapes.items()}


def block_flops(batch, seq, hidden, heads, kv_heads, head_dim, intermediate, r, causal: bool = True) -> dict:
    """FLOPs of one block's forward + backward (LoRA grads and dx; frozen base), by part (module docstring)."""
    s = dict(batch=batch, seq=seq, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
             intermediate=intermediate, r=r)
    shapes = proj_shapes(s)
    n = batch * seq
    p = sum(o * i for o, i in shapes.values())
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    io = sum(o + i for o, i in shapes.values())
    parts = {"base_fwd": 2.0 * n * p, "base_bwd_dx": 2.0 * n * p,
             "attention_fwd": 4.0 * batch * heads * pairs * head_dim,
             "attention_bwd": 8.0 * batch * heads * pairs * head_dim,
             "lora_fwd": 2.0 * n * r * io, "lora_bwd": 4.0 * n * r * io}
    parts["total"] = sum(parts.values())
    parts["recompute_fwd_custom_vjp"] = parts["base_fwd"] + parts["attention_fwd"] + parts["lora_fwd"]
    return parts


def block_bytes(s: dict, itemsize: int = 2) -> float:
    """Bytes any implementation must move: the weights read in the forward and again in the backward, ``x`` read
    twice, ``y`` written, the cotangent read, ``dx`` written (the LoRA factors are negligible)."""
    p = sum(o * i for o, i in proj_shapes(s).values())
    act = s["batch"] * s["seq"] * s["hidden"]
    return float(itemsize * (2 * p + 5 * act))


def make_inputs(s: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 NumPy inputs shared by every variant: ``w/<proj>`` [out, in] ~ N(0, 1/in), ``a/<proj>`` [r, in] ~
    U(+-1/sqrt(in)), ``b/<proj>`` [out, r] ~ U(+-1/sqrt(r)) (random non-zero, as ``init_lora_weights=False``),
    ``x`` and ``cot`` [B, T, H] ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (o, i) in proj_shapes(s).items():
        out[f"w/{name}"] = (rng.standard_normal((o, i), np.float32) / np.float32(np.sqrt(i)))
        out[f"a/{name}"] = rng.uniform(-1, 1, (s["r"], i)).astype(np.float32) / np.float32(np.sqrt(i))
        out[f"b/{name}"] = rng.uniform(-1, 1, (o, s["r"])).astype(np.float32) / np.float32(np.sqrt(s["r"]))
    shape = (s["batch"], s["seq"], s["hidden"])
    out["x"] = rng.standard_normal(shape, np.float32)
    out["cot"] = rng.standard_normal(shape, np.float32)
    return out


def _norms_note(y, dx, lora_grads: dict) -> str:
    """``|y|, |dx|, |dA_q|, |dB_down|`` (Frobenius, float64 on the host)."""
    f = lambda a: float(np.linalg.norm(np.asarray(a, np.float64).ravel()))  # noqa: E731
    return (f"|y|={f(y):.5g} |dx|={f(dx):.5g} |dA_q|={f(lora_grads['q_proj']['lora_A']):.5g} "
            f"|dB_down|={f(lora_grads['down_proj']['lora_B']):.5g}")


# --------------------------------------------------------------------------------------------------- JAX variants
def run_jax_variant(name: str, sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """Measure one JAX variant in this process (call it in a fresh process: the peak is process-wide)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from jaxgrad.lora.block import _block_reference, _block_sdpa, block
    from jaxgrad.lora.config import LoraConfig

    s = SIZES[sizes]
    backend, attention, nf4 = _jax_spec(name)
    grouped = "+grouped" in name
    low_memory = "+low-memory" in name
    fold_b = "+unfolded" not in name
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rope_theta=ROPE_THETA,
                      max_position_embeddings=s["seq"], vocab_size=256, rms_norm_eps=1e-5)
    lcfg = LoraConfig(r=s["r"], lora_alpha=LORA_ALPHA_OVER_R * s["r"], target_modules="all-linear",
                      init_lora_weights=False)
    host = make_inputs(s)
    bf16 = lambda a: jax.device_put(a.astype(ml_dtypes.bfloat16))  # noqa: E731 - cast on the host
    params: dict[str, Any] = {"self_attn": {}, "mlp": {}}
    lora: dict[str, Any] = {"self_attn": {}, "mlp": {}}
    for p in PROJ:
        if nf4:
            from jaxgrad.ops.nf4 import nf4_quantize

            w = jax.device_put(nf4_quantize(host[f"w/{p}"].astype(ml_dtypes.bfloat16), blocksize=64))
        else:
            w = bf16(host[f"w/{p}"])
        params[GROUP[p]][p] = {"weight": w}
        lora[GROUP[p]][p] = {"lora_A": bf16(host[f"a/{p}"]), "lora_B": bf16(host[f"b/{p}"])}
    for n in ("input_layernorm", "post_attention_layernorm"):
        params[n] = {"weight": bf16(np.ones(s["hidden"], np.float32))}
    x, cot = bf16(host["x"]), bf16(host["cot"])
    del host

    def run_block(params, lora, x):
        if backend == "reference":  # what block(backend="reference") runs, any attention implementation
            return _block_reference(params, lora, x, cfg, lcfg, attention=attention)
        if attention.startswith("sdpa:"):  # the attention="cudnn" code path with another implementation (CPU)
            return _block_sdpa(params, lora, x, cfg, lcfg, implementation=attention.split(":", 1)[1],
                               group_projections=grouped, low_memory=low_memory, fold_lora_b=fold_b)
        return block(params, lora, x, cfg, lcfg, attention=attention, backend=backend, group_projections=grouped,
                     low_memory=low_memory, fold_lora_b=fold_b)

    def fwd_bwd(params, lora, x, cot):
        y, pull = jax.vjp(lambda l, xx: run_block(params, l, xx), lora, x)
        dl, dx = pull(cot)
        return y, dl, dx

    flops = block_flops(**s)["total"]
    floor = bm.floor_ms(flops, block_bytes(s), dtype="bf16", precision="tf32")
    row = bm.Row(suite="lora", variant=name, sizes=dict(s), dtype="bf16", precision=precision, flops=flops,
                 bytes_moved=block_bytes(s), floor_ms=floor["floor_ms"], floor_bound=floor["bound"],
                 floor_table_row=floor["table_row"])
    notes = [f"fresh process; attention={attention}" + (", NF4 base (blocksize 64)" if nf4 else "")]
    args = (params, lora, x, cot)
    compiled, peak_compile = compile_and_time(row, fwd_bwd, args, warmup=warmup, repeats=repeats)
    if row.floor_ms is not None and row.median_ms:
        row.achieved_fraction = row.floor_ms / row.median_ms
    y, dl, dx = compiled(*args)
    grads = {p: dl[GROUP[p]][p] for p in PROJ}
    if peak_compile is not None:
        notes.append(f"peak after compile {peak_compile / 2**20:.1f} MiB")
    notes.append(_norms_note(jnp.asarray(y, jnp.float32), jnp.asarray(dx, jnp.float32),
                             jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), grads)))
    row.notes = "; ".join(notes)
    return row


# -------------------------------------------------------------------------------------------------- torch variant
def run_torch_variant(sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """transformers ``LlamaDecoderLayer`` + PEFT LoRA on all 7 projections, bf16, SDPA attention (CUDA only)."""
    s = SIZES[sizes]
    flops = block_flops(**s)["total"]
    row = bm.Row(suite="lora", variant=TORCH_VARIANT, sizes=dict(s), dtype="bf16", precision=precision,
                 flops=flops, bytes_moved=block_bytes(s))
    why = cuda_unavailable(torch_missing())
    if why:
        row.notes = why
        return row
    import peft
    import torch
    import transformers
    from transformers.models.llama import modeling_llama

    dev, dt = "cuda", torch.bfloat16
    kw = dict(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
              num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-5,
              max_position_embeddings=s["seq"], vocab_size=256, num_hidden_layers=1, attention_bias=False,
              mlp_bias=False, hidden_act="silu", attention_dropout=0.0)
    cfg = sdpa_llama_config(transformers, ROPE_THETA, **kw)
    layer = modeling_llama.LlamaDecoderLayer(cfg, layer_idx=0)
    lcfg = peft.LoraConfig(r=s["r"], lora_alpha=LORA_ALPHA_OVER_R * s["r"], lora_dropout=0.0,
                           target_modules=list(PROJ), init_lora_weights=False, bias="none")
    layer = peft.inject_adapter_in_model(lcfg, layer)
    layer = layer.to(dtype=dt).to(dev).train(False)  # cast on the host, then move; adapters bf16 like the base
    host = make_inputs(s)
    to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dt).to(dev)  # noqa: E731 - cast on the host
    lora_params, scalings = {}, set()
    with torch.no_grad():
        for mod_name, mod in layer.named_modules():
            short = mod_name.split(".")[-1]
            if short in PROJ and hasattr(mod, "base_layer"):
                mod.base_layer.weight.copy_(to_dev(host[f"w/{short}"]))
                mod.lora_A["default"].weight.copy_(to_dev(host[f"a/{short}"]))
                mod.lora_B["default"].weight.copy_(to_dev(host[f"b/{short}"]))
                lora_params[short] = (mod.lora_A["default"].weight, mod.lora_B["default"].weight)
                scalings.add(float(mod.scaling["default"]))
            elif short in ("input_layernorm", "post_attention_layernorm"):
                mod.weight.fill_(1.0)
    dtypes = {str(t.dtype) for t in layer.parameters()}
    if len(lora_params) != 7 or scalings != {LORA_ALPHA_OVER_R} or dtypes != {"torch.bfloat16"}:
        raise RuntimeError(f"PEFT injected LoRA on {sorted(lora_params)} with scalings {scalings}, dtypes {dtypes}")
    for p in layer.parameters():
        p.requires_grad_(False)
    flat = [t for pair in lora_params.values() for t in pair]
    for t in flat:
        t.requires_grad_(True)
    x = to_dev(host["x"]).requires_grad_(True)
    cot = to_dev(host["cot"])
    del host
    rotary = modeling_llama.LlamaRotaryEmbedding(config=cfg).to(dev)
    position_ids = torch.arange(s["seq"], device=dev)[None].expand(s["batch"], -1)

    def step():
        cos, sin = rotary(x, position_ids)
        out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
        y = out[0] if isinstance(out, (tuple, list)) else out
        grads = torch.autograd.grad(y, [x, *flat], grad_outputs=cot)
        return y, grads

    time_torch(step, row, warmup=warmup, repeats=repeats)
    floor = bm.floor_ms(flops, block_bytes(s), dtype="bf16", precision="tf32",
                        device_kind=torch.cuda.get_device_name())
    row.floor_ms, row.floor_bound, row.floor_table_row = floor["floor_ms"], floor["bound"], floor["table_row"]
    if row.floor_ms is not None:
        row.achieved_fraction = row.floor_ms / row.median_ms
    y, grads = step()
    names = list(lora_params)
    lg = {n: {"lora_A": grads[1 + 2 * k].detach().float().cpu().numpy(),
              "lora_B": grads[2 + 2 * k].detach().float().cpu().numpy()} for k, n in enumerate(names)}
    row.notes = (f"fresh process; torch {torch.__version__}, transformers {transformers.__version__}, peft "
                 f"{peft.__version__}, attn sdpa (causal), adapters bf16, first call {row.compile_ms:.0f} ms; "
                 + _norms_note(y.detach().float().cpu().numpy(), grads[0].detach().float().cpu().numpy(), lg))
    return row


# ----------------------------------------------------------------------------------------------------- the suite
def floor_lines(sizes: str) -> list[str]:
    """The FLOP count and the floors, as printed with the table."""
    s = SIZES[sizes]
    f = block_flops(**s)
    peaks = bm.lookup_peaks()
    at = lambda rate: f["total"] / rate * 1e3  # noqa: E731
    lines = [f"lora block fwd+bwd (LoRA grads + dx), bf16, {bm._fmt_sizes(s)}, LoRA on all 7 projections",
             "FLOPs = " + f"{f['total']:.4g} = base fwd {f['base_fwd']:.4g} + base bwd (dx only) "
             f"{f['base_bwd_dx']:.4g} + causal attention fwd {f['attention_fwd']:.4g} + bwd {f['attention_bwd']:.4g}"
             f" + LoRA fwd {f['lora_fwd']:.4g} + bwd {f['lora_bwd']:.4g} (custom VJP recomputes the forward: "
             f"+{f['recompute_fwd_custom_vjp']:.4g}, not in the floor)",
             f"floor at 989 TFLOP/s (data-sheet dense bf16, H100 SXM / H200): {at(989e12):.4g} ms; at 790 TFLOP/s "
             f"(~80% of it, what large bf16 GEMMs sustain): {at(790e12):.4g} ms; memory floor "
             f"{block_bytes(s) / 3.35e12 * 1e3:.4g} ms at 3.35 TB/s"
             + ("" if peaks is not None else " (no peak table for this device: floor column empty)"),
             "each variant runs in a fresh process; peak = device high-water mark since that process started, "
             "weights/inputs/outputs included (JAX peak_bytes_in_use, torch max_memory_allocated)"]
    return lines


def run_in_fresh_process(name: str, sizes: str, **kw) -> bm.Row:
    """One variant of this suite in a child process (:func:`jaxgrad.bench.fresh_process.run_in_fresh_process`)."""
    return _run_in_fresh_process(name, sizes, **{"module": "jaxgrad.bench.lora_block", "suite": "lora",
                                                 "size_table": SIZES, **kw})


def suite_lora(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants=None,
               timeout: float = 300.0, budget_s: float | None = None, say=print) -> tuple[list[bm.Row], list[str]]:
    """Every variant in its own process, one after the other. Returns ``(rows, notes)``: ``notes`` are the FLOP
    and floor lines (printed with the table). ``variants``: substrings selecting variants (default all; ``=name``
    selects that name exactly).
    ``timeout``: per variant; ``budget_s``: for the whole suite (a child gets at most what is left; a variant with
    less than 15 s left is not started and its row says so)."""
    import jax

    names = select_variants(variant_names(jax.default_backend() == "gpu"), variants, "lora", known=variant_names(True))
    notes = floor_lines(sizes)
    for line in notes:
        say(f"# {line}")
    rows = run_fresh_suite(names, sizes, precision, repeats=repeats, warmup=warmup, timeout=timeout,
                           budget_s=budget_s, say=say, module="jaxgrad.bench.lora_block", suite="lora",
                           size_table=SIZES,
                           skip_reason=lambda name: torch_missing() if name == TORCH_VARIANT else None)
    return rows, notes


def _child_main(argv: list[str]) -> int:
    return child_main(argv, sizes=SIZES, run_torch={TORCH_VARIANT: run_torch_variant}, run_jax=run_jax_variant,
                      description="one lora benchmark variant (python -m jaxgrad.bench lora)")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
