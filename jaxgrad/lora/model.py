r"""A Llama causal LM with LoRA: embedding, N decoder blocks, final RMSNorm, LM head, and the token loss.

Parameters (Hugging Face names under ``model.``): ``{"embed_tokens": {"weight": [V, H]}, "layers": [block params,
...], "norm": {"weight": [H]}, "lm_head": {"weight": [V, H]}}`` (no ``lm_head`` when ``tie_word_embeddings``:
the head is the embedding). Adapters: ``{"layers": [block adapters, ...]}`` (:mod:`jaxgrad.lora.peft` reads and
writes this layout).

Loss over a gradient-accumulation window of micro-batches :math:`k` with token losses :math:`\ell_{ki}` (labels
``-100`` ignored, HF's shift: logits at ``t`` predict the label at ``t + 1``):

.. math::

    L = \frac{1}{n_\mathrm{items}} \sum_k \sum_{i \in k} \ell_{ki}, \qquad
    n_\mathrm{items} = \#\{\text{non-ignored labels in the whole window}\}

Each micro-batch contributes ``sum_i l_ki / n_items`` (:func:`causal_lm_loss` with ``n_items`` from
:func:`count_items` over the window); the sum of their gradients is exactly the full-batch gradient. Averaging
per-micro-batch means, :math:`\frac1K \sum_k \frac{1}{n_k} \sum_i \ell_{ki}`, weights tokens of short micro-batches
more (the bug fixed by transformers #34191); nothing here computes it.

The loss without logits: :func:`causal_lm_loss_fused` is ``causal_lm_loss(apply(...))`` computed as
:func:`hidden_states` followed by :func:`jaxgrad.ops.lm_head_loss.lm_head_loss` (the head and the cross-entropy
fused, chunked over tokens, a hand-written VJP), so the ``[batch, seq, vocab]`` logits and their gradient are never
held; :func:`apply` is :func:`hidden_states` followed by the head's einsum.

Padding-free packing: several sequences in one row, ``apply(..., positions=positions, segment_ids=segment_ids)``
with ``segment_ids [batch, seq]`` (query ``i`` sees key ``j`` iff ``j <= i``, ``valid_j`` and
``seg_i = seg_j``: block-diagonal causal attention on every backend) and ``positions [batch, seq]`` restarting at 0
in each segment. With label ``-100`` at each segment's first token (HF's shift would otherwise predict it from the
previous segment's last token) no loss crosses a boundary, and each segment's logits and its loss's gradient are
those of the segment run alone (``tests/test_lora_packing.py``, float64); :func:`count_items` counts the
non-ignored labels of packed rows as of any others, so the window normalisation stays exact.

Gradient checkpointing: ``cfg.gradient_checkpointing`` wraps every block in ``jax.checkpoint`` with that policy
(``"none"``: no wrapping; ``"full"``: save nothing inside a block; else a ``jax.checkpoint_policies`` name).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.checks import check_key
from jaxgrad.lora.block import _block_reference, _block_sdpa, block, check_attention
from jaxgrad.lora.config import PROJECTIONS, LlamaConfig, LoraConfig
from jaxgrad.ops.attention import check_attention_mask, check_segment_ids
from jaxgrad.ops.lm_head_loss import DEFAULT_CHUNK_TOKENS, backend_beside, check_label_range, lm_head_loss
from jaxgrad.ops.nf4 import NF4Weight
from jaxgrad.ops.rmsnorm import rms_norm, rms_norm_reference

__all__ = ["IGNORE_INDEX", "apply", "causal_lm_loss", "causal_lm_loss_fused", "count_items", "head_weight",
           "hidden_states", "init", "init_lora", "loss_fn", "token_losses"]

IGNORE_INDEX = -100


def _check_config(value, name: str, expected: type, where: str) -> None:
    if not isinstance(value, expected):
        raise TypeError(f"{where}: '{name}' must be a {expected.__name__}, got {type(value).__name__} "
                        f"{str(value)[:80]}")


def init(key: jax.Array, cfg: LlamaConfig, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random base parameters (HF's ``initializer_range`` normal init, norms at 1).

    ``key`` must be a JAX PRNG key and ``cfg`` a :class:`LlamaConfig`; anything else raises a ``TypeError`` naming
    the argument."""
    check_key(key, "init")
    _check_config(cfg, "cfg", LlamaConfig, "init")
    n_proj = len(PROJECTIONS)
    keys = jax.random.split(key, 2 + cfg.num_hidden_layers * n_proj)
    shapes = cfg.projection_shapes
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = {"self_attn": {}, "mlp": {}}
        for j, (g, n) in enumerate(PROJECTIONS):
            layer[g][n] = {"weight": (std * jax.random.normal(keys[2 + i * n_proj + j], shapes[(g, n)])).astype(dtype)}
        layer["input_layernorm"] = {"weight": jnp.ones((cfg.hidden_size,), dtype)}
        layer["post_attention_layernorm"] = {"weight": jnp.ones((cfg.hidden_size,), dtype)}
        layers.append(layer)
    params = {"embed_tokens": {"weight": (std * jax.random.normal(keys[0], (cfg.vocab_size, cfg.hidden_size)))
                               .astype(dtype)},
              "layers": layers, "norm": {"weight": jnp.ones((cfg.hidden_size,), dtype)}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": (std * jax.random.normal(keys[1], (cfg.vocab_size, cfg.hidden_size)))
                             .astype(dtype)}
    return params


def init_lora(key: jax.Array, cfg: LlamaConfig, lcfg: LoraConfig, dtype=jnp.float32) -> dict:
    """Adapters for the targeted modules of every layer, with PEFT's initialisation:

    * ``True``: A ~ Kaiming-uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0;
    * ``"gaussian"``: A ~ N(0, (1/r)^2), B = 0;
    * ``False``: A and B both nn.Linear-default random, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (B's fan_in is r).

    ``key`` must be a JAX PRNG key, ``cfg`` a :class:`LlamaConfig` and ``lcfg`` a :class:`LoraConfig`; anything
    else raises a ``TypeError`` naming the argument.
    """
    check_key(key, "init_lora")
    _check_config(cfg, "cfg", LlamaConfig, "init_lora")
    _check_config(lcfg, "lcfg", LoraConfig, "init_lora")
    shapes = cfg.projection_shapes
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = {}
        for g, n in lcfg.targets:
            out_f, in_f = shapes[(g, n)]
            ka, kb = jax.random.split(jax.random.fold_in(key, i * len(PROJECTIONS) + PROJECTIONS.index((g, n))))
            if lcfg.init_lora_weights == "gaussian":
                a = jax.random.normal(ka, (lcfg.r, in_f)) / lcfg.r
            else:
                bound = 1 / math.sqrt(in_f)
                a = jax.random.uniform(ka, (lcfg.r, in_f), minval=-bound, maxval=bound)
            if lcfg.init_lora_weights is False:
                bound = 1 / math.sqrt(lcfg.r)
                b = jax.random.uniform(kb, (out_f, lcfg.r), minval=-bound, maxval=bound)
            else:
                b = jnp.zeros((out_f, lcfg.r))
            layer.setdefault(g, {})[n] = {"lora_A": a.astype(dtype), "lora_B": b.astype(dtype)}
        layers.append(layer)
    return {"layers": layers}


def _vocab(params) -> int:
    try:
        return int(params["embed_tokens"]["weight"].shape[0])
    except (KeyError, TypeError, AttributeError, IndexError):
        raise ValueError("apply: params['embed_tokens']['weight'] ([vocab_size, hidden_size]) is missing") from None


def _check_ids(input_ids, vocab: int) -> None:
    """Token ids in ``[0, vocab)``, checked on the host where they are concrete (under ``jit`` they are not: see
    :func:`apply`)."""
    if isinstance(input_ids, jax.core.Tracer):
        return
    ids = np.asarray(input_ids)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        at = [int(i) for i in np.argwhere(bad)[0]]
        raise ValueError(f"apply: 'input_ids' must lie in [0, {vocab}) (the vocabulary size: the rows of "
                         f"params['embed_tokens']['weight']), got {ids[tuple(at)].item()} at {at}")


def _check_model(params, lora, input_ids, cfg, lcfg, attention_mask=None, segment_ids=None):
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"apply: 'cfg' must be a LlamaConfig, got {type(cfg).__name__}")
    if np.ndim(input_ids) != 2:
        raise ValueError(f"apply: 'input_ids' must be [batch, seq], got shape {np.shape(input_ids)}")
    if not jnp.issubdtype(jnp.asarray(input_ids).dtype, jnp.integer):
        raise TypeError(f"apply: 'input_ids' must be integers, got {jnp.asarray(input_ids).dtype}")
    cfg.check_seq(np.shape(input_ids)[1])
    _check_ids(input_ids, _vocab(params))
    check_attention_mask(attention_mask, *np.shape(input_ids), "apply")
    check_segment_ids(segment_ids, *np.shape(input_ids), "apply")
    if len(params.get("layers", ())) != cfg.num_hidden_layers:
        raise ValueError(f"apply: params['layers'] has {len(params.get('layers', ()))} blocks but "
                         f"'num_hidden_layers' is {cfg.num_hidden_layers}")
    if ("lm_head" in params) == cfg.tie_word_embeddings:
        raise ValueError("apply: params['lm_head'] must be absent exactly when 'tie_word_embeddings' is True")
    if lcfg is not None and not isinstance(lcfg, LoraConfig):
        raise TypeError(f"apply: 'lcfg' must be a LoraConfig or None, got {type(lcfg).__name__}")
    if not isinstance(lora, Mapping) or not isinstance(lora.get("layers"), (list, tuple)):
        raise TypeError(f"apply: 'lora' must be None or a dict {{'layers': [one adapter dict per layer]}}, got "
                        f"{type(lora).__name__}")
    if lcfg is not None and len(lora.get("layers", ())) != cfg.num_hidden_layers:
        raise ValueError(f"apply: lora['layers'] has {len(lora.get('layers', ()))} entries, expected "
                         f"{cfg.num_hidden_layers}")
    for i, layer in enumerate(lora["layers"] if lcfg is not None else ()):
        for g, n in lcfg.targets:
            entry = layer.get(g, {}).get(n) if isinstance(layer, Mapping) and isinstance(layer.get(g, {}), Mapping) \
                else None
            path = f"lora['layers'][{i}]['{g}']['{n}']"
            if entry is None:
                raise ValueError(f"apply: {path} is missing ('{n}' is a target module; expected "
                                 "{'lora_A': [r, in], 'lora_B': [out, r]})")
            if not isinstance(entry, Mapping):
                raise ValueError(f"apply: {path} must be an adapter entry {{'lora_A': [r, in], 'lora_B': [out, r]}}, "
                                 f"got a {type(entry).__name__}")
            for k in ("lora_A", "lora_B"):
                if k not in entry:
                    raise ValueError(f"apply: {path} has no '{k}' (an adapter entry is {{'lora_A': [r, in], "
                                     f"'lora_B': [out, r]}}), got keys {sorted(map(str, entry))}")


def _has_nf4(tree) -> bool:
    return any(isinstance(leaf, NF4Weight) for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NF4Weight)))


def _checkpointed(fn, policy: str):
    """``fn(layer, layer_lora, h, key)`` under the block's ``gradient_checkpointing`` policy."""
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy))


def apply(params, lora, input_ids, cfg: LlamaConfig, lcfg: LoraConfig | None = None, *, attention_mask=None,
          positions=None, segment_ids=None, dropout_key=None, backend: str = "xla", attention: str = "xla", dtype=None,
          train_base: bool = False, layer_call=None):
    """Logits ``[batch, seq, vocab]`` (in the activation dtype) of the causal LM.

    Args:
      params, lora: see the module docstring (``lora`` may be ``None`` with ``lcfg=None``).
      input_ids: ``[batch, seq]`` integer tokens in ``[0, vocab_size)``; ``seq <= max_position_embeddings``.
        Concrete ids (not traced under ``jit``) are checked on the host: an id outside the vocabulary (the rows of
        ``params["embed_tokens"]["weight"]``) is a ``ValueError`` naming ``input_ids``, the id, its position and
        the vocabulary size, as PyTorch's embedding raises. Under ``jit`` the ids cannot be checked: an id outside
        ``[0, vocab_size)``, negative ones included (which JAX's gather would otherwise wrap to the end of the
        table), gathers a NaN embedding: the logits of its sequence are NaN (attention carries the NaN to the
        sequence's other positions; other sequences of the batch are unaffected), and so is the loss. Check ids in
        the data pipeline before a jitted step.
      attention_mask: optional ``[batch, seq]`` HF mask (1 = token, 0 = padding; masks keys): any pattern, on every
        backend and attention (:mod:`jaxgrad.lora.block`, "Padding masks"); a concrete mask must be 0/1 (or bool).
      positions: ``[seq]`` or ``[batch, seq]`` (default ``arange(seq)``); RoPE's positions, which for packed rows
        restart at 0 in each segment.
      segment_ids: optional integer ``[batch, seq]`` for padding-free packing: query ``i`` sees key ``j`` iff
        ``j <= i``, ``attention_mask[b, j]`` (if given) and ``segment_ids[b, i] == segment_ids[b, j]``, so the
        sequences packed into a row attend block-diagonally on every backend and attention
        (:mod:`jaxgrad.lora.block`, "Segment ids"). With ``positions`` restarting per segment and labels ``-100``
        at each segment's first token (no loss across a boundary), each segment's logits and its loss's gradients
        are those of the segment run alone. Padding may be a segment of its own (e.g. 0). Must be ``[batch, seq]``
        of an integer dtype, else an error naming ``segment_ids``.
      dropout_key: LoRA dropout key (each layer folds in its index).
      backend: ``"xla"`` (hand-written block VJP), ``"pallas"`` (the same with the block's RMSNorms and NF4 base
        products as Pallas kernels, interpret mode off-GPU; the final norm stays on XLA) or ``"reference"`` (plain
        JAX, ``jax.grad``).
      attention: ``"xla"`` (the block's own attention; the plain one for ``"reference"``), ``"cudnn"``
        (``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only; differentiated by ``jax.grad`` with
        ``"reference"``) or ``"pallas"`` (the flash-attention kernels of :mod:`jaxgrad.ops.flash_attention`).
      dtype: activation dtype (default: the embedding's).
      train_base: with ``backend="reference"``, let gradients reach the projection weights (training a base
        model); the custom VJP treats them as frozen.
      layer_call: ``layer_call(i, fn, layer, layer_lora, h, key) -> h`` runs layer ``i``'s block ``fn`` on its
        params (default: ``fn`` under ``cfg.gradient_checkpointing``, an NF4 layer's weights tied to ``h`` so
        that their dequantisation waits for the layer); e.g. :mod:`jaxgrad.lora.sharding` hands the block its
        layer's sharded weights there, and decides which layer's input they wait for.
    """
    check_attention(attention, "apply")
    return _apply(params, lora, input_ids, cfg, lcfg, attention_mask=attention_mask, positions=positions,
                  segment_ids=segment_ids, dropout_key=dropout_key, backend=backend, attention=attention, dtype=dtype,
                  train_base=train_base, layer_call=layer_call)


def hidden_states(params, lora, input_ids, cfg: LlamaConfig, lcfg: LoraConfig | None = None, **apply_kwargs):
    """The final-normed hidden states ``h [batch, seq, hidden]`` (in the activation dtype): everything of
    :func:`apply` but the LM head, whose logits are ``einsum("bth,vh->btv", h, head)`` with ``head`` the
    ``lm_head`` weight (or the embedding when tied; :func:`head_weight`). ``apply_kwargs`` are :func:`apply`'s."""
    check_attention(apply_kwargs.get("attention", "xla"), "apply")
    return _hidden_states(params, lora, input_ids, cfg, lcfg, **apply_kwargs)


def head_weight(params, cfg: LlamaConfig):
    """The LM head ``[vocab, hidden]``: ``params["lm_head"]["weight"]``, or the embedding when
    ``cfg.tie_word_embeddings``."""
    return params["embed_tokens"]["weight"] if cfg.tie_word_embeddings else params["lm_head"]["weight"]


def _apply(params, lora, input_ids, cfg, lcfg=None, **kwargs):
    """:func:`apply` whose ``attention`` may also be ``"sdpa:<implementation>"``: the ``"cudnn"`` code path with
    another ``jax.nn.dot_product_attention`` implementation (``"sdpa:xla"`` runs it on the CPU; private, for the
    tests and the benchmarks; with ``backend="xla"`` or ``"reference"`` only)."""
    h = _hidden_states(params, lora, input_ids, cfg, lcfg, **kwargs)
    return jnp.einsum("bth,vh->btv", h, head_weight(params, cfg).astype(h.dtype),
                      preferred_element_type=jnp.promote_types(h.dtype, jnp.float32)).astype(h.dtype)


def _hidden_states(params, lora, input_ids, cfg, lcfg=None, *, attention_mask=None, positions=None, segment_ids=None,
                   dropout_key=None, backend="xla", attention="xla", dtype=None, train_base=False, layer_call=None):
    """:func:`hidden_states`, ``attention="sdpa:<implementation>"`` allowed (see :func:`_apply`)."""
    lora = {"layers": [{} for _ in range(cfg.num_hidden_layers)]} if lora is None else lora
    _check_model(params, lora, input_ids, cfg, lcfg, attention_mask, segment_ids)
    if attention.startswith("sdpa:") and backend not in ("xla", "reference"):
        raise ValueError(f"apply: attention={attention!r} needs backend 'xla' or 'reference', got {backend!r}")
    if train_base and backend != "reference":
        raise ValueError("apply: 'train_base' needs backend='reference' (the custom VJP freezes the projections)")
    emb = params["embed_tokens"]["weight"]
    dtype = emb.dtype if dtype is None else dtype
    ids = jnp.asarray(input_ids)
    if jnp.issubdtype(ids.dtype, jnp.signedinteger):
        # traced ids are not checked: a negative one would wrap to the end of the table (JAX's gather): make it out
        # of range like ids >= vocab, so that every bad id gathers NaN (mode "fill") and shows as NaN logits
        ids = ids.astype(jnp.promote_types(ids.dtype, jnp.int32))
        ids = jnp.where(ids < 0, emb.shape[0], ids)
    h = jnp.take(emb, ids, axis=0, mode="fill", fill_value=jnp.nan).astype(dtype)
    for i, (layer, layer_lora) in enumerate(zip(params["layers"], lora["layers"], strict=True)):
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
        if backend == "reference":
            def fn(layer, layer_lora, h, key):
                return _block_reference(layer, layer_lora, h, cfg, lcfg, positions, attention_mask, key, train_base,
                                        attention=attention, segment_ids=segment_ids)
        elif attention.startswith("sdpa:"):
            def fn(layer, layer_lora, h, key):
                return _block_sdpa(layer, layer_lora, h, cfg, lcfg, positions, attention_mask, key,
                                   implementation=attention.split(":", 1)[1], segment_ids=segment_ids)
        else:
            def fn(layer, layer_lora, h, key):
                return block(layer, layer_lora, h, cfg, lcfg, positions, attention_mask, key, segment_ids=segment_ids,
                             backend=backend, attention=attention)
        if layer_call is None and _has_nf4(layer):
            # a layer's NF4 dequantisation depends on the weights alone, so the scheduler may run every layer's at
            # the start of the step and hold all their outputs (measured on an H100 at Llama-3.1-8B QLoRA: ~6 GiB):
            # tied to the layer's input, each waits for its own layer (a layer_call ties its layer itself)
            h, layer = jax.lax.optimization_barrier((h, layer))
        if layer_call is None:
            h = _checkpointed(fn, cfg.gradient_checkpointing)(layer, layer_lora, h, key)
        else:
            h = layer_call(i, fn, layer, layer_lora, h, key)
    norm = rms_norm_reference if backend == "reference" else rms_norm
    return norm(h, params["norm"]["weight"].astype(dtype), cfg.rms_norm_eps)


def _check_labels(labels, vocab: int, ignore_index: int) -> None:
    """Labels in ``[0, vocab)`` or ``ignore_index``, checked on the host where they are concrete (PyTorch's
    cross-entropy raises there too); under ``jit`` see :func:`token_losses`."""
    check_label_range(labels, vocab, ignore_index, "causal_lm_loss", "the logits' last axis")


def token_losses(logits, labels, ignore_index: int = IGNORE_INDEX):
    """``(losses [batch, seq-1], valid)``: fp32 (f64 for f64) cross-entropy of ``logits[:, t]`` against
    ``labels[:, t + 1]`` (HF's shift), 0 where the label is ``ignore_index``.

    A label outside ``[0, vocab)`` other than ``ignore_index`` is refused where the labels are concrete; under
    ``jit`` it cannot be, and its loss is NaN (never another class's: a gather would wrap or clamp it)."""
    if logits.shape[:2] != np.shape(labels):
        raise ValueError(f"causal_lm_loss: 'labels' must be [batch, seq] = {logits.shape[:2]}, got {np.shape(labels)}")
    _check_labels(labels, logits.shape[-1], ignore_index)
    cdt = jnp.promote_types(logits.dtype, jnp.float32)
    z = logits[:, :-1].astype(cdt)
    target = jnp.asarray(labels)[:, 1:]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < z.shape[-1])
    safe = jnp.where(valid & in_range, target, 0)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    loss = jnp.where(in_range, lse - picked, jnp.nan)
    return jnp.where(valid, loss, 0.0), valid


def count_items(labels_window, ignore_index: int = IGNORE_INDEX) -> int:
    """Non-ignored (shifted) labels over a whole gradient-accumulation window: a list of ``[batch, seq]`` label
    arrays (one per micro-batch), or one array. Counted on the host, before the window is run."""
    if not isinstance(labels_window, (list, tuple)):
        labels_window = [labels_window]
    return int(sum(int(np.sum(np.asarray(lab)[:, 1:] != ignore_index)) for lab in labels_window))


def causal_lm_loss(logits, labels, n_items, ignore_index: int = IGNORE_INDEX):
    """``sum of this micro-batch's token losses / n_items``, ``n_items`` counted over the whole window
    (:func:`count_items`). Summing this over the window's micro-batches gives the full-batch mean loss, and
    summing their gradients the full-batch gradient."""
    if isinstance(n_items, (int, np.integer)) and n_items <= 0:
        raise ValueError(f"causal_lm_loss: 'n_items' must be > 0 (the non-ignored labels of the window), got "
                         f"{n_items}")
    losses, _ = token_losses(logits, labels, ignore_index)
    return jnp.sum(losses) / n_items


def causal_lm_loss_fused(params, lora, input_ids, labels, n_items, cfg: LlamaConfig, lcfg: LoraConfig | None = None,
                         *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, chunk_vocab: int | None = None,
                         ignore_index: int = IGNORE_INDEX, head_grad: bool | None = None, **apply_kwargs):
    """``causal_lm_loss(apply(params, lora, input_ids, cfg, lcfg, **apply_kwargs), labels, n_items)`` without the
    ``[batch, seq, vocab]`` logits: :func:`hidden_states`, then the LM head and the loss fused and chunked over
    ``chunk_tokens`` tokens (and ``chunk_vocab`` vocabulary rows) by :func:`jaxgrad.ops.lm_head_loss.lm_head_loss`,
    divided by ``n_items`` (:func:`count_items` over the window). Same value and gradients (LoRA's, and with
    ``train_base`` the embedding's and the head's, tied or not), except that the logits are not rounded to the
    activation dtype before the loss (for bf16 activations the fused loss is the more accurate; for float32 and
    float64 the two are the same function).

    ``head_grad`` (default: ``train_base``): whether the head (the embedding when tied) is differentiated through
    the loss. ``False`` treats it as frozen (``stop_gradient``, as the block's projection weights are): LoRA's case,
    where the loss's ``dh`` is formed in the forward (:func:`~jaxgrad.ops.lm_head_loss.lm_head_loss`'s
    ``head_grad``)."""
    if isinstance(n_items, (int, np.integer)) and n_items <= 0:
        raise ValueError(f"causal_lm_loss_fused: 'n_items' must be > 0 (the non-ignored labels of the window), got "
                         f"{n_items}")
    h = hidden_states(params, lora, input_ids, cfg, lcfg, **apply_kwargs)
    head_grad = bool(apply_kwargs.get("train_base", False)) if head_grad is None else head_grad
    total, _ = lm_head_loss(h, head_weight(params, cfg).astype(h.dtype), labels, ignore_index=ignore_index,
                            chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, head_grad=head_grad,
                            backend=backend_beside(apply_kwargs.get("backend", "xla"), h.dtype, head_grad, chunk_vocab))
    return total / n_items


def loss_fn(lora, params, input_ids, labels, n_items, cfg: LlamaConfig, lcfg: LoraConfig | None, **apply_kwargs):
    """The training objective of one micro-batch (LoRA first, for ``jax.grad``); ``apply_kwargs`` go to
    :func:`apply`."""
    return causal_lm_loss(apply(params, lora, input_ids, cfg, lcfg, **apply_kwargs), labels, n_items)


def _loss_fn(lora, params, input_ids, labels, n_items, cfg, lcfg, **apply_kwargs):
    """:func:`loss_fn` through :func:`_apply` (``attention="sdpa:<implementation>"``; private, tests and
    benchmarks)."""
    return causal_lm_loss(_apply(params, lora, input_ids, cfg, lcfg, **apply_kwargs), labels, n_items)
