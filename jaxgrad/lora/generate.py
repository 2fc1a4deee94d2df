r"""Greedy decoding of the causal LM of :mod:`jaxgrad.lora.model` (with or without LoRA adapters, NF4 projections
included: whatever :func:`~jaxgrad.lora.model.apply` takes).

The prompts are right-padded into one ``[batch, L]`` token buffer (``L`` = the longest prompt plus
``max_new_tokens``, rounded up to a multiple of :data:`BUFFER_MULTIPLE` and capped at ``max_position_embeddings``,
so that calls of similar lengths reuse one compiled program). Each step runs the whole model on the buffer and
appends to every unfinished row

.. math::

    y_b = \operatorname{argmax}_v \; \mathrm{logits}[b, n_b - 1, v], \qquad n_b \leftarrow n_b + 1

where :math:`n_b` is the row's current length (prompt plus tokens generated so far). Attention is causal, so the
logits at position :math:`n_b - 1` depend on tokens :math:`0 .. n_b - 1` only: the padding after them is never
seen, positions are ``0 .. n_b - 1`` as for the row alone, and no attention mask is needed. A row stops after
``max_new_tokens`` tokens or after it emits an EOS id (the EOS token is kept in its output); the loop ends when
every row has stopped.

Cost: there is no KV cache, so every generated token costs one full forward over the ``[batch, L]`` buffer,
``max_new_tokens`` forwards in all (attention :math:`O(L^2)` per layer each time), against one forward for the
prompt plus ``O(L)`` per token with a cache. Fine for the short completions of an example or an evaluation; not
a serving path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.lora.block import check_attention
from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.kernels import BACKENDS
from jaxgrad.lora.model import apply

__all__ = ["BUFFER_MULTIPLE", "buffer_length", "generate"]

#: the token buffer's length is rounded up to a multiple of this (capped at ``max_position_embeddings``)
BUFFER_MULTIPLE = 64


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _vocab_rows(params) -> int:
    try:
        return int(params["embed_tokens"]["weight"].shape[0])
    except (KeyError, TypeError, AttributeError, IndexError):
        raise ValueError("generate: params['embed_tokens']['weight'] ([vocab_size, hidden_size]) is missing") \
            from None


def _prompts(prompt_ids, vocab: int, max_pos: int) -> list[list[int]]:
    """``prompt_ids`` as lists of ints, checked: a non-empty batch of non-empty 1-D prompts of ids in
    ``[0, vocab)``, none longer than ``max_position_embeddings``."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (Sequence, np.ndarray, jax.Array)):
        raise TypeError(f"generate: 'prompt_ids' must be a batch of prompts (a list of lists of token ids, or a "
                        f"[batch, seq] integer array), got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("generate: 'prompt_ids' is an empty batch; give at least one prompt")
    prompts = []
    for i, p in enumerate(prompt_ids):
        if _is_int(p):
            raise TypeError(f"generate: 'prompt_ids' must be a batch of prompts, but prompt_ids[{i}] is the int "
                            f"{p}; for one prompt pass [ids]")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"generate: prompt_ids[{i}] must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"generate: prompt_ids[{i}] is empty; every prompt needs at least one token (a BOS "
                             f"token, for instance)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"generate: prompt_ids[{i}] must hold integer token ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"generate: prompt_ids[{i}][{j}] = {int(arr[j])} is outside [0, {vocab}) (the "
                             f"vocabulary size: the rows of params['embed_tokens']['weight'])")
        if arr.size > max_pos:
            raise ValueError(f"generate: prompt_ids[{i}] has {arr.size} tokens, more than the model's "
                             f"'max_position_embeddings' ({max_pos})")
        prompts.append([int(t) for t in arr])
    return prompts


def _eos_ids(eos_token_id, vocab: int) -> np.ndarray:
    """``eos_token_id`` (``None``, an id, or several ids as Llama 3's ``generation_config.json`` lists) as an
    int32 array (empty for ``None``)."""
    if eos_token_id is None:
        return np.zeros((0,), np.int32)
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)) or len(ids) == 0 \
            or not all(_is_int(t) for t in ids):
        raise TypeError(f"generate: 'eos_token_id' must be None, a token id or a non-empty list of token ids, got "
                        f"{eos_token_id!r}")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"generate: 'eos_token_id' {bad[0]} is outside [0, {vocab}) (the vocabulary size)")
    return np.asarray(ids, np.int32)


def buffer_length(longest_prompt: int, max_new_tokens: int, max_position_embeddings: int) -> int:
    """``L``: ``longest_prompt + max_new_tokens`` rounded up to a multiple of :data:`BUFFER_MULTIPLE`, at most
    ``max_position_embeddings``."""
    need = longest_prompt + max_new_tokens
    return min(max_position_embeddings, BUFFER_MULTIPLE * math.ceil(need / BUFFER_MULTIPLE))


@functools.partial(jax.jit, static_argnames=("cfg", "lcfg", "backend", "attention"))
def _greedy(params, lora, buf, lengths, max_new, eos, *, cfg, lcfg, backend, attention):
    """``(buf, lengths)`` after greedy decoding: the loop of the module docstring, inside one program."""
    rows = jnp.arange(buf.shape[0])

    def unfinished(carry):
        step, _, _, done = carry
        return (step < max_new) & ~jnp.all(done)

    def one_token(carry):
        step, buf, lengths, done = carry
        logits = apply(params, lora, buf, cfg, lcfg, backend=backend, attention=attention)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        token = jnp.argmax(last, axis=-1).astype(buf.dtype)
        at = jnp.where(done, buf.shape[1], lengths)  # a finished row writes out of bounds: dropped
        buf = buf.at[rows, at].set(token, mode="drop")
        lengths = jnp.where(done, lengths, lengths + 1)
        done = done | jnp.isin(token, eos)
        return step + 1, buf, lengths, done

    done = jnp.zeros(buf.shape[:1], bool)
    _, buf, lengths, _ = jax.lax.while_loop(unfinished, one_token, (jnp.int32(0), buf, lengths, done))
    return buf, lengths


def generate(params, lora, prompt_ids, cfg: LlamaConfig, lcfg: LoraConfig | None = None, *, max_new_tokens: int,
             eos_token_id=None, backend: str = "reference", attention: str = "xla") -> list[list[int]]:
    """Greedy continuations of a batch of prompts (see the module docstring for the algorithm and its cost).

    Args:
      params, lora, cfg, lcfg: the model as :func:`jaxgrad.lora.model.apply` takes it (``lora=None`` with
        ``lcfg=None`` for the base model alone; NF4 projection weights as :func:`jaxgrad.lora.hf.quantize_projections`
        makes them).
      prompt_ids: a batch of prompts, each a non-empty list (or 1-D array) of token ids in ``[0, vocab_size)``;
        the prompts may have different lengths. A ``[batch, seq]`` integer array is a batch of equal-length
        prompts.
      max_new_tokens: the most tokens to generate per prompt, ``>= 1``; the longest prompt plus this must fit in
        ``max_position_embeddings``.
      eos_token_id: ``None`` (generate ``max_new_tokens`` tokens), a token id, or a list of ids: a row stops after
        the first of them it emits.
      backend, attention: as in :func:`~jaxgrad.lora.model.apply` (default: the plain-JAX reference forward).

    Returns:
      For each prompt, the generated tokens only (not the prompt), in order: ``max_new_tokens`` of them, or fewer
      ending with the EOS id. Each row is what generating its prompt alone gives: a row never sees another row or
      the padding after it (the logits of a row may differ from its run alone only by the rounding of another
      buffer shape, which changes a greedy token only at an exact tie).

    Raises ``ValueError`` / ``TypeError`` naming the argument: an empty batch or prompt, an id outside the
    vocabulary, a prompt longer than ``max_position_embeddings``, ``max_new_tokens < 1`` or too many for the
    positions left, a bad ``eos_token_id``, ``backend`` or ``attention``.
    """
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"generate: 'cfg' must be a LlamaConfig, got {type(cfg).__name__}")
    if lcfg is not None and not isinstance(lcfg, LoraConfig):
        raise TypeError(f"generate: 'lcfg' must be a LoraConfig or None, got {type(lcfg).__name__}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: 'max_new_tokens' must be an int >= 1, got {max_new_tokens!r}")
    if backend not in BACKENDS:
        raise ValueError(f"generate: 'backend' must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    check_attention(attention, "generate")
    vocab = _vocab_rows(params)
    max_pos = cfg.max_position_embeddings
    prompts = _prompts(prompt_ids, vocab, max_pos)
    eos = _eos_ids(eos_token_id, vocab)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_pos:
        raise ValueError(f"generate: 'max_new_tokens' = {max_new_tokens} after a prompt of {longest} tokens needs "
                         f"{longest + max_new_tokens} positions, more than the model's 'max_position_embeddings' "
                         f"({max_pos}); at most {max_pos - longest} new tokens fit")
    length = buffer_length(longest, max_new_tokens, max_pos)
    buf = np.zeros((len(prompts), length), np.int32)
    for b, p in enumerate(prompts):
        buf[b, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    out, ends = _greedy(params, lora, jnp.asarray(buf), jnp.asarray(lengths), jnp.int32(max_new_tokens),
                        jnp.asarray(eos), cfg=cfg, lcfg=lcfg, backend=backend, attention=attention)
    out, ends = np.asarray(out), np.asarray(ends)
    return [[int(t) for t in out[b, len(p):ends[b]]] for b, p in enumerate(prompts)]
