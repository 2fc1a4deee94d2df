r"""The ``lm_head`` benchmark suite (issue #29 item 1): forward and backward of the LM head and its causal
cross-entropy at the real shape, the fused chunked loss against the plain logits and PyTorch's two ways; each variant
in a fresh process (:mod:`jaxgrad.bench.fresh_process`), so that its peak device memory is its own.

    python -m jaxgrad.bench lm_head [--sizes small|full] [--repeats N] [--warmup N] [--variants SUBSTR,...]
                                    [--budget-s S]

The computation: ``h [batch, seq, hidden]`` (the final-normed hidden states), ``W [vocab, hidden]`` (the head, or
the tied embedding), ``labels [batch, seq]`` with HF's shift; the summed token loss and its gradient w.r.t. ``h``
(``dh``: what flows back into the model), and w.r.t. ``W`` only for the head-gradient variants (``dh+dW``:
full fine-tuning or a trained tied embedding; LoRA freezes the head, so without it XLA drops ``dW`` and torch's
autograd never forms it). Shapes (``full``; ``small`` is a CPU-sized stand-in of each, for the tests):

* ``1B``: Llama-3.2-1B's head: hidden 2048, vocab 128,256, tied (the embedding is the head: the same product);
* ``8B``: Llama-3.1-8B's head: hidden 4096, vocab 128,256, untied;

both at micro-batch 2 x seq 4096 = 8192 tokens (NeMo's run), bf16 operands; every label is a real token, so
``batch * (seq - 1)`` targets count.

Variants (named ``<model> <implementation> <dtype> <gradients>``):

* ``jaxgrad fused ct=C cv=V``: :func:`jaxgrad.ops.lm_head_loss.lm_head_loss` at ``chunk_tokens=C`` and
  ``chunk_vocab=V`` (``all``: ``None``, one ``[C, vocab]`` logits block per step): never holds ``[tokens, vocab]``.
  ``dh`` rows: the frozen head's form (``head_grad=False``, LoRA's), ``dh`` formed in the forward from the chunk's
  own logits (with vocabulary chunks the logits are formed twice, ``+2 N V H``); ``dh+dW`` rows: the backward
  recomputes each chunk's logits (``+2 N V H``, not in the floor);
* ``jaxgrad fused recompute ct=C cv=V`` (``dh`` rows, the default chunking): the head-gradient path differentiated
  in ``h`` only: what the frozen head costs without ``head_grad=False``;
* ``jax.grad plain``: the model's plain path (:func:`jaxgrad.lora.model.apply`'s head einsum, bf16 logits with fp32
  accumulation, then :func:`jaxgrad.lora.model.token_losses`' fp32 log-softmax), differentiated by ``jax.grad``;
* ``torch F.linear+F.cross_entropy``: what HF's ``LlamaForCausalLM`` does: ``F.linear`` under bf16 autocast, the
  logits upcast to fp32 (``logits.float()``), ``F.cross_entropy(ignore_index=-100, reduction="sum")`` on the
  shifted labels, ``torch.autograd.grad``;
* ``products only ct=C`` (``dh`` rows, the default chunking): the frozen head's two products per token chunk as the
  fused loss forms them (``Z = h_c W^T`` accumulated in fp32, rounded to the operands' dtype, ``Z W`` accumulated in
  fp32) with no softmax, log-sum-exp or target in between: what XLA's library matmuls alone take at the fused
  loss's shapes. ``jaxgrad fused`` minus this row is the elementwise work a kernel fusing the softmax into the
  matmuls could remove at most (the products themselves it could only match cuBLAS on); not a loss;
* ``jaxgrad fused mosaic ct=C`` (``dh`` rows, bf16): the fused frozen head on ``backend="mosaic"``, the logits'
  Mosaic GPU kernel writing ``exp(Z - m_tile)`` and each vocabulary tile's maximum and sum in its epilogue
  (:mod:`jaxgrad.ops.lm_head_loss_mgpu`); a skipped row, with the reason, off a Hopper GPU;
* ``torch liger FLCE``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="sum")`` (its gradient computed
  chunk by chunk during the forward), where ``liger_kernel`` imports; otherwise its row says why it was skipped.

bf16 rows run by default; ``f32`` rows (the fused loss at its default chunking, the plain one and torch's, TF32 dots
on an NVIDIA GPU, true f32 with ``--precision highest``) only when ``--variants`` selects them (e.g.
``--variants f32``), so that a default run's file is named ``bf16``. :func:`suite_lm_head`'s ``head_grad`` picks
the ``dh+dW`` set instead of the ``dh`` one.

Inputs: ``h ~ N(0, 1)``, ``W ~ N(0, 1/hidden)`` (logits of unit scale), labels uniform in the vocabulary, drawn on
the device in the operands' dtype (block by block, so that the draw's temporaries stay below the step's). JAX rows
share their inputs (their losses agree to the bf16 rounding of the plain logits); torch draws its own with the same
distributions, so its loss per token agrees with JAX's only statistically (about ``log(vocab) + 0.5`` each, to
~1e-3): a check that the peer computes the same function.

Timing and memory (per variant, in its own process): JAX: the compiled step timed by
:func:`jaxgrad.bench.harness.time_fn` (median of ``repeats`` calls after ``warmup``); torch:
:func:`jaxgrad.bench.peers.time_torch`. **Peak memory**: the device's high-water mark since that process started,
inputs and gradients included (JAX ``peak_bytes_in_use``, torch ``max_memory_allocated``); where the device has no
allocator statistics (a CPU) the JAX rows' memory is the compiled executable's ``argument + output + temp`` bytes
(``compiled_bytes``, XLA's buffer assignment of that step).

Floor (:func:`head_flops`): ``N = batch * seq`` rows, the products ``2 N V H`` each: the logits ``Z = h W^T``, ``dh =
dZ W``, and ``dW = dZ^T h`` with the head's gradient; at the bf16 dense peak (989 TFLOP/s on an H100 SXM or H200)
this is the time at 100 % of the tensor cores: 8.70 ms (1B) and 17.41 ms (8B) for ``dh``, 13.06 and 26.11 ms with
``dW``. The softmax and the loss (elementwise) are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import sys

from jaxgrad.bench import fresh_process
from jaxgrad.bench import harness as bm
from jaxgrad.bench import peers
from jaxgrad.bench.roofline import PEAKS

__all__ = ["SHAPES", "SUITE", "Variant", "head_flops", "suite_lm_head", "variant", "variant_names"]

SUITE = "lm_head"
MODULE = "jaxgrad.bench.lm_head"
IGNORE_INDEX = -100
#: ``sizes -> model -> shape``: the two real heads, and CPU-sized stand-ins of them
SHAPES: dict[str, dict[str, dict]] = {
    "full": {"1B": dict(batch=2, seq=4096, hidden=2048, vocab=128256, tied=True),
             "8B": dict(batch=2, seq=4096, hidden=4096, vocab=128256, tied=False)},
    "small": {"1B": dict(batch=2, seq=64, hidden=32, vocab=1024, tied=True),
              "8B": dict(batch=2, seq=64, hidden=64, vocab=1024, tied=False)},
}
#: the fused loss's chunkings: token rows per chunk, vocabulary rows per inner chunk (``None``: all); the first is
#: the library's default at ``full`` (:data:`jaxgrad.ops.lm_head_loss.DEFAULT_CHUNK_TOKENS`), the one the f32 rows use
CHUNKS: dict[str, dict[str, tuple]] = {
    "full": dict(tokens=(1024, 512, 2048), vocab=(None, 32768)),
    "small": dict(tokens=(16, 8, 32), vocab=(None, 256)),
}
FUSED, PLAIN, TORCH, LIGER = "jaxgrad fused", "jax.grad plain", "torch F.linear+F.cross_entropy", "torch liger FLCE"
#: the fused loss with the head's gradient path (its backward recomputes the logits), timed for ``dh`` only: what a
#: frozen head costs without ``head_grad=False``
FUSED_RECOMPUTE = "jaxgrad fused recompute"
#: the fused frozen head's two products alone (no softmax): the library-matmul part of ``FUSED``'s time
PRODUCTS = "products only"
#: the fused frozen head on ``backend="mosaic"``: the logits' Mosaic GPU kernel with the softmax's tile statistics in
#: its epilogue (:mod:`jaxgrad.ops.lm_head_loss_mgpu`); bf16, Hopper only (a skipped row elsewhere)
FUSED_MOSAIC = "jaxgrad fused mosaic"
H100_BF16, H100_TF32 = PEAKS["H100 SXM"].bf16_flops, PEAKS["H100 SXM"].tf32_flops


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the suite: which head, which implementation, dtype, gradients and (fused) chunking."""

    model: str
    impl: str
    dtype: str = "bf16"
    head_grad: bool = False
    chunk_tokens: int | None = None
    chunk_vocab: int | None = None

    @property
    def name(self) -> str:
        chunking = (f" ct={self.chunk_tokens} cv={self.chunk_vocab or 'all'}" if self.impl in (FUSED, FUSED_RECOMPUTE)
                    else f" ct={self.chunk_tokens}" if self.impl in (PRODUCTS, FUSED_MOSAIC) else "")
        return f"{self.model} {self.impl}{chunking} {self.dtype} {'dh+dW' if self.head_grad else 'dh'}"

    @property
    def is_torch(self) -> bool:
        return self.impl in (TORCH, LIGER)


def _variants(sizes: str, head_grad: bool, dtype: str) -> list[Variant]:
    """The variants of one dtype in run order: per model, the fused loss at its default chunking, the plain loss,
    the torch peers, the fused loss through its head-gradient path and its products alone (``dh`` rows), then the
    other chunkings (a spent ``--budget-s`` cuts the tail)."""
    chunks = CHUNKS[sizes]
    out = []
    for model in SHAPES[sizes]:
        fused = [Variant(model, FUSED, dtype, head_grad, ct, cv) for ct in chunks["tokens"] for cv in chunks["vocab"]]
        if dtype == "bf16":
            recompute = [] if head_grad else [Variant(model, FUSED_RECOMPUTE, dtype, False, *chunks["tokens"][:1],
                                                      chunks["vocab"][0]),
                                              Variant(model, PRODUCTS, dtype, False, chunks["tokens"][0]),
                                              Variant(model, FUSED_MOSAIC, dtype, False, chunks["tokens"][0])]
            out += [fused[0], Variant(model, PLAIN, dtype, head_grad), Variant(model, TORCH, dtype, head_grad),
                    Variant(model, LIGER, dtype, head_grad), *recompute, *fused[1:]]
        else:  # f32: the default chunking against the two plain losses
            out += [fused[0], Variant(model, PLAIN, dtype, head_grad), Variant(model, TORCH, dtype, head_grad)]
    return out


def variant_names(sizes: str, head_grad: bool = False, dtypes=("bf16",)) -> list[str]:
    """The names of the ``dtypes`` variants at ``sizes`` with (``head_grad``) or without the head's gradient."""
    return [v.name for d in dtypes for v in _variants(sizes, head_grad, d)]


def variant(name: str, sizes: str) -> Variant:
    """The :class:`Variant` named ``name`` at ``sizes`` (any dtype, either gradient set)."""
    for head_grad in (False, True):
        for dtype in ("bf16", "f32"):
            for v in _variants(sizes, head_grad, dtype):
                if v.name == name:
                    return v
    raise ValueError(f"{SUITE} bench: unknown variant {name!r} at --sizes {sizes}; known: "
                     f"{variant_names(sizes, False, ('bf16', 'f32')) + variant_names(sizes, True, ('bf16', 'f32'))}")


# --------------------------------------------------------------------------------------------------- FLOPs, bytes
def head_flops(s: dict, head_grad: bool) -> float:
    """``2 N V H`` per product: the logits and ``dh``, and ``dW`` with the head's gradient (``N = batch * seq``)."""
    return (3 if head_grad else 2) * 2.0 * s["batch"] * s["seq"] * s["vocab"] * s["hidden"]


def head_bytes(s: dict, head_grad: bool, itemsize: int) -> float:
    """Bytes any implementation must move: ``h`` and ``W`` read, ``dh`` written (and ``dW`` written)."""
    n, vh = s["batch"] * s["seq"], s["vocab"] * s["hidden"]
    return float(itemsize * (2 * n * s["hidden"] + vh + (vh if head_grad else 0)))


def floor_lines(sizes: str, head_grad: bool) -> list[str]:
    grads = "dh and dW" if head_grad else "dh (the head frozen: no dW)"
    lines = [f"lm_head: forward + backward of the LM head and its causal cross-entropy (summed), gradient {grads}; "
             "peak = device high-water mark since the variant's own process started, inputs and gradients included "
             "(JAX peak_bytes_in_use, torch max_memory_allocated); without allocator statistics (CPU) the JAX rows' "
             "memory is the compiled step's argument + output + temp bytes"]
    for model, s in SHAPES[sizes].items():
        f = head_flops(s, head_grad)
        lines.append(f"{model}: tokens {s['batch']}x{s['seq']}, hidden {s['hidden']}, vocab {s['vocab']}"
                     f"{', tied' if s['tied'] else ', untied'}: FLOPs = {3 if head_grad else 2} x 2NVH = {f:.4g}; "
                     f"floor at 100% of the bf16 tensor cores (989 TFLOP/s, H100 SXM / H200 dense): "
                     f"{f / H100_BF16 * 1e3:.4g} ms (f32 rows at TF32's {H100_TF32 / 1e12:.1f} TFLOP/s: "
                     f"{f / H100_TF32 * 1e3:.4g} ms); fp32 logits and their gradient would be "
                     f"{2 * 4 * s['batch'] * s['seq'] * s['vocab'] / 2**30:.3g} GiB")
    return lines


def _row(v: Variant, sizes: str, precision: str) -> bm.Row:
    s = SHAPES[sizes][v.model]
    row = bm.Row(suite=SUITE, variant=v.name, sizes=dict(s, head_grad=v.head_grad), dtype=v.dtype,
                 precision=precision, flops=head_flops(s, v.head_grad),
                 bytes_moved=head_bytes(s, v.head_grad, 2 if v.dtype == "bf16" else 4))
    if v.impl in (FUSED, FUSED_RECOMPUTE):
        row.sizes.update(chunk_tokens=v.chunk_tokens, chunk_vocab=v.chunk_vocab)
    elif v.impl in (PRODUCTS, FUSED_MOSAIC):
        row.sizes.update(chunk_tokens=v.chunk_tokens)
    return row


def _finish(row: bm.Row, loss_per_token: float, extra: list[str], device_kind=None) -> bm.Row:
    """Floor, achieved fraction and the notes (the mean loss per counted token first)."""
    floor = bm.floor_ms(row.flops, row.bytes_moved, device_kind=device_kind, dtype=row.dtype,
                        precision="highest" if row.precision == "highest" else "tf32")
    row.floor_ms, row.floor_bound, row.floor_table_row = floor["floor_ms"], floor["bound"], floor["table_row"]
    if row.floor_ms is not None and row.median_ms:
        row.achieved_fraction = row.floor_ms / row.median_ms
    row.notes = "; ".join([f"loss/token={loss_per_token:.6g}", *extra])
    return row


# ---------------------------------------------------------------------------------------------------- the JAX side
def _normal_rows(key, shape: tuple, dtype, scale: float, block_rows: int = 4096):
    """``scale * N(0, 1)`` of ``shape`` in ``dtype``, drawn ``block_rows`` rows at a time into one buffer, so that the
    draw's temporaries (the random bits, ~8 bytes per element) are one block's, not the whole array's."""
    import jax
    import jax.numpy as jnp

    rows, rest = shape[0], tuple(shape[1:])
    block = min(block_rows, rows)
    count = -(-rows // block)

    @jax.jit
    def draw(key):
        def body(i, out):
            start = jnp.minimum(i * block, rows - block)  # the last block ends at the last row
            x = jax.random.normal(jax.random.fold_in(key, i), (block, *rest), dtype) * jnp.asarray(scale, dtype)
            return jax.lax.dynamic_update_slice_in_dim(out, x, start, axis=0)

        return jax.lax.fori_loop(0, count, body, jnp.zeros(shape, dtype))

    return draw(key)


def jax_inputs(s: dict, dtype: str, seed: int = 0):
    """``(h [batch, seq, hidden], W [vocab, hidden], labels [batch, seq])`` on the default device."""
    import jax
    import jax.numpy as jnp

    dt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]
    kh, kw, kl = jax.random.split(jax.random.key(seed), 3)
    b, t, hidden, vocab = s["batch"], s["seq"], s["hidden"], s["vocab"]
    h = _normal_rows(kh, (b * t, hidden), dt, 1.0).reshape(b, t, hidden)
    w = _normal_rows(kw, (vocab, hidden), dt, hidden ** -0.5)
    labels = jax.random.randint(kl, (b, t), 0, vocab, jnp.int32)
    return h, w, labels


def plain_loss(h, w, labels):
    """The model's plain head and loss, summed: :func:`jaxgrad.lora.model.apply`'s head einsum (logits rounded to
    the activations' dtype) and :func:`jaxgrad.lora.model.token_losses` (fp32 log-softmax)."""
    import jax.numpy as jnp

    from jaxgrad.lora.model import token_losses

    logits = jnp.einsum("bth,vh->btv", h, w, preferred_element_type=jnp.promote_types(h.dtype, jnp.float32))
    return jnp.sum(token_losses(logits.astype(h.dtype), labels, IGNORE_INDEX)[0])


def products_step(chunk_tokens: int):
    """``step(h, w, labels) -> (sum(dh), dh)``: per ``chunk_tokens`` rows, ``Z = h_c W^T`` (fp32 accumulation, rounded
    to ``h``'s dtype) and ``dh_c = Z W`` (fp32 accumulation), as :func:`jaxgrad.ops.lm_head_loss.lm_head_loss`'s
    frozen head forms them, without the softmax between (``chunk_tokens`` divides the token rows)."""
    import jax
    import jax.numpy as jnp

    def step(h, w, labels):
        del labels
        h2 = h.reshape(-1, h.shape[-1])
        n, ct = h2.shape[0], min(chunk_tokens, h2.shape[0])
        if n % ct:
            raise ValueError(f"{SUITE} bench: products only: chunk_tokens = {chunk_tokens} must divide the "
                             f"{n} token rows")
        acc = jnp.promote_types(h.dtype, jnp.float32)

        def chunk(i):
            hc = jax.lax.dynamic_slice_in_dim(h2, i * ct, ct, axis=0)
            z = jnp.einsum("ch,vh->cv", hc, w, preferred_element_type=acc).astype(h.dtype)
            return jnp.einsum("cv,vh->ch", z, w, preferred_element_type=acc)

        dh = jax.lax.map(chunk, jnp.arange(n // ct)).reshape(n, h.shape[-1])
        return jnp.sum(dh), dh.astype(h.dtype).reshape(h.shape)

    return step


def jax_step(v: Variant):
    """``step(h, w, labels) -> (loss, dh)`` or ``(loss, (dh, dW))`` with the head's gradient: ``jax.value_and_grad``
    of the variant's summed loss (:func:`products_step` for the products-only row)."""
    import jax

    if v.impl == PRODUCTS:
        return products_step(v.chunk_tokens)

    from jaxgrad.ops.lm_head_loss import lm_head_loss

    if v.impl in (FUSED, FUSED_RECOMPUTE, FUSED_MOSAIC):
        # FUSED for dh: the frozen head's form (dh made in the forward); FUSED_RECOMPUTE: the head-gradient path,
        # differentiated in h only (XLA drops the dW product); FUSED_MOSAIC: FUSED on the Mosaic kernel
        head_grad = v.head_grad or v.impl == FUSED_RECOMPUTE
        backend = "mosaic" if v.impl == FUSED_MOSAIC else "xla"

        def loss(h, w, labels):
            return lm_head_loss(h, w, labels, ignore_index=IGNORE_INDEX, chunk_tokens=v.chunk_tokens,
                                chunk_vocab=v.chunk_vocab, head_grad=head_grad, backend=backend)[0]
    elif v.impl == PLAIN:
        loss = plain_loss
    else:
        raise ValueError(f"{SUITE} bench: {v.name!r} is not a JAX variant")
    return jax.value_and_grad(loss, argnums=(0, 1) if v.head_grad else 0)


def run_jax_variant(name: str, sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """Measure one JAX variant in this process (call it in a fresh process: the peak is process-wide)."""
    v = variant(name, sizes)
    s = SHAPES[sizes][v.model]
    row = _row(v, sizes, precision)
    if v.impl == FUSED_MOSAIC:
        why = mosaic_unavailable()
        if why:
            row.notes = why
            return row
    args = jax_inputs(s, v.dtype)
    compiled, peak_compile = fresh_process.compile_and_time(row, jax_step(v), args, warmup=warmup, repeats=repeats)
    loss = float(compiled(*args)[0])
    if v.impl == PRODUCTS:
        loss = float("nan")  # not a loss: the products alone
    extra = ["fresh process", "memory: " + ("device peak" if row.peak_bytes is not None
                                            else "compiled argument + output + temp (no device allocator stats)")]
    if v.impl == PRODUCTS:
        extra.append("the frozen head's two products per chunk, no softmax: the library-matmul part of the fused "
                     "row at this chunking (no loss)")
    elif v.impl == FUSED_RECOMPUTE or (v.impl == FUSED and v.head_grad):
        extra.append("recomputes the logits in the backward (+2NVH, not in the floor)")
    elif v.impl == FUSED_MOSAIC:
        extra.append("head frozen (head_grad=False), backend='mosaic': the logits' Mosaic GPU kernel writes "
                     "exp(Z - m_tile) and per-tile (max, sum) instead of Z")
    elif v.impl == FUSED:
        extra.append("head frozen (head_grad=False): dh formed in the forward from its logits" +
                     (" (two vocabulary passes: the logits formed twice, +2NVH)" if v.chunk_vocab else ""))
    if peak_compile is not None:
        extra.append(f"peak after compile {peak_compile / 2**20:.1f} MiB")
    return _finish(row, loss / (s["batch"] * (s["seq"] - 1)), extra)


def mosaic_unavailable() -> str | None:
    """Why the Mosaic row cannot run in this process (``None`` on a Hopper GPU)."""
    import jax

    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if dev.platform != "gpu" or not cc.startswith("9"):
        return f"skipped: Mosaic GPU's wgmma needs a Hopper GPU (compute capability 9.x), got {dev.device_kind}"
    return None


# -------------------------------------------------------------------------------------------------- the torch side
def torch_missing(impl: str) -> str | None:
    """Why a torch variant cannot run here, as far as installed packages go (``None`` if it may)."""
    return peers.missing_modules(("torch", *(("liger_kernel",) if impl == LIGER else ())))


def run_torch_variant(name: str, sizes: str, *, repeats: int, warmup: int, precision: str = "default") -> bm.Row:
    """HF's plain head and loss, or Liger's fused linear cross-entropy, on CUDA (a skipped row elsewhere)."""
    v = variant(name, sizes)
    s = SHAPES[sizes][v.model]
    row = _row(v, sizes, precision)
    why = peers.cuda_unavailable(torch_missing(v.impl))
    if why:
        row.notes = why
        return row
    import torch
    import torch.nn.functional as F

    flce, versions = None, f"torch {torch.__version__}"
    if v.impl == LIGER:
        try:
            import liger_kernel
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except Exception as e:  # noqa: BLE001 - an unimportable peer is a skipped row, never a failed suite
            row.notes = f"skipped: liger_kernel does not import: {type(e).__name__}: {e}"[:300]
            return row
        flce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
        versions += f", liger_kernel {getattr(liger_kernel, '__version__', None) or _dist_version('liger-kernel')}"
    torch.backends.cuda.matmul.allow_tf32 = precision != "highest"  # f32 rows: TF32 as XLA's default
    dev, tdt = "cuda", {"bf16": torch.bfloat16, "f32": torch.float32}[v.dtype]
    b, t, hidden, vocab = s["batch"], s["seq"], s["hidden"], s["vocab"]
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn((b, t, hidden), device=dev, dtype=tdt, generator=gen).requires_grad_(True)
    w = torch.randn((vocab, hidden), device=dev, dtype=tdt, generator=gen)
    w.mul_(hidden ** -0.5)
    w.requires_grad_(v.head_grad)
    labels = torch.randint(0, vocab, (b, t), device=dev, generator=gen)
    # HF's shift (ForCausalLMLoss): pad the labels with ignore_index, drop the first
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1).contiguous()
    wrt = [h, w] if v.head_grad else [h]
    losses = []

    def step():
        if flce is not None:
            loss = flce(w, h.view(-1, hidden), targets)
        else:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=v.dtype == "bf16"):
                logits = F.linear(h, w)
            loss = F.cross_entropy(logits.float().view(-1, vocab), targets, ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        torch.autograd.grad(loss, wrt)
        if not losses:
            losses.append(loss.detach())

    peers.time_torch(step, row, warmup=max(warmup, 2), repeats=repeats)
    extra = ["fresh process", "memory: device peak (max_memory_allocated)", versions,
             f"first call {row.compile_ms:.0f} ms"]
    if v.dtype == "f32":
        extra.append(f"allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    return _finish(row, float(losses[0]) / (b * (t - 1)), extra, device_kind=torch.cuda.get_device_name())


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001
        return None


# ----------------------------------------------------------------------------------------------------- the suite
def memory_of_row(row: bm.Row) -> int | None:
    """The row's memory figure: the device peak, else (no allocator statistics) the compiled step's bytes."""
    return row.peak_bytes if row.peak_bytes is not None else row.compiled_bytes


def summary_lines(rows: list[bm.Row], sizes: str) -> list[str]:
    """One line per measured row: time, fraction of the floor, memory, and both against the model's plain loss
    (``jax.grad plain``) and HF's (``torch F.linear+F.cross_entropy``), where those ran."""
    by_name = {r.variant: r for r in rows}
    lines = []
    for r in rows:
        if r.median_ms is None:
            continue
        v = variant(r.variant, sizes)
        mem = memory_of_row(r)
        line = (f"{r.variant}: {r.median_ms:.3f} ms"
                + ("" if r.achieved_fraction is None else f" ({r.achieved_fraction:.0%} of the floor)")
                + (", memory -" if mem is None else
                   f", {'peak' if r.peak_bytes is not None else 'compiled'} {mem / 2**20:.1f} MiB"))
        for impl, what in ((PLAIN, "jax.grad plain's"), (TORCH, "HF's")):
            base = by_name.get(Variant(v.model, impl, v.dtype, v.head_grad).name)
            if base is None or base is r or not base.median_ms:
                continue
            line += f"; {r.median_ms / base.median_ms:.2f}x {what} time"
            base_mem = memory_of_row(base)
            if mem is not None and base_mem and (r.peak_bytes is None) == (base.peak_bytes is None):
                line += f", {mem / base_mem:.2f}x its {'peak' if r.peak_bytes is not None else 'compiled bytes'}"
        if v.impl == FUSED_MOSAIC:
            fused = by_name.get(Variant(v.model, FUSED, v.dtype, False, v.chunk_tokens, None).name)
            if fused is not None and fused.median_ms:
                line += f"; {r.median_ms / fused.median_ms:.3f}x the XLA fused loss's time at this chunking"
        if v.impl == PRODUCTS:
            fused = by_name.get(Variant(v.model, FUSED, v.dtype, False, v.chunk_tokens, None).name)
            if fused is not None and fused.median_ms:
                line += (f"; the fused loss at this chunking takes {fused.median_ms - r.median_ms:.3f} ms more "
                         f"({1 - r.median_ms / fused.median_ms:.0%} of its time: softmax, log-sum-exp, targets)")
        lines.append(line)
    return lines


def suite_lm_head(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3, variants=None,
                  budget_s: float | None = None, head_grad: bool = False, timeout: float = 300.0,
                  say=print) -> tuple[list[bm.Row], list[str]]:
    """Every variant in its own process (:func:`jaxgrad.bench.fresh_process.run_fresh_suite`). ``head_grad``: the
    ``dh+dW`` variants instead of the ``dh`` ones; ``variants`` (substrings) select among both dtypes, the default
    is the bf16 rows. Returns ``(rows, notes)``: the FLOP / floor lines and, after the run, one line per row."""
    if sizes not in SHAPES:
        raise ValueError(f"{SUITE} bench: --sizes must be one of {sorted(SHAPES)}, got {sizes!r}")
    pool = variant_names(sizes, head_grad, ("bf16", "f32") if variants else ("bf16",))
    names = fresh_process.select_variants(pool, variants, SUITE)
    notes = floor_lines(sizes, head_grad)
    for line in notes:
        say(f"# {line}")

    def skip_reason(name: str) -> str | None:
        v = variant(name, sizes)
        return torch_missing(v.impl) if v.is_torch else None

    rows = fresh_process.run_fresh_suite(names, sizes, precision, repeats=repeats, warmup=warmup, timeout=timeout,
                                         budget_s=budget_s, say=say, module=MODULE, suite=SUITE, size_table=SHAPES,
                                         skip_reason=skip_reason)
    for r in rows:  # rows made by the parent (skipped, failed) get the variant's own shape and dtype
        template = _row(variant(r.variant, sizes), sizes, precision)
        r.sizes, r.dtype = template.sizes, template.dtype
        r.flops, r.bytes_moved = template.flops, template.bytes_moved
    notes += summary_lines(rows, sizes)
    return rows, notes


if __name__ == "__main__":
    sys.exit(fresh_process.child_main(
        sys.argv[1:], sizes=SHAPES,
        run_torch={n: functools.partial(run_torch_variant, n) for sizes in SHAPES for g in (False, True)
                   for n in variant_names(sizes, g, ("bf16", "f32")) if variant(n, sizes).is_torch},
        run_jax=run_jax_variant, description="one lm_head benchmark variant (python -m jaxgrad.bench lm_head)"))
