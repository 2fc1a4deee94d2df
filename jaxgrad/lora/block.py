r"""The Llama decoder block with LoRA on any of its 7 projections: plain reference and a whole-block ``custom_vjp``.

Forward (Hugging Face ``LlamaDecoderLayer``), ``x [B, T, H]``, each projection ``P(h) = h W^T + s (drop(h) A^T)
B^T`` (LoRA only where targeted, ``W`` frozen):

.. math::

    h_1 &= \mathrm{RMSNorm}(x; w_\mathrm{in}), \quad q, k, v = P_q(h_1), P_k(h_1), P_v(h_1), \quad
    \hat q, \hat k = \mathrm{RoPE}(q), \mathrm{RoPE}(k) \\
    o &= \mathrm{Attn}_\mathrm{causal, GQA}(\hat q, \hat k, v), \qquad x_2 = x + P_o(o) \\
    h_2 &= \mathrm{RMSNorm}(x_2; w_\mathrm{post}), \quad e, u = P_\mathrm{gate}(h_2), P_\mathrm{up}(h_2), \quad
    m = \mathrm{silu}(e)\, u, \qquad y = x_2 + P_\mathrm{down}(m)

Backward (:func:`block`'s VJP, every term; :mod:`jaxgrad.ops` has each one's equations), given :math:`\bar y`:

1. residual 2: :math:`\bar x_2 \mathrel{+}= \bar y`; down: :math:`\bar m, \bar A_d, \bar B_d` (LoRA linear);
2. SwiGLU: :math:`\bar e = \bar m\, u\, \sigma(e)(1 + e(1 - \sigma(e)))`, :math:`\bar u = \bar m\, \mathrm{silu}(e)`;
3. gate and up: :math:`\bar h_2 = \bar h_2^{gate} + \bar h_2^{up}` and their A/B gradients;
4. post-attention RMSNorm: :math:`\bar x_2 \mathrel{+}= r_2(g - n_2 \overline{g n_2})`, :math:`\bar w_\mathrm{post}`;
5. o_proj: :math:`\bar o, \bar A_o, \bar B_o`; attention: :math:`\bar S = P(\bar P - D)`, :math:`\bar{\hat q},
   \bar{\hat k}, \bar v` with the GQA group sums;
6. RoPE inverse: :math:`\bar q = \bar{\hat q} \cos - \mathrm{rotate\_half}(\bar{\hat q} \sin)` (same for k);
7. q, k, v: :math:`\bar h_1` = the sum of the three, and their A/B gradients;
8. input RMSNorm: :math:`\bar x_1, \bar w_\mathrm{in}`; residual 1: :math:`\bar x = \bar x_2 + \bar x_1`.

**Grouped projections** (:mod:`jaxgrad.lora.grouped`; ``group_projections=True``, off by default: on the H100 the same
time at +459 MiB of peak memory, docs/design.md). The projections that share an input run as one GEMM each, with the
LoRA ``A`` matrices folded in as extra rows of the frozen weight (``U = h A^T``, fp32 accumulation; f64 for f64):

.. math::

    Z_1 &= h_1 [W_q; W_k; W_v; A_q; A_k; A_v]^\top = [h_1 W_q^\top | h_1 W_k^\top | h_1 W_v^\top | U_q | U_k | U_v],
    \qquad q = Z_{1,q} + s\, U_q B_q^\top \ (\text{same for } k, v) \\
    Z_2 &= h_2 [W_\mathrm{gate}; W_\mathrm{up}; A_\mathrm{gate}; A_\mathrm{up}]^\top, \qquad
    Z_o = o [W_o; A_o]^\top, \qquad Z_d = m [W_\mathrm{down}; A_\mathrm{down}]^\top

(an untargeted projection has no ``A`` rows), and in the backward, with :math:`G_P = \bar Y_P B_P` (operands in the
block's dtype, fp32 accumulation),

.. math::

    \bar h_1 = [\bar q \,|\, \bar k \,|\, \bar v \,|\, s G_q \,|\, s G_k \,|\, s G_v]\,
               [W_q; W_k; W_v; A_q; A_k; A_v], \qquad
    \bar A_P = s\, G_P^\top h, \quad \bar B_P = s\, \bar Y_P^\top U_P

(likewise :math:`\bar h_2` from gate/up, :math:`\bar o` and :math:`\bar m` from o/down with their ``A``). The sums
are the per-projection ones above (step 3's and step 7's sum of the projections' :math:`\bar h` is the GEMM's own
accumulation). Why: 4 base GEMMs in the forward instead of 7 plus 7 skinny :math:`h A^\top` ones, 4 instead of
7 + 7 (:math:`\bar Y W`, :math:`G A`) in the backward: fewer launches, each input read once per group instead of
once per projection and again for its ``U``, and the skinny GEMMs that read or write a whole ``[N, in]``
activation (:math:`h A^\top`, :math:`G A`) disappear into the base ones (they are among the 32 LoRA GEMMs, 1.07 ms
of the 7.05 ms H100 step in ``benchmarks/results/lora-profile-nvidia-h100-80gb-hbm3-bf16-20261125-085340.txt``); the
rank-r products :math:`U B^\top`, :math:`G`, :math:`\bar A`, :math:`\bar B` stay per projection. The recomputed
forward's ``U`` serves :math:`\bar B` (down_proj's forward is not recomputed: its ``U`` is formed again).
Grouping needs dense weights and one input for all: with LoRA dropout (a mask per projection on the LoRA input)
and for NF4 weights on the Pallas backend (the NF4 kernels' products) the block runs per projection
(:mod:`jaxgrad.ops.lora_linear`). In a bf16 block :math:`s G` is rounded to bf16 for its product with ``A``, and an
``A`` in another dtype is rounded to the block's as a row of the weight; f32 and f64 blocks compute the same
sums as per projection.

What the VJP saves (besides its inputs: ``x``, the frozen weights, norm weights and adapters, which are alive
anyway): the residual stream between the two halves, ``x_2`` (in the block's dtype), the fp32 row statistics
:math:`r_1, r_2` ``[B, T]`` and the attention log-sum-exp ``[B, Hq, T]`` in fp32. Everything else (``h1``, q/k/v,
RoPE, ``P``, ``o``, ``h2``, ``e``, ``u``, ``m``, the LoRA ``U``, dropout masks from the key, NF4 dequantisation, the
stacked weights) is recomputed in the backward, in two halves: the MLP half from the saved ``x_2`` first, then the
attention half from ``x``. When the forward and the backward are one XLA program (a jitted training step), XLA
shares each recomputation with the forward's identical one (common subexpressions), so the recompute costs no time
but the forward's activations stay alive until their backward use. ``low_memory=True`` ties the attention half's
input to :math:`\bar x_2` with an ``optimization_barrier``: it is recomputed for real after the MLP's backward, so
the two halves' activations are never alive together. ``cfg.block_recompute = "mlp"`` does the same for the MLP
half (its input tied to :math:`\bar y`): the forward's gate, up and SwiGLU activations (three ``[B, T, I]`` arrays,
most of a Llama block's) die after the forward, at the cost of the gate and up products again; ``"all"`` both
halves. Measured on the H100 at the benchmark shape, one run of the
XLA backend (``benchmarks/results/lora-nvidia-h100-80gb-hbm3-bf16-20261125-123552.txt``): peak 1015 MiB and
6.57 ms with it, 1150 MiB and 5.95 ms without (PEFT 1074 MiB). At the benchmark shape (batch 4, seq 2048,
hidden 2048, 16 heads / 8 kv heads, head_dim 128, intermediate 5632, r 16, bf16) the saved tensors are

* ``x``: 4 x 2048 x 2048 x 2 B = 33,554,432 B (32 MiB; the block input, saved as a residual);
* ``x_2``: the same, 33,554,432 B;
* ``r1``, ``r2``: 2 x 4 x 2048 x 4 B = 65,536 B;
* ``lse``: 4 x 16 x 2048 x 4 B = 524,288 B;

34,144,256 B (32.6 MiB) beyond the input, 67,698,688 B (64.6 MiB) with it. ``jax.grad`` of the plain block keeps,
among others, the fp32 ``[4, 16, 2048, 2048]`` probabilities alone: 1 GiB.

``backend="xla"`` is this VJP (default); ``"reference"`` is :func:`block_reference` (``jax.grad`` differentiates it);
``"pallas"`` is this VJP with both RMSNorms, SwiGLU and the NF4 base products as Pallas kernels
(:mod:`jaxgrad.lora.kernels`; the same saved statistics); ``"mosaic"`` is this VJP with each dense projection's forward
(and its recompute) and ``dX`` as Mosaic GPU kernels on Hopper (:mod:`jaxgrad.ops.lora_linear_mgpu`).
``attention="cudnn"`` runs the attention core through ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU
only; its backward is cuDNN's, through ``jax.vjp`` taken once in the backward's recompute, so cuDNN's forward runs once
there; nothing is saved for it in the forward). ``attention="pallas"`` runs the attention core as the flash-attention
Pallas kernels of :mod:`jaxgrad.ops.flash_attention` (the same equations and saved ``lse`` as ``"xla"``, no ``T x T``
matrix; its forward kernel runs again in the backward's recompute for ``O``).

**Padding masks.** ``attention_mask`` is HF's ``[batch, seq]`` mask (1 = token, 0 = padding; it masks keys), any
pattern: right or left padding, gaps, sequences of padding only. Every backend and attention implementation gives
the plain reference's function (:func:`jaxgrad.ops.attention.attention_reference`), forward and backward, the
recompute in the VJP's backward included; a query row with no visible key gets attention output 0 and adds nothing
to any gradient, never NaN:

* ``attention="xla"`` (and the ``"reference"`` backend's plain attention): the mask in the score matrix
  (:mod:`jaxgrad.ops.attention`);
* ``attention="pallas"``: each kernel loads the key validity of its kv block (:mod:`jaxgrad.ops.flash_attention`);
* ``attention="cudnn"``: a concrete right-padded mask (:func:`jaxgrad.ops.attention.right_padded`) goes to cuDNN as
  per-row key lengths, its fast padding-causal form with no mask tensor; any other mask -- left padding, gaps, and
  every mask under ``jit``, whose values are unknown when the block is traced -- as a boolean ``[B, 1, T, T]`` mask
  that cuDNN adds as a bias (one ``[B, T, T]`` tensor in the activation dtype); rows with no visible key are zeroed
  after it (:func:`jaxgrad.lora.block_attention.cudnn_attention`, which also pads an odd ``T`` by one position:
  cuDNN's training rule in JAX 0.11 refuses odd lengths). To keep the key-lengths form under ``jit``, close over a
  concrete right-padded mask instead of passing it as an argument.

A concrete mask is checked where it enters (:func:`block`, :func:`block_reference`,
:func:`jaxgrad.lora.model.apply`): ``[batch, seq]`` and 0/1 values only (or bool), else a ``ValueError`` naming
``attention_mask``. Under ``jit`` the values cannot be checked: any non-zero entry is then a token.

**Segment ids** (padding-free packing). ``segment_ids`` is an optional integer ``[batch, seq]`` array; query ``i``
sees key ``j`` iff

.. math::

    j \le i \ \wedge\ \mathrm{valid}_j \ \wedge\ \mathrm{seg}_{b,i} = \mathrm{seg}_{b,j}

so the sequences packed into one row attend block-diagonally, causally within each: every segment's output, and
its gradients, are those of the segment run alone. Give ``positions [batch, seq]`` restarting at 0 in each segment,
the positions the segment alone has (RoPE's scores depend on ``i - j`` only, so a shift within a segment changes
nothing but rounding, which small positions keep small). Padding may be a segment of its own (e.g. 0) and/or masked
by ``attention_mask``. Every backend and
attention implementation takes them (:mod:`jaxgrad.lora.block_attention`): the XLA attention masks its scores, the
flash-attention kernels load the segment ids of their q rows and kv blocks, cuDNN takes the boolean
``[B, 1, T, T]`` mask :math:`[\mathrm{seg}_i = \mathrm{seg}_j] \wedge \mathrm{valid}_j` (never key lengths). The
VJP saves the segment ids (an input) and no more. A concrete or traced ``segment_ids`` must be ``[batch, seq]`` of
an integer dtype, else an error naming ``segment_ids``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.lora.block_attention import attention_core_bwd, attention_core_fwd, attention_core_reference
from jaxgrad.lora.block_attention import cudnn_attention as _cudnn_attention  # noqa: F401 - tests reach it here
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from jaxgrad.lora.grouped import group_bwd, group_fwd, groupable
from jaxgrad.lora.kernels import BACKENDS, XLA, BlockKernels, base_weight
from jaxgrad.ops.attention import check_attention_mask, check_segment_ids, right_padded
from jaxgrad.ops.lora_linear import dropout_keep_scale, lora_linear_bwd, lora_linear_fwd, lora_linear_reference
from jaxgrad.ops.rmsnorm import rms_norm_reference
from jaxgrad.ops.rope import apply_rope_reference, rope_bwd_x, rope_cos_sin, rope_fwd
from jaxgrad.ops.swiglu import swiglu_reference
from jaxgrad.train.mesh import GatheredWeight

__all__ = ["ATTENTIONS", "base_weight", "block", "block_reference", "check_attention", "validate_block_inputs"]

NORMS = ("input_layernorm", "post_attention_layernorm")
#: ``attention=`` of :func:`block`, :func:`block_reference` and :func:`jaxgrad.lora.model.apply`
ATTENTIONS = ("xla", "cudnn", "pallas")
# the projections that share an input: each group is one GEMM where it can be (jaxgrad.lora.grouped)
QKV = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"))
O_PROJ = (("self_attn", "o_proj"),)
GATE_UP = (("mlp", "gate_proj"), ("mlp", "up_proj"))
DOWN = (("mlp", "down_proj"),)


def _weight_shape(w):
    return tuple(w.shape)


def check_attention(attention, where: str) -> None:
    """``attention`` is one of :data:`ATTENTIONS`, and ``"cudnn"`` has a GPU; else a ``ValueError`` naming it."""
    if not isinstance(attention, str) or attention not in ATTENTIONS:
        raise ValueError(f"{where}: 'attention' must be one of {', '.join(repr(a) for a in ATTENTIONS)}, got "
                         f"{attention!r}")
    if attention == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"{where}: attention='cudnn' needs a GPU (jax.default_backend() is "
                         f"{jax.default_backend()!r}); use attention='xla'")


def validate_block_inputs(params, lora, x, cfg: LlamaConfig, lcfg: LoraConfig | None, positions, attention_mask,
                          segment_ids=None):
    """Shapes and names of everything :func:`block` takes; raises naming the argument."""
    from collections.abc import Mapping

    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"block: 'cfg' must be a LlamaConfig, got {type(cfg).__name__}")
    if lcfg is not None and not isinstance(lcfg, LoraConfig):
        raise TypeError(f"block: 'lcfg' must be a LoraConfig or None, got {type(lcfg).__name__}")
    if not hasattr(x, "ndim") or x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"block: 'x' must be [batch, seq, hidden_size={cfg.hidden_size}], got "
                         f"{getattr(x, 'shape', type(x))}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"block: 'x' must be floating point, got {x.dtype}")
    b, t, _ = x.shape
    cfg.check_seq(t)
    hid = cfg.hidden_size
    want = cfg.projection_shapes
    for (g, n), shape in want.items():
        try:
            w = params[g][n]["weight"]
        except (KeyError, TypeError):
            raise ValueError(f"block: params['{g}']['{n}']['weight'] is missing") from None
        if _weight_shape(w) != shape:
            raise ValueError(f"block: params['{g}']['{n}']['weight'] must be [out, in] = {shape}, got "
                             f"{_weight_shape(w)}")
    for n in NORMS:
        try:
            w = params[n]["weight"]
        except (KeyError, TypeError):
            raise ValueError(f"block: params['{n}']['weight'] is missing") from None
        if tuple(w.shape) != (hid,):
            raise ValueError(f"block: params['{n}']['weight'] must be [{hid}], got {tuple(w.shape)}")
    targets = () if lcfg is None else lcfg.targets
    lora = lora or {}
    if not isinstance(lora, Mapping):
        raise TypeError(f"block: 'lora' must be a dict {{group: {{module: {{'lora_A', 'lora_B'}}}}}} or None, got "
                        f"{type(lora).__name__}")
    for (g, n), (out_f, in_f) in want.items():
        group = lora.get(g, {})
        if not isinstance(group, Mapping):
            raise TypeError(f"block: lora['{g}'] must be a dict {{module: {{'lora_A', 'lora_B'}}}}, got "
                            f"{type(group).__name__}")
        entry = group.get(n)
        if (g, n) not in targets:
            if entry is not None:
                raise ValueError(f"block: lora['{g}']['{n}'] is given but '{n}' is not in target_modules")
            continue
        if entry is None:
            raise ValueError(f"block: lora['{g}']['{n}'] is missing ('{n}' is a target module)")
        r = lcfg.r
        for name, expected in (("lora_A", f"[r, in] = {(r, in_f)}"), ("lora_B", f"[out, r] = {(out_f, r)}")):
            if not isinstance(entry, Mapping) or not hasattr(entry.get(name), "shape"):
                got = (f"a {type(entry).__name__}" if not isinstance(entry, Mapping) else
                       f"keys {sorted(map(str, entry))}" if name not in entry else
                       f"{type(entry[name]).__name__} for '{name}'")
                raise ValueError(f"block: lora['{g}']['{n}'] must hold '{name}' {expected} (an adapter entry "
                                 f"{{'lora_A': [r, in], 'lora_B': [out, r]}}), got {got}")
        if tuple(entry["lora_A"].shape) != (r, in_f):
            raise ValueError(f"block: lora['{g}']['{n}']['lora_A'] must be [r, in] = {(r, in_f)}, got "
                             f"{tuple(entry['lora_A'].shape)}")
        if tuple(entry["lora_B"].shape) != (out_f, r):
            raise ValueError(f"block: lora['{g}']['{n}']['lora_B'] must be [out, r] = {(out_f, r)}, got "
                             f"{tuple(entry['lora_B'].shape)}")
    if positions is not None and np.shape(positions) not in ((t,), (b, t)):
        raise ValueError(f"block: 'positions' must be [seq] or [batch, seq] = {(b, t)}, got {np.shape(positions)}")
    check_attention_mask(attention_mask, b, t, "block")  # [batch, seq]; 0/1 values where concrete
    check_segment_ids(segment_ids, b, t, "block")  # [batch, seq] integers


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------
def _adapter(lora, lcfg, g, n):
    if lcfg is None or not lcfg.is_targeted(g, n):
        return None, None
    e = lora[g][n]
    return e["lora_A"], e["lora_B"]


def _keep(lcfg, dropout_key, g, n, shape, dtype):
    """PEFT's per-module dropout mask on the LoRA input, from ``fold_in(key, module index)``."""
    if lcfg is None or dropout_key is None or lcfg.lora_dropout == 0 or not lcfg.is_targeted(g, n):
        return None
    return dropout_keep_scale(jax.random.fold_in(dropout_key, PROJECTIONS.index((g, n))), lcfg.lora_dropout, shape,
                              dtype)


def _cos_sin(cfg, positions, b, t, dtype):
    pos = jnp.arange(t) if positions is None else jnp.asarray(positions)
    pos = jnp.broadcast_to(pos, (b, t))
    return rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Plain reference (differentiated by jax.grad)
# ---------------------------------------------------------------------------------------------------------------
def block_reference(params, lora, x, cfg: LlamaConfig, lcfg: LoraConfig | None, positions=None,
                    attention_mask=None, dropout_key=None, train_base: bool = False, attention: str = "xla", *,
                    segment_ids=None):
    """The block in plain JAX: ``jax.grad`` of this is the oracle of :func:`block`'s VJP. Frozen projection weights
    are ``stop_gradient`` (unless ``train_base``, for training a base model from scratch); the norm weights are
    differentiable. ``attention``: ``"xla"`` (the plain attention), ``"cudnn"`` (GPU:
    ``jax.nn.dot_product_attention(implementation="cudnn")`` in its place, what a JAX user would write) or
    ``"pallas"`` (:func:`jaxgrad.ops.flash_attention.flash_attention`, its own custom VJP). ``segment_ids``: as
    :func:`block`'s (packed sequences attend block-diagonally)."""
    check_attention(attention, "block_reference")
    return _block_reference(params, lora, x, cfg, lcfg, positions, attention_mask, dropout_key, train_base,
                            attention, segment_ids=segment_ids)


def _block_reference(params, lora, x, cfg, lcfg, positions=None, attention_mask=None, dropout_key=None,
                     train_base=False, attention="xla", segment_ids=None):
    """:func:`block_reference` unchecked: ``attention`` may also be ``"sdpa:<implementation>"``, the ``"cudnn"``
    code path with another ``jax.nn.dot_product_attention`` implementation (private: tests and benchmarks on a
    CPU)."""
    dt = x.dtype
    b, t, _ = x.shape
    check_attention_mask(attention_mask, b, t, "block_reference")
    check_segment_ids(segment_ids, b, t, "block_reference")
    s = 0.0 if lcfg is None else lcfg.scale

    def proj(h, g, n):
        w = base_weight(params[g][n]["weight"], dt)
        a, bb = _adapter(lora, lcfg, g, n)
        if a is None:
            return (h @ (w if train_base else jax.lax.stop_gradient(w)).T).astype(dt)
        if train_base:
            return (h @ w.T).astype(dt) + lora_linear_reference(h, jnp.zeros_like(w), a, bb, s,
                                                                _keep(lcfg, dropout_key, g, n, h.shape, dt))
        return lora_linear_reference(h, w, a, bb, s, _keep(lcfg, dropout_key, g, n, h.shape, dt))

    eps = cfg.rms_norm_eps
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = _cos_sin(cfg, positions, b, t, dt)
    h1 = rms_norm_reference(x, params["input_layernorm"]["weight"], eps)
    q = apply_rope_reference(proj(h1, "self_attn", "q_proj").reshape(b, t, hq, d), cos, sin)
    k = apply_rope_reference(proj(h1, "self_attn", "k_proj").reshape(b, t, hkv, d), cos, sin)
    v = proj(h1, "self_attn", "v_proj").reshape(b, t, hkv, d)
    # the plain attention; "pallas": the flash kernels' own custom VJP under jax.grad; else the cuDNN code path
    o = attention_core_reference(attention, q, k, v, attention_mask, segment_ids,
                                 key_lengths=segment_ids is None and right_padded(attention_mask))
    x2 = x + proj(o.reshape(b, t, hq * d), "self_attn", "o_proj")
    h2 = rms_norm_reference(x2, params["post_attention_layernorm"]["weight"], eps)
    m = swiglu_reference(proj(h2, "mlp", "gate_proj"), proj(h2, "mlp", "up_proj"))
    return x2 + proj(m, "mlp", "down_proj")


# ---------------------------------------------------------------------------------------------------------------
# The custom VJP
# ---------------------------------------------------------------------------------------------------------------
def _dropout(lcfg, dropout_key) -> bool:
    return lcfg is not None and dropout_key is not None and lcfg.lora_dropout > 0


def _projections(lcfg, params, lora, dropout_key, kern, dt):
    """``(projs, us)``: ``projs(h, names)`` runs the projections ``names`` of one input (one GEMM [W...; A...] where
    they can be grouped, grouped.py, else one by one); ``us`` collects each grouped projection's LoRA ``U`` (and,
    under ``("su", name)``, the Mosaic GPU kernel's ``sU``)."""
    s = 0.0 if lcfg is None else lcfg.scale
    dropout = _dropout(lcfg, dropout_key)
    us = {}

    def proj(h, g, n):
        a, bb = _adapter(lora, lcfg, g, n)
        w = params[g][n]["weight"]
        keep = _keep(lcfg, dropout_key, g, n, h.shape, dt)
        out = kern.lora_fwd(h, w, a, bb, s, keep)  # the Mosaic GPU kernel (mosaic backend) where the call qualifies
        if out is not None:
            if out[1] is not None:
                us[("su", (g, n))] = out[1]  # s h A^T as the kernel rounded it: the backward's dB reads it
            return out[0]
        xw = kern.base_fwd(h, w)  # h W^T in fp32 by the NF4 kernel (pallas backend), else None: W dequantised here
        return lora_linear_fwd(h, None if xw is not None else base_weight(w, dt), a, bb, s, keep, xw=xw,
                               fold_b=kern.fold_b)

    def projs(h, names):
        ws = [params[g][n]["weight"] for g, n in names]
        if not groupable(kern, ws, dropout):
            return [proj(h, g, n) for g, n in names]
        ys, u = group_fwd(h, [base_weight(w, dt) for w in ws], [_adapter(lora, lcfg, g, n) for g, n in names], s)
        us.update(zip(names, u))
        return ys

    return projs, us


def _recompute_attention(cfg, attn, params, x, positions, attention_mask, r1, lse, projs, kern=XLA,
                         segment_ids=None):
    """The attention half of the forward, ``x -> o`` (and ``x_2 = x + P_o(o)`` in the forward, where ``projs`` is
    called for o_proj by the caller): every activation its backward needs."""
    dt = x.dtype
    b, t, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = _cos_sin(cfg, positions, b, t, dt)
    # h1 = w_in * (x r1), r1 = rsqrt(mean(x^2) + eps) in fp32: computed in the forward, the saved one afterwards
    h1, r1 = kern.norm(x, params["input_layernorm"]["weight"], cfg.rms_norm_eps, r1)
    q, k, v = projs(h1, QKV)
    q = rope_fwd(q.reshape(b, t, hq, d), cos, sin)
    k = rope_fwd(k.reshape(b, t, hkv, d), cos, sin)
    v = v.reshape(b, t, hkv, d)
    o, lse, attn_pullback = attention_core_fwd(attn, q, k, v, attention_mask, segment_ids, lse, kern)
    return dict(cos=cos, sin=sin, h1=h1, q=q, k=k, v=v, o2=o.reshape(b, t, hq * d), lse=lse, r1=r1,
                attn_pullback=attn_pullback)


def _recompute_mlp(cfg, params, x2, r2, projs, kern=XLA):
    """The MLP half of the forward from ``x_2``: ``h_2``, ``e``, ``u``, ``m`` (and ``r_2``)."""
    h2, r2 = kern.norm(x2, params["post_attention_layernorm"]["weight"], cfg.rms_norm_eps, r2)
    e, u = projs(h2, GATE_UP)
    return dict(h2=h2, e=e, u=u, m=kern.swiglu(e, u), r2=r2)


def _block_impl(cfg, lcfg, attn, params, lora, x, positions, attention_mask, dropout_key, kern=XLA, segment_ids=None):
    return _block_fwd(cfg, lcfg, attn, params, lora, x, positions, attention_mask, dropout_key, kern, segment_ids)[0]


# static: cfg, lcfg, the attention implementation and the kernel choice (a hashable BlockKernels)
_block = jax.custom_vjp(_block_impl, nondiff_argnums=(0, 1, 2, 9))


def _block_fwd(cfg, lcfg, attn, params, lora, x, positions, attention_mask, dropout_key, kern=XLA, segment_ids=None):
    projs, _ = _projections(lcfg, params, lora, dropout_key, kern, x.dtype)
    att = _recompute_attention(cfg, attn, params, x, positions, attention_mask, None, None, projs, kern, segment_ids)
    x2 = x + projs(att["o2"], O_PROJ)[0]
    mlp = _recompute_mlp(cfg, params, x2, None, projs, kern)
    y = x2 + projs(mlp["m"], DOWN)[0]
    # saved: inputs, x2 (the residual stream between the halves, so that the backward recomputes the MLP half
    # first and the attention half only after it: the two halves' activations are never alive together) and the
    # fp32 row statistics r1, r2 [B, T] and lse [B, Hkv, G, T]; everything else is recomputed. The segment ids (an
    # input, integer [B, T]) are appended only when given
    saved = (params, lora, x, positions, attention_mask, dropout_key, x2, att["r1"], mlp["r2"], att["lse"])
    return y, saved + (() if segment_ids is None else (segment_ids,))


def _gather_again(params, dy):
    """``(params_dx, dy)``: the params for the backward's ``dY W`` products, with a sharded layer's projection weights
    (:class:`~jaxgrad.train.mesh.GatheredWeight`) tied to ``dy`` by an optimisation barrier, so that XLA gathers
    them again there instead of keeping the forward's whole copies alive through the layers that follow (the
    recompute keeps the forward's weights: XLA shares it with the forward's identical computation). Other weights,
    and those with ``reshard_after_forward`` false (XLA then shares the forward's gather and dequantisation with the
    backward's, as on one device), pass unchanged."""
    is_gathered = lambda x: isinstance(x, GatheredWeight) and x.reshard_after_forward  # noqa: E731
    leaves, tree = jax.tree.flatten(params, is_leaf=is_gathered)
    at = [i for i, x in enumerate(leaves) if is_gathered(x)]
    if not at:
        return params, dy
    tied, dy = jax.lax.optimization_barrier(([leaves[i] for i in at], dy))
    for i, x in zip(at, tied):
        leaves[i] = x
    return jax.tree.unflatten(tree, leaves), dy


def _block_bwd(cfg, lcfg, attn, kern, res, dy):
    params, lora, x, positions, attention_mask, dropout_key, x2, r1, r2, lse = res[:10]
    segment_ids = res[10] if len(res) > 10 else None
    dt = x.dtype
    cdt = jnp.promote_types(dt, jnp.float32)  # gradient sums stay in fp32 (f64 for f64) until the end
    b, t, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    s = 0.0 if lcfg is None else lcfg.scale
    # the MLP half first (x2 saved). By default XLA shares it with the forward's identical computation (free, but
    # the forward's gate / up / SwiGLU activations, and NF4 weights' dequantised copies, stay alive until here);
    # recompute_mlp: the barrier makes its input and its weights depend on dy, so it is recomputed for real, only now
    x2_mlp = x2
    if kern.recompute_mlp:
        x2_mlp, mlp_params, dy = jax.lax.optimization_barrier((x2, params["mlp"], dy))
        params = {**params, "mlp": mlp_params}
    projs, us = _projections(lcfg, params, lora, dropout_key, kern, dt)
    act = _recompute_mlp(cfg, params, x2_mlp, r2, projs, kern)
    act["us"] = us
    grads = {}
    params_dx, dy = _gather_again(params, dy)

    def proj_bwd(h, g, n, dout):
        """LoRA linear backward: dh = dY W + s m (G A), dA = s G^T drop(h), dB = s dY^T U."""
        a, bb = _adapter(lora, lcfg, g, n)
        w = params_dx[g][n]["weight"]
        keep = _keep(lcfg, dropout_key, g, n, h.shape, dt)
        dx_full, sg = kern.lora_dx(dout, w, a, bb, s, keep, dt) or (None, None)  # the Mosaic GPU kernel, else None
        dyw = None if dx_full is not None else kern.base_dx(dout, w, dt)  # dY W by the NF4 kernel (pallas backend)
        w = None if dyw is not None else base_weight(w, dt)  # NF4 on XLA: re-dequantised here, never saved
        dh, da, db = lora_linear_bwd(h, w, a, bb, s, keep, dout, cdt, dyw=dyw, dx_full=dx_full, sg=sg,
                                     su=act["us"].get(("su", (g, n))))
        if a is not None:
            grads.setdefault(g, {})[n] = {"lora_A": da, "lora_B": db}
        return dh

    dropout = _dropout(lcfg, dropout_key)

    def projs_bwd(h, names, douts):
        """dh of the projections ``names`` of one input h (the sum over them): one GEMM [dY... | s G...] [W...; A...]
        (grouped.py), else one by one; records their A/B gradients."""
        ws = [params_dx[g][n]["weight"] for g, n in names]
        if not groupable(kern, ws, dropout):
            dh = proj_bwd(h, *names[0], douts[0])
            for (g, n), dout in zip(names[1:], douts[1:]):
                dh = dh + proj_bwd(h, g, n, dout)
            return dh
        dh, ab = group_bwd(h, [base_weight(w, dt) for w in ws], [_adapter(lora, lcfg, g, n) for g, n in names],
                           [act["us"].get(name) for name in names], s, douts, cdt)
        for (g, n), gr in zip(names, ab):
            if gr is not None:
                grads.setdefault(g, {})[n] = {"lora_A": gr[0], "lora_B": gr[1]}
        return dh

    dy = dy.astype(cdt)
    # residual 2: y = x2 + down(m)  ->  dx2 starts as dy
    dm = projs_bwd(act["m"], DOWN, [dy])
    # SwiGLU: de = dm u silu'(e), du = dm silu(e), silu'(e) = sigma(e) (1 + e (1 - sigma(e)))
    de, du = kern.swiglu_bwd(act["e"], act["u"], dm, cdt)
    dh2 = projs_bwd(act["h2"], GATE_UP, [de, du])
    # post-attention RMSNorm: dx2 += r2 (g - n2 mean(g n2)), dw_post = sum dh2 n2
    dx2_norm, dw_post = kern.norm_bwd(x2_mlp, params["post_attention_layernorm"]["weight"], r2, dh2, cdt)
    dx2 = dy + dx2_norm
    # the attention half. By default it is the forward's own computation again, which XLA shares with the forward
    # when both are in one program (a training step): free, but its activations stay alive through the MLP's
    # backward. low_memory: the barrier makes its input depend on dx2, so it is recomputed for real, only now
    x_late = x
    if kern.low_memory:
        x_late, attn_params, dx2 = jax.lax.optimization_barrier((x, params["self_attn"], dx2))
        params = {**params, "self_attn": attn_params}
        projs, act["us"] = _projections(lcfg, params, lora, dropout_key, kern, dt)
    act.update(_recompute_attention(cfg, attn, params, x_late, positions, attention_mask, r1, lse, projs, kern,
                                    segment_ids))
    # residual 1: x2 = x + o_proj(attn)
    do = projs_bwd(act["o2"], O_PROJ, [dx2]).reshape(b, t, hq, d)
    # attention: dS = P (dP - rowsum(P dP)), dQ = c dS K, dK = c sum_g dS^T Q, dV = sum_g P^T dO (or cuDNN's)
    dqr, dkr, dv = attention_core_bwd(attn, act["q"], act["k"], act["v"], lse, do, attention_mask, segment_ids, kern,
                                      act["attn_pullback"])
    # RoPE inverse: dq = dq^ cos - rotate_half(dq^ sin)
    dq = rope_bwd_x(dqr.astype(cdt), act["cos"], act["sin"]).reshape(b, t, hq * d)
    dk = rope_bwd_x(dkr.astype(cdt), act["cos"], act["sin"]).reshape(b, t, hkv * d)
    dv = dv.astype(cdt).reshape(b, t, hkv * d)
    dh1 = projs_bwd(act["h1"], QKV, [dq, dk, dv])
    dx1, dw_in = kern.norm_bwd(x_late, params["input_layernorm"]["weight"], r1, dh1, cdt)
    dx = (dx2 + dx1).astype(dt)  # both residual sums
    dparams = {k: None for k in params}  # frozen projection weights: zero cotangent (stop_gradient semantics)
    dparams["input_layernorm"] = {"weight": dw_in}
    dparams["post_attention_layernorm"] = {"weight": dw_post}
    dlora = jax.tree.map(lambda _: None, lora)
    for g, mods in grads.items():
        for n, ab in mods.items():
            dlora[g][n] = ab
    return dparams, dlora, dx, None, None, None, None  # positions, mask, dropout key, segment ids: no cotangent


_block.defvjp(_block_fwd, _block_bwd)


def block(params, lora, x, cfg: LlamaConfig, lcfg: LoraConfig | None = None, positions=None, attention_mask=None,
          dropout_key=None, *, segment_ids=None, backend: str = "xla", attention: str = "xla",
          interpret: bool | None = None, group_projections: bool = False, low_memory: bool = False,
          fold_lora_b: bool = True):
    """One Llama decoder block with LoRA, forward; its VJP is hand-written (see the module docstring).

    Args:
      params: HF names and layouts, ``{"self_attn": {"q_proj": {"weight": [out, in]}, ...}, "mlp": {...},
        "input_layernorm": {"weight": [H]}, "post_attention_layernorm": {"weight": [H]}}``; projection weights are
        frozen arrays or NF4 weights (zero cotangent); the norm weights get gradients.
      lora: ``{"self_attn": {"q_proj": {"lora_A": [r, in], "lora_B": [out, r]}, ...}, "mlp": {...}}`` for the
        targeted modules only (``{}`` or ``None`` without LoRA).
      x: ``[batch, seq, hidden]`` (bf16, f32 or f64).
      cfg, lcfg: :class:`LlamaConfig`, :class:`LoraConfig` (``None``: no LoRA).
      positions: ``[seq]`` or ``[batch, seq]`` integer positions (default ``arange(seq)``).
      attention_mask: optional HF 2-D mask ``[batch, seq]`` (1 = token, 0 = padding; masks keys): any pattern on
        every backend (module docstring, "Padding masks"); a concrete mask must be 0/1 (or bool).
      dropout_key: PRNG key for ``lcfg.lora_dropout`` (no dropout without one); each module folds in its index.
      segment_ids: optional integer ``[batch, seq]`` (packing): query ``i`` sees key ``j`` only where
        ``segment_ids[b, i] == segment_ids[b, j]`` (module docstring, "Segment ids"); every backend and attention.
        Give ``positions [batch, seq]`` restarting at 0 per segment for RoPE.
      backend: ``"xla"`` (the custom VJP), ``"pallas"`` (the same VJP with both RMSNorms, SwiGLU and the NF4 base
        products as Pallas kernels, :mod:`jaxgrad.lora.kernels`), ``"mosaic"`` (the same VJP with each projection's
        forward and dX as Mosaic GPU kernels where a call qualifies, else XLA) or ``"reference"``
        (:func:`block_reference`, for ``jax.grad``).
      attention: ``"xla"`` (our attention VJP; the plain attention for ``"reference"``), ``"cudnn"``
        (``jax.nn.dot_product_attention``, GPU only; with ``"reference"``, differentiated by ``jax.grad``; a mask
        as key lengths when concrete and right-padded, else as a boolean mask) or
        ``"pallas"`` (:mod:`jaxgrad.ops.flash_attention`'s kernels, any backend; interpret mode off-GPU).
      interpret: ``backend="pallas"`` or ``attention="pallas"`` only: Pallas interpret mode (``None``: on unless
        JAX's default backend is a GPU, as everywhere in :mod:`jaxgrad.pallas_backend`; ``True`` forces it, e.g. on a
        GPU machine's CPU).
      group_projections: the custom VJP runs the projections that share an input as one GEMM each with the LoRA
        ``A`` rows folded in (module docstring, "Grouped projections"); off by default (on the H100 the same time at
        +459 MiB of peak memory: docs/design.md).
      low_memory: the backward recomputes the attention half for real after the MLP's backward instead of sharing
        the forward's (module docstring, "What the VJP saves"): less peak memory, more time. ``cfg.block_recompute``
        (``"shared"``, ``"mlp"``, ``"all"``: :data:`jaxgrad.lora.config.BLOCK_RECOMPUTE`) says the same for the model:
        ``"mlp"`` recomputes the MLP half for real, ``"all"`` both halves (``low_memory`` included).
      fold_lora_b: each projection's forward as one GEMM ``[h | sU] [W | B]^T``
        (:func:`jaxgrad.ops.lora_linear.lora_linear_fwd`'s ``fold_b``; ``sU`` rounded once to the operand dtype);
        on by default: on the H100 the same time as the separate ``U B^T`` product at 131 MiB less peak memory
        (docs/design.md).
    """
    lora = {} if lora is None else lora
    validate_block_inputs(params, lora, x, cfg, lcfg, positions, attention_mask, segment_ids)
    if backend not in BACKENDS:
        raise ValueError(f"block: 'backend' must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    check_attention(attention, "block")
    if backend == "reference":
        return _block_reference(params, lora, x, cfg, lcfg, positions, attention_mask, dropout_key,
                                attention=attention, segment_ids=segment_ids)
    # interpret only matters to the kernels: the xla backend without Pallas attention ignores it (one trace)
    kernels = backend == "pallas" or attention == "pallas"
    kern = BlockKernels(backend, None if interpret is None or not kernels else bool(interpret),
                        bool(group_projections), bool(low_memory) or cfg.block_recompute == "all", bool(fold_lora_b),
                        cudnn_key_lengths=(attention == "cudnn" and segment_ids is None
                                           and right_padded(attention_mask)),
                        recompute_mlp=cfg.block_recompute != "shared")
    return _block(cfg, lcfg, attention, params, lora, x, positions, attention_mask, dropout_key, kern, segment_ids)


def _block_sdpa(params, lora, x, cfg, lcfg, positions=None, attention_mask=None, dropout_key=None,
                implementation="xla", group_projections=False, low_memory=False, fold_lora_b=True, segment_ids=None):
    """The ``attention="cudnn"`` path of :func:`block` with any ``jax.nn.dot_product_attention`` implementation:
    private, for the tests and the benchmarks, which run it with ``"xla"`` on the CPU."""
    lora = {} if lora is None else lora
    validate_block_inputs(params, lora, x, cfg, lcfg, positions, attention_mask, segment_ids)
    return _block(cfg, lcfg, f"sdpa:{implementation}", params, lora, x, positions, attention_mask, dropout_key,
                  BlockKernels(group=bool(group_projections), low_memory=bool(low_memory) or cfg.block_recompute == "all",
                               fold_b=bool(fold_lora_b),
                               cudnn_key_lengths=segment_ids is None and right_padded(attention_mask),
                               recompute_mlp=cfg.block_recompute != "shared"),
                  segment_ids)
