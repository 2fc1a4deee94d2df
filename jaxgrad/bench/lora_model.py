r"""The ``lora_model`` benchmark suite (issue #13 item 4): **one whole training step** of a small Llama causal LM with
LoRA, tokens/s and peak memory, our JAX step against transformers + PEFT; each variant in a fresh process (the
machinery of :mod:`jaxgrad.bench.lora_block`).

    python -m jaxgrad.bench lora_model [--sizes small|full] [--repeats N] [--warmup N] [--variants SUBSTR,...]
                                       [--budget-s S]

The step: embedding, ``layers`` decoder blocks, final RMSNorm, untied LM head (bf16 logits, as HF's
``LlamaForCausalLM``), the shifted cross-entropy in fp32 (:func:`jaxgrad.lora.model.loss_fn`; HF's
``ForCausalLMLoss`` upcasts the bf16 logits the same way; labels = the inputs, so every row has ``seq - 1``
targets), gradients of the LoRA factors only (``jax.value_and_grad`` w.r.t. the adapters; the base is an argument
that is not differentiated), then AdamW on the adapters (``optax.adamw``: lr 1e-4, betas 0.9 / 0.999, eps 1e-8,
weight decay 0, the same as ``torch.optim.AdamW``). Base weights bf16; LoRA r = 16, alpha = 32 (scale 2) on all 7
projections of every layer, no dropout; the adapters are fp32 on both sides (PEFT's ``get_peft_model`` default,
``autocast_adapter_dtype=True``, keeps them fp32 on a bf16 model; they are the optimiser's master weights).

Variants (``cudnn`` becomes ``sdpa(xla)`` off-GPU: ``jax.nn.dot_product_attention(implementation="xla")``, the same
code path; the Mosaic GPU one only on a GPU):

* ``custom_vjp cudnn``: :func:`jaxgrad.lora.model.apply` with ``backend="xla", attention="cudnn"``: every block is
  the whole-block custom VJP the ``lora`` suite's ``custom_vjp cudnn`` times;
* ``custom_vjp cudnn mosaic``: the same with ``backend="mosaic"`` (the projections' forward as Mosaic GPU kernels);
* ``jax.grad(reference) cudnn``: ``backend="reference"``, ``jax.grad`` of the plain blocks, cuDNN attention;
* ``torch LlamaForCausalLM+PEFT sdpa``: transformers ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, bf16)
  wrapped by ``peft.get_peft_model`` (``LoraConfig(r=16, lora_alpha=32, lora_dropout=0, target_modules=<the 7>)``),
  ``torch.optim.AdamW`` (``fused=True``) on the LoRA parameters; a step is ``model(input_ids, labels=input_ids)``
  (HF shifts), ``loss.backward()``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``. Skipped with a note where
  torch / transformers / peft or CUDA are missing.

Every variant starts from the same weights and tokens (NumPy, seeded: embedding N(0, 1), projections N(0, 1/in),
head N(0, 1/hidden), norms 1, LoRA A ~ U(+-1/sqrt(in)) and B ~ U(+-1/sqrt(r)), both non-zero so that every factor
has a gradient at the first step; tokens uniform in the vocabulary), so the losses of the first three steps printed
in each row's notes agree across variants up to bf16 rounding: a check that the torch model is the same model.

Timing (per variant, in its own process): JAX: the compiled step timed by :func:`jaxgrad.bench.harness.time_fn`
(median of ``repeats`` calls after ``warmup``), each call from the same initial state (no donation: the adapters and
their Adam moments, ~29 MiB at ``full``, exist twice); torch: :func:`jaxgrad.bench.peers.time_torch` (the
training runs on: every call is one more step). **tokens/s** = ``batch * seq / median step time``. Peak memory: the
device's high-water mark since the process started, weights included (JAX ``peak_bytes_in_use``, torch
``max_memory_allocated``).

FLOPs of one step (:func:`step_flops`), ``N = batch * seq`` tokens, ``L`` layers, ``V`` vocab, ``H`` hidden:

.. math::

    F = L \cdot F_\mathrm{block} - F_\mathrm{skip} + 2 N V H + 2 N V H

* :math:`F_\mathrm{block}` = :func:`jaxgrad.bench.lora_block.block_flops` (base forward ``2 N P`` and its ``dX``
  ``2 N P`` -- the base is frozen, no ``dW``, but ``dX`` must flow through every layer to reach the adapters below;
  causal attention ``4 B Hq pairs d`` forward and ``8 B Hq pairs d`` backward; LoRA ``2 N r sum(in + out)`` forward,
  ``4 N r sum(in + out)`` backward: ``G = dY B``, ``dB``, ``dA``, ``dX += G A``);
* :math:`F_\mathrm{skip}`: the first layer's ``dX`` of q/k/v (base ``2 N out in`` and LoRA ``2 N r in`` each):
  their input is the embedding's output, whose gradient nothing needs (torch does not compute it; our VJP does,
  unless XLA removes it as dead code);
* the head: ``2 N V H`` forward (logits) and ``2 N V H`` backward (``dh = dlogits W``; the head is frozen, no
  ``dW``). The embedding (a gather), norms, RoPE, softmax, SwiGLU, the cross-entropy and AdamW (elementwise,
  ~2.4 M adapter parameters at ``full``) are not counted.

At ``full`` (TinyLlama-1.1B widths, 4 layers, vocab 32000, batch 4 x seq 2048): F = 9.136 TFLOP, whose bf16 floor
is 9.24 ms at 989 TFLOP/s (H100 SXM / H200 dense data sheet), i.e. at most 887 k tokens/s; 11.56 ms (708 k tokens/s)
at 790 TFLOP/s. Our custom VJP also recomputes each block's forward in the backward (not in the floor).
"""

from __future__ import annotations

import sys

import numpy as np

from jaxgrad.bench import harness as bm
from jaxgrad.bench import lora_block as bench
from jaxgrad.bench import fresh_process as harness
from jaxgrad.bench import peers

SUITE = "lora_model"
SIZES = {
    "full": dict(bench.SIZES["full"], vocab=32000, layers=4),
    "small": dict(batch=2, seq=32, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=160, r=16, vocab=128,
                  layers=2),
}
LORA_ALPHA = 32.0
ROPE_THETA = bench.ROPE_THETA
RMS_EPS = 1e-5
ADAMW = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
TORCH_VARIANT = "torch LlamaForCausalLM+PEFT sdpa"
JAX_VARIANTS = {"custom_vjp cudnn": ("xla", "cudnn"), "custom_vjp cudnn mosaic": ("mosaic", "cudnn"),
                "jax.grad(reference) cudnn": ("reference", "cudnn")}
RUN_ORDER = ("custom_vjp cudnn mosaic", TORCH_VARIANT, "jax.grad(reference) cudnn", "custom_vjp cudnn")  # best first
MODULE = "jaxgrad.bench.lora_model"


def variant_names(on_gpu: bool) -> list[str]:
    """All variants of this platform in run order (cuDNN renamed ``sdpa(xla)`` off-GPU; Mosaic GPU only)."""
    return [n if on_gpu else n.replace("cudnn", "sdpa(xla)") for n in RUN_ORDER if on_gpu or "mosaic" not in n]


def jax_spec(name: str) -> tuple[str, str]:
    """``(backend, attention)`` of a JAX variant name (``attention`` ``"sdpa:xla"`` for the renamed ones)."""
    key = name.replace("sdpa(xla)", "cudnn")
    if key not in JAX_VARIANTS:
        raise ValueError(f"{SUITE} bench: unknown variant {name!r}; known: {variant_names(True)}")
    backend, attention = JAX_VARIANTS[key]
    return backend, "sdpa:xla" if "sdpa(xla)" in name else attention


# --------------------------------------------------------------------------------------------------- FLOPs, bytes
def step_flops(s: dict) -> dict:
    """FLOPs of one training step by part (module docstring)."""
    block = bench.block_flops(**{k: s[k] for k in bench.SIZES["full"]})
    shapes = bench.proj_shapes(s)
    n, L, vh = s["batch"] * s["seq"], s["layers"], s["vocab"] * s["hidden"]
    skip = sum(2.0 * n * o * i + 2.0 * n * s["r"] * i for p, (o, i) in shapes.items()
               if p in ("q_proj", "k_proj", "v_proj"))
    parts = {"blocks": L * block["total"], "first_layer_qkv_dx_not_needed": -skip, "head_fwd": 2.0 * n * vh,
             "head_bwd_dx": 2.0 * n * vh}
    parts["total"] = sum(parts.values())
    parts["recompute_fwd_custom_vjp"] = L * block["recompute_fwd_custom_vjp"]
    return parts


def step_bytes(s: dict) -> float:
    """Bytes any implementation must move: every bf16 weight (projections, head) read in the forward and again in
    the backward, and the ``[N, V]`` logits written (bf16), read for the loss, their gradient written and read."""
    p = sum(o * i for o, i in bench.proj_shapes(s).values())
    return 2.0 * (2 * (s["layers"] * p + s["vocab"] * s["hidden"]) + 4 * s["batch"] * s["seq"] * s["vocab"])


def floor_lines(sizes: str) -> list[str]:
    s = SIZES[sizes]
    f = step_flops(s)
    n = s["batch"] * s["seq"]
    at = lambda rate: f["total"] / rate * 1e3  # noqa: E731
    return [f"lora_model: one training step (fwd, LoRA grads, AdamW), bf16 base, fp32 adapters, {bm._fmt_sizes(s)}, "
            f"LoRA r={s['r']} alpha={LORA_ALPHA:g} on all 7 projections; {n} tokens per step",
            f"FLOPs = {f['total']:.4g} = {s['layers']} blocks {f['blocks']:.4g} (lora suite's block fwd+bwd each) - "
            f"first layer's unneeded q/k/v dX {-f['first_layer_qkv_dx_not_needed']:.4g} + head fwd "
            f"{f['head_fwd']:.4g} + head bwd (dX only) {f['head_bwd_dx']:.4g} (custom VJP recomputes the blocks' "
            f"forward: +{f['recompute_fwd_custom_vjp']:.4g}, not in the floor)",
            f"floor at 989 TFLOP/s (data-sheet dense bf16, H100 SXM / H200): {at(989e12):.4g} ms = "
            f"{n / at(989e12) * 1e3:,.0f} tokens/s at most; at 790 TFLOP/s: {at(790e12):.4g} ms = "
            f"{n / at(790e12) * 1e3:,.0f} tokens/s",
            "each variant runs in a fresh process; tokens/s = batch*seq / median step; peak = device high-water mark "
            "since that process started, weights included (JAX peak_bytes_in_use, torch max_memory_allocated)"]


# ------------------------------------------------------------------------------------------------------ the inputs
def host_weights(s: dict, seed: int = 0):
    """Yield ``(path, float32 array)`` for every weight, HF layout: ``("embed_tokens",)``, ``("layers", i, group,
    proj)``, ``("layers", i, norm)``, ``("norm",)``, ``("lm_head",)``, ``("lora", i, group, proj, "lora_A"|"lora_B")``
    (module docstring's distributions). One array at a time: the full model is 1.3 GB in float32."""
    rng = np.random.default_rng(seed)
    h, v = s["hidden"], s["vocab"]
    yield ("embed_tokens",), rng.standard_normal((v, h), np.float32)
    for i in range(s["layers"]):
        for p, (o, k) in bench.proj_shapes(s).items():
            yield ("layers", i, bench.GROUP[p], p), rng.standard_normal((o, k), np.float32) / np.float32(np.sqrt(k))
            yield ("lora", i, bench.GROUP[p], p, "lora_A"), \
                rng.uniform(-1, 1, (s["r"], k)).astype(np.float32) / np.float32(np.sqrt(k))
            yield ("lora", i, bench.GROUP[p], p, "lora_B"), \
                rng.uniform(-1, 1, (o, s["r"])).astype(np.float32) / np.float32(np.sqrt(s["r"]))
        for n in ("input_layernorm", "post_attention_layernorm"):
            yield ("layers", i, n), np.ones(h, np.float32)
    yield ("norm",), np.ones(h, np.float32)
    yield ("lm_head",), rng.standard_normal((v, h), np.float32) / np.float32(np.sqrt(h))


def host_tokens(s: dict, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)


def jax_model_inputs(s: dict, base_dtype, lora_dtype, seed: int = 0):
    """``(params, lora)`` for :func:`jaxgrad.lora.model.apply`, on the default device (cast on the host)."""
    import jax

    params: dict = {"layers": [{"self_attn": {}, "mlp": {}} for _ in range(s["layers"])]}
    lora: dict = {"layers": [{"self_attn": {}, "mlp": {}} for _ in range(s["layers"])]}
    for path, a in host_weights(s, seed):
        if path[0] == "lora":
            _, i, g, p, f = path
            lora["layers"][i][g].setdefault(p, {})[f] = jax.device_put(a.astype(lora_dtype))
        elif path[0] == "layers":
            node = params["layers"][path[1]]
            node = node[path[2]].setdefault(path[3], {}) if len(path) == 4 else node.setdefault(path[2], {})
            node["weight"] = jax.device_put(a.astype(base_dtype))
        else:
            params[path[0]] = {"weight": jax.device_put(a.astype(base_dtype))}
    return params, lora


def configs(s: dict):
    from jaxgrad.lora.config import LlamaConfig, LoraConfig

    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rope_theta=ROPE_THETA,
                      max_position_embeddings=s["seq"], vocab_size=s["vocab"], rms_norm_eps=RMS_EPS,
                      num_hidden_layers=s["layers"], tie_word_embeddings=False)
    lcfg = LoraConfig(r=s["r"], lora_alpha=LORA_ALPHA, target_modules="all-linear", init_lora_weights=False)
    return cfg, lcfg


# ---------------------------------------------------------------------------------------------------- the JAX step
def adamw():
    import optax

    return optax.adamw(ADAMW["lr"], b1=ADAMW["b1"], b2=ADAMW["b2"], eps=ADAMW["eps"],
                       weight_decay=ADAMW["weight_decay"])


def make_train_step(cfg, lcfg, optimizer, *, backend: str, attention: str):
    """``train_step(lora, opt_state, params, input_ids, labels, n_items) -> (lora, opt_state, loss)``: the loss and
    the adapters' gradient (:func:`jaxgrad.lora.model.loss_fn`, mean over the ``n_items`` shifted labels), then one
    optimiser update of the adapters. Pure; jit it."""
    import jax
    import optax

    from jaxgrad.lora.model import _loss_fn  # loss_fn, whose attention may be "sdpa:xla"

    def train_step(lora, opt_state, params, input_ids, labels, n_items):
        loss, grads = jax.value_and_grad(_loss_fn)(lora, params, input_ids, labels, n_items, cfg, lcfg,
                                                  backend=backend, attention=attention)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return train_step


def _row(name: str, s: dict, precision: str) -> bm.Row:
    return bm.Row(suite=SUITE, variant=name, sizes=dict(s), dtype="bf16", precision=precision,
                  flops=step_flops(s)["total"], bytes_moved=step_bytes(s))


def _finish(row: bm.Row, s: dict, losses, extra: list[str], device_kind=None) -> bm.Row:
    """Floor, achieved fraction, tokens/s and the notes."""
    floor = bm.floor_ms(row.flops, row.bytes_moved, device_kind=device_kind, dtype="bf16", precision="tf32")
    row.floor_ms, row.floor_bound, row.floor_table_row = floor["floor_ms"], floor["bound"], floor["table_row"]
    if row.floor_ms is not None and row.median_ms:
        row.achieved_fraction = row.floor_ms / row.median_ms
    tps = tokens_per_s(s, row.median_ms)
    row.notes = "; ".join([f"tokens/s={tps:.6g}", *extra, "losses of steps 1-3: "
                           + ", ".join(f"{v:.6g}" for v in losses)])
    return row


def tokens_per_s(s: dict, median_ms: float) -> float:
    return s["batch"] * s["seq"] / (median_ms * 1e-3)


def run_jax_variant(name: str, sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """Measure one JAX variant in this process (call it in a fresh process: the peak is process-wide)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from jaxgrad.lora.model import count_items

    s = SIZES[sizes]
    backend, attention = jax_spec(name)
    cfg, lcfg = configs(s)
    params, lora = jax_model_inputs(s, ml_dtypes.bfloat16, np.float32)
    ids_host = host_tokens(s)
    ids = jax.device_put(ids_host)
    n_items = jnp.asarray(count_items(ids_host), jnp.int32)
    opt = adamw()
    opt_state = opt.init(lora)
    step = make_train_step(cfg, lcfg, opt, backend=backend, attention=attention)
    row = _row(name, s, precision)
    args = (lora, opt_state, params, ids, ids, n_items)
    compiled, peak_compile = harness.compile_and_time(row, step, args, warmup=warmup, repeats=repeats)
    losses, state = [], (lora, opt_state)
    for _ in range(3):  # three real steps from the initial state
        new_lora, new_opt, loss = compiled(*state, params, ids, ids, n_items)
        state = (new_lora, new_opt)
        losses.append(float(loss))
    extra = [f"fresh process; backend={backend}, attention={attention}, adapters fp32, no donation"]
    if peak_compile is not None:
        extra.append(f"peak after compile {peak_compile / 2**20:.1f} MiB")
    return _finish(row, s, losses, extra)


# -------------------------------------------------------------------------------------------------- torch variant
def _hf_config(transformers, s: dict):
    kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
              num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
              head_dim=s["head_dim"], rms_norm_eps=RMS_EPS, max_position_embeddings=s["seq"],
              tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
              attention_dropout=0.0, use_cache=False)
    return peers.sdpa_llama_config(transformers, ROPE_THETA, **kw)


def run_torch_variant(sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """transformers ``LlamaForCausalLM`` + ``peft.get_peft_model`` + fused AdamW, bf16 base, SDPA (CUDA only)."""
    s = SIZES[sizes]
    row = _row(TORCH_VARIANT, s, precision)
    why = peers.cuda_unavailable(peers.torch_missing())
    if why:
        row.notes = why
        return row
    import peft
    import torch
    import transformers

    dev = "cuda"
    cfg = _hf_config(transformers, s)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: no fp32 copy ever there (the peak)
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    lora_host = {}
    with torch.no_grad():
        for path, a in host_weights(s):
            t = torch.from_numpy(a)
            if path[0] == "lora":
                lora_host[path[1:]] = t
                continue
            name = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                    "lm_head": "lm_head.weight"}.get(path[0]) or \
                "model." + ".".join(map(str, path)) + ".weight"
            model.get_parameter(name).copy_(t.to(torch.bfloat16))  # cast on the host, RNE like ml_dtypes
    lcfg = peft.LoraConfig(r=s["r"], lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(bench.PROJ),
                           bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lcfg, autocast_adapter_dtype=True)  # PEFT's default, said explicitly
    lora_params, scalings = [], set()
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            short = mod_name.split(".")[-1]
            if short in bench.PROJ and hasattr(mod, "lora_A"):
                i = int(mod_name.split("layers.")[1].split(".")[0])
                for f, holder in (("lora_A", mod.lora_A), ("lora_B", mod.lora_B)):
                    w = holder["default"].weight
                    w.copy_(lora_host[(i, bench.GROUP[short], short, f)].to(w.dtype))
                    lora_params.append(w)
                scalings.add(float(mod.scaling["default"]))
    lora_dtypes = {str(p.dtype) for p in lora_params}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len(lora_params) != 14 * s["layers"] or scalings != {LORA_ALPHA / s["r"]} or \
            lora_dtypes != {"torch.float32"} or len(trainable) != len(lora_params):
        raise RuntimeError(f"PEFT: {len(lora_params)} LoRA factors, scalings {scalings}, dtypes {lora_dtypes}, "
                           f"{len(trainable)} trainable tensors")
    model.train()
    try:
        opt = torch.optim.AdamW(lora_params, lr=ADAMW["lr"], betas=(ADAMW["b1"], ADAMW["b2"]), eps=ADAMW["eps"],
                                weight_decay=ADAMW["weight_decay"], fused=True)
        fused = "fused"
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(lora_params, lr=ADAMW["lr"], betas=(ADAMW["b1"], ADAMW["b2"]), eps=ADAMW["eps"],
                                weight_decay=ADAMW["weight_decay"])
        fused = "default (fused unavailable)"
    ids = torch.from_numpy(host_tokens(s)).to(torch.long).to(dev)
    losses = []

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if len(losses) < 3:
            losses.append(out.loss.detach())

    peers.time_torch(step, row, warmup=max(warmup, 2), repeats=repeats)  # the first 3 calls give the 3 losses
    extra = [f"fresh process; torch {torch.__version__}, transformers {transformers.__version__}, peft "
             f"{peft.__version__}, attn sdpa, adapters fp32, AdamW {fused}, first call {row.compile_ms:.0f} ms"]
    return _finish(row, s, [float(v) for v in losses], extra, device_kind=torch.cuda.get_device_name())


# ----------------------------------------------------------------------------------------------------- the suite
def suite_lora_model(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants=None,
                     timeout: float = 300.0, budget_s: float | None = None,
                     say=print) -> tuple[list[bm.Row], list[str]]:
    """Every variant in its own process (:func:`jaxgrad.bench.fresh_process.run_fresh_suite`). Returns ``(rows,
    notes)``: the FLOP / floor lines and, after the run, one ``tokens/s`` line per variant that ran."""
    import jax

    if sizes not in SIZES:
        raise ValueError(f"{SUITE} bench: --sizes must be one of {sorted(SIZES)}, got {sizes!r}")
    names = harness.select_variants(variant_names(jax.default_backend() == "gpu"), variants, SUITE,
                                    variant_names(True))
    notes = floor_lines(sizes)
    for line in notes:
        say(f"# {line}")
    rows = harness.run_fresh_suite(names, sizes, precision, repeats=repeats, warmup=warmup, timeout=timeout,
                                   budget_s=budget_s, say=say, module=MODULE, suite=SUITE, size_table=SIZES,
                                   skip_reason=lambda n: peers.torch_missing() if n == TORCH_VARIANT else None)
    for r in rows:
        if r.median_ms is not None:
            notes.append(f"{r.variant}: {tokens_per_s(SIZES[sizes], r.median_ms):,.0f} tokens/s "
                         f"({r.median_ms:.3f} ms/step), peak "
                         + ("-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f} MiB"))
    return rows, notes


if __name__ == "__main__":
    sys.exit(harness.child_main(sys.argv[1:], sizes=SIZES, run_torch={TORCH_VARIANT: run_torch_variant},
                                run_jax=run_jax_variant,
                                description="one lora_model benchmark variant (python -m jaxgrad.bench lora_model)"))
