r"""Causal-LM training of the Llama family (:mod:`jaxgrad.lora`) as a :class:`jaxgrad.train.Task`.

Settings: :class:`jaxgrad.lora.task_config.LoraFit` (the model, the path, the data; every key documented there and
in ``docs/train.md``). Data, one of:

* **a data file** (``data_path``, with the run's tokenizer): :mod:`jaxgrad.lora.data` reads, tokenizes, masks and
  packs the records into rows of ``seq_len`` tokens with segment ids and per-segment positions
  (:class:`jaxgrad.lora.task_data.FileData`); the held-out set is a seeded fraction of the examples or
  ``eval_path``;
* **byte-level text** (no ``data_path``, no tokenizer; vocab 256) of the standard library's own source: the files
  matching ``files`` (a glob relative to ``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded; or an
  absolute path or glob, ``~`` expanded; ``**`` recursive) in sorted order, concatenated, bytes ``[offset, offset +
  n_bytes)``. The first ``1 - held_out`` of them train, the rest is held out (split by position). A training batch
  is ``batch_size`` windows of ``seq_len`` bytes starting at positions drawn by
  ``numpy.random.default_rng([seed, epoch, index])``; the held-out set is its consecutive non-overlapping windows.

Either way a batch is a deterministic function of ``(seed, epoch, index)``, so a resumed run continues at the same
example.

Modes (``mode``):

* ``"full"``: a base model trained from scratch (or on from the checkpoint ``base``); every parameter is trained. The
  block's custom VJP treats the projection weights as frozen (it returns LoRA and norm gradients and dx only), so both
  grad paths differentiate the reference block (:func:`jaxgrad.lora.model.apply` with ``backend="reference",
  train_base=True``).
* ``"lora"``: params ``{"base", "lora"}``; the base (a checkpoint directory, ``base``, or a seeded random init)
  is frozen by the engine's ``trainable`` mask, only the adapters are trained.
* ``"qlora"``: as ``"lora"`` with the 7 projection weights of every layer in NF4
  (:func:`jaxgrad.lora.hf.quantize_projections`). Those are held by the task, not in ``params`` (integer codes
  are not differentiable leaves); ``params["base"]`` keeps the float embedding, norms and head (frozen).

``lora_dropout`` (LoRA modes): PEFT's dropout on each targeted module's LoRA input only (the base path sees the
undropped input), the same mask in the forward and the backward (the block regenerates it from the key). The key
comes from the engine's RNG stream (``Task.loss_takes_key``: a fresh key per step, micro-batch and device); both
grad paths draw the same masks from the same key; evaluation runs without dropout.

``grad_path="custom_vjp"`` differentiates the model through the whole-block custom VJP on the path
:func:`~jaxgrad.lora.task_config.resolve_path` picks, with the fused LM-head loss by default (``loss``);
``"reference"`` is ``jax.grad`` of the plain reference block and the plain logits loss, both in LoRA modes.

Throughput is counted in tokens trained on (every position of byte windows; the real, non-padding tokens of packed
or padded rows), whatever the accumulation: ``tokens/s`` in the progress display, ``tokens_per_s`` in the metrics
and the summary.

Errors: a bad setting raises :class:`~jaxgrad.train.errors.ConfigError`, data that cannot be used as configured
(no file matches, too few bytes, a base checkpoint that cannot be loaded) :class:`~jaxgrad.train.errors.DataError`;
both name the key.

Loss (the engine's contract). With labels = inputs (HF's shift inside :func:`~jaxgrad.lora.model.token_losses`),
micro-batch :math:`j` returns

.. math::

    S_j = \sum_{i \in j} \ell_i = \mathrm{causal\_lm\_loss}(\mathrm{logits}_j, \mathrm{labels}_j, 1), \qquad
    n_j = \mathrm{count\_items}(\mathrm{labels}_j)

(``n_j`` counted on the host, per window row, and carried in the batch so it shards with it). The engine trains on
:math:`\sum_j S_j / \sum_j n_j` over the accumulation window, which is exactly
:math:`\sum_j \mathrm{causal\_lm\_loss}(\mathrm{logits}_j, \mathrm{labels}_j, n_\mathrm{items})` with
:math:`n_\mathrm{items} = \mathrm{count\_items}(\text{window})`: every token weighs the same.
``evaluate`` runs the run's own path and loss forward and returns the held-out mean token loss :math:`\bar\ell`
(nats per token; per byte for byte-level text) and perplexity :math:`e^{\bar\ell}`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.lora.config import BLOCK_RECOMPUTE, CHECKPOINT_POLICIES, LlamaConfig
from jaxgrad.lora.model import apply, causal_lm_loss, count_items, head_weight, hidden_states, init, init_lora
from jaxgrad.lora.stdlib_data import stdlib_files
from jaxgrad.lora.task_config import (ATTENTIONS, BACKENDS, BYTE_VOCAB, DATA_FORMATS, DTYPES, FILE_FORMATS, LOSSES,
                                      MODES, OVERLONG, SAMPLE_BY, BlockPath, LoraFit, resolve_path)
from jaxgrad.ops.lm_head_loss import backend_beside, lm_head_loss
from jaxgrad.train.errors import ConfigError, DataError
from jaxgrad.train.task import Task

__all__ = ["LoraFit", "BlockPath", "resolve_path", "make_task", "model_config", "load_base", "lora_mask",
           "stdlib_files", "stdlib_bytes", "split_text", "window_batch", "train_starts", "MODES"]
VOCAB = BYTE_VOCAB


# ------------------------------------------------------------------------------------------------------------ data


def stdlib_bytes(pattern: str, offset: int, n_bytes: int) -> np.ndarray:
    """Bytes ``[offset, offset + n_bytes)`` of the concatenated files (uint8); an error if there are fewer."""
    chunks, have, need = [], 0, offset + n_bytes
    for f in stdlib_files(pattern, where="LoRA fit", name="files"):
        chunks.append(f.read_bytes())
        have += len(chunks[-1])
        if have >= need:
            break
    if have < need:
        raise DataError(f"LoRA fit: 'n_bytes' + 'offset' = {need} but the files {pattern!r} hold only {have} bytes")
    return np.frombuffer(b"".join(chunks)[offset:need], np.uint8)


def split_text(tokens: np.ndarray, held_out: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)`` by position: the first ``round((1 - held_out) * n)`` tokens, then the rest."""
    cut = int(round((1.0 - held_out) * len(tokens)))
    return tokens[:cut], tokens[cut:]


def window_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
    """``{"input_ids", "labels", "n_items"}`` for windows ``tokens[s:s + seq_len]``: labels = inputs (shifted in
    the loss), ``n_items[b] = count_items(labels[b:b + 1])`` (the row's non-ignored shifted labels)."""
    ids = np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int32)
    n = np.array([count_items(ids[b:b + 1]) for b in range(len(ids))], np.int32)
    return {"input_ids": ids, "labels": ids, "n_items": n}


def train_starts(n_tokens: int, seq_len: int, batch_size: int, seed: int, epoch: int, index: int) -> np.ndarray:
    """Window starts of training batch ``index`` of ``epoch``: uniform in ``[0, n_tokens - seq_len]``."""
    return np.random.default_rng([seed, epoch, index]).integers(0, n_tokens - seq_len + 1, batch_size)


# ------------------------------------------------------------------------------------------------------------ params


def _split_projections(base: dict) -> tuple[dict, list]:
    """``(rest, projections)``: ``base`` without the 7 projection weights of each layer, and those weights."""
    rest_layers, projs = [], []
    for layer in base["layers"]:
        rest_layers.append({k: v for k, v in layer.items() if k not in ("self_attn", "mlp")})
        projs.append({g: layer[g] for g in ("self_attn", "mlp")})
    return {**base, "layers": rest_layers}, projs


def _join_projections(rest: dict, projs: list) -> dict:
    return {**rest, "layers": [{**layer, **p} for layer, p in zip(rest["layers"], projs, strict=True)]}


def load_base(fit: LoraFit, cfg: LlamaConfig) -> dict:
    """The base model: the HF checkpoint folder ``fit.base`` (its config is ``cfg``: :meth:`LoraFit.llama_config`;
    in mode ``"qlora"`` the projections are quantised to NF4 as they are read, so the dense model is never held
    whole), or :func:`jaxgrad.lora.model.init` from ``fit.base_seed``."""
    dtype = jnp.dtype(fit.dtype)
    if fit.base is None:
        return init(jax.random.key(fit.base_seed), cfg, dtype)
    from jaxgrad.lora.hf import CheckpointError, load_hf_checkpoint

    nf4 = fit.mode == "qlora"
    try:
        _, params = load_hf_checkpoint(pathlib.Path(fit.base).expanduser(), dtype=dtype,
                                       quantize="nf4" if nf4 else None, blocksize=fit.nf4_blocksize,
                                       double_quant=fit.double_quant)
    except (FileNotFoundError, NotADirectoryError, CheckpointError) as err:
        raise DataError(f"LoRA fit: 'base' {fit.base}: {err}") from None
    return params


def lora_mask(params: dict) -> dict:
    """The engine's ``trainable`` mask in LoRA modes: the adapters only."""
    return {"base": jax.tree.map(lambda _: False, params["base"]), "lora": jax.tree.map(lambda _: True, params["lora"])}


def load_tokenizer_of(fit: LoraFit):
    """The run's tokenizer (:meth:`LoraFit.tokenizer_path`), or ``None`` for byte-level text; a folder that cannot
    be read raises :class:`~jaxgrad.train.errors.DataError` naming ``tokenizer``."""
    path = fit.tokenizer_path()
    if path is None:
        return None
    from jaxgrad.lora.tokenizer import load_tokenizer

    try:
        return load_tokenizer(pathlib.Path(path).expanduser())
    except (FileNotFoundError, ValueError) as err:
        raise DataError(f"LoRA fit: 'tokenizer' {path}: {err}") from None


# ------------------------------------------------------------------------------------------------------------ task


def _sum_and_count(logits, batch):
    """``(S, n)``: sum of the token losses (``causal_lm_loss`` with ``n_items = 1``) and ``sum_b n_items[b]``."""
    return causal_lm_loss(logits, batch["labels"], 1), jnp.sum(batch["n_items"])


def _packing_args(batch) -> dict:
    """``apply``'s ``positions`` / ``segment_ids`` (packed rows) or ``attention_mask`` (padded rows) of a batch."""
    if "segment_ids" in batch:
        return {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}
    if "attention_mask" in batch:
        return {"attention_mask": batch["attention_mask"]}
    return {}


class _ByteData:
    """The byte-level standard-library text (module docstring, "Data")."""

    def __init__(self, fit: LoraFit):
        self.fit = fit
        self.train, self.held = split_text(stdlib_bytes(fit.files, fit.offset, fit.n_bytes), fit.held_out)
        if len(self.train) < fit.seq_len or len(self.held) < fit.seq_len:
            raise DataError(f"LoRA fit: 'n_bytes' = {fit.n_bytes} leaves {len(self.train)} train / {len(self.held)} "
                            f"held-out bytes, fewer than 'seq_len' = {fit.seq_len}")
        self.batches_per_epoch = max(1, len(self.train) // (fit.batch_size * fit.seq_len))
        self.describe = (f"stdlib {fit.files!r} bytes {fit.offset}+{fit.n_bytes}: {len(self.train)} train / "
                         f"{len(self.held)} held-out, batch {fit.batch_size} x {fit.seq_len}")

    def batches(self, epoch):
        f = self.fit
        for i in range(self.batches_per_epoch):
            yield window_batch(self.train, train_starts(len(self.train), f.seq_len, f.batch_size, f.data_seed, epoch,
                                                        i), f.seq_len)

    def eval_batches(self):
        f = self.fit
        starts = np.arange(0, len(self.held) - f.seq_len + 1, f.seq_len)
        for i in range(0, len(starts), f.batch_size):
            yield window_batch(self.held, starts[i:i + f.batch_size], f.seq_len)


def _data(fit: LoraFit, tokenizer):
    if tokenizer is None:
        return _ByteData(fit)
    from jaxgrad.lora.task_data import FileData

    return FileData(fit, tokenizer)


def model_config(fit: LoraFit, tokenizer=None, base_params: dict | None = None):
    """The :class:`~jaxgrad.lora.config.LlamaConfig` of a fit: the checkpoint's (``fit.base``), else the fit's
    shape with the tokenizer's vocabulary (256 bytes without one), or the vocabulary of a given base (its
    embedding's rows: the model is that base)."""
    cfg = fit.llama_config(None if tokenizer is None else tokenizer.vocab_size)
    if base_params is not None and fit.base is None:
        cfg = dataclasses.replace(cfg, vocab_size=int(np.shape(base_params["embed_tokens"]["weight"])[0]))
    return cfg


def make_task(fit: LoraFit, base_params: dict | None = None, *, grad_path: str = "custom_vjp",
              device: tuple[str, str | None] | None = None) -> Task:
    """The :class:`~jaxgrad.train.Task`. ``base_params`` (LoRA modes): the frozen base (default
    :func:`load_base`); in ``"full"`` mode, the initial model (default: the checkpoint ``fit.base`` if given, else
    ``init(key)`` of the engine's seed: training continues from a checkpoint). ``grad_path`` (the engine's
    ``train.grad_path``) and ``device`` (``(platform, compute capability)``, default JAX's first device) pick the
    path (:func:`jaxgrad.lora.task_config.resolve_path`)."""
    path = resolve_path(fit, grad_path, device)
    tokenizer = load_tokenizer_of(fit)
    cfg = model_config(fit, tokenizer, base_params)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(f"LoRA fit: the tokenizer {fit.tokenizer_path()} has {tokenizer.vocab_size} tokens, more "
                        f"than the model's vocab_size {cfg.vocab_size}")
    lcfg = None if fit.mode == "full" else fit.lora_config()
    dtype = jnp.dtype(fit.dtype)
    data = _data(fit, tokenizer)
    # the custom-VJP loss's attention; jax.grad of the reference block takes the same one, except the Pallas flash
    # kernels (whose VJP is their own): there the plain attention is the A/B oracle
    ref_attention = "xla" if path.attention == "pallas" else path.attention

    projs = None
    if fit.mode == "full":
        start = load_base(fit, cfg) if base_params is None and fit.base is not None else base_params

        def init_fn(key):
            return init(key, cfg, dtype) if start is None else start

        def model(params, batch, backend, attention, key=None, fn=apply):
            return params, fn(params, None, batch["input_ids"], cfg, None, backend="reference", attention=attention,
                              train_base=True, **_packing_args(batch))
        trainable = None
    else:
        # the task keeps its base in host memory: init hands it to the engine, whose state holds the one device copy
        # (a device-resident base kept here as well would sit beside the state's for the whole run)
        base = jax.device_get(load_base(fit, cfg) if base_params is None else base_params)
        if fit.mode == "qlora":
            from jaxgrad.lora.hf import quantize_projections

            # a checkpoint is quantised as it is read (load_base); a random or given base here
            base, projs = _split_projections(quantize_projections(base, blocksize=fit.nf4_blocksize,
                                                                  double_quant=fit.double_quant))
        adapter_dtype = jnp.dtype(fit.adapter_dtype_name())

        def init_fn(key):
            return {"base": base, "lora": init_lora(key, cfg, lcfg, adapter_dtype)}

        def model(params, batch, backend, attention, key=None, fn=apply):
            b = params["base"] if projs is None else _join_projections(params["base"], projs)
            return b, fn(b, params["lora"], batch["input_ids"], cfg, lcfg, backend=backend, attention=attention,
                         dropout_key=key, **_packing_args(batch))
        trainable = lora_mask

    def loss(params, batch, key=None):
        """``key``: the LoRA dropout key (``Task.loss_takes_key`` when ``lora_dropout > 0``); None: no dropout.
        ``fit.loss = "fused"``: the LM head and the cross-entropy chunk by chunk, no ``[tokens, vocab]`` logits
        (:func:`jaxgrad.ops.lm_head_loss.lm_head_loss`); ``"logits"``: the head's logits, then the loss."""
        if fit.loss == "logits":
            return _sum_and_count(model(params, batch, path.backend, path.attention, key)[1], batch)
        base_params, h = model(params, batch, path.backend, path.attention, key, fn=hidden_states)
        # LoRA modes: the head is frozen, so dh is formed in the forward (head_grad=False); mode full trains it
        head_grad = fit.mode == "full"
        s, _ = lm_head_loss(h, head_weight(base_params, cfg).astype(h.dtype), batch["labels"],
                            chunk_tokens=fit.loss_chunk_tokens, head_grad=head_grad,
                            backend=backend_beside(path.backend, h.dtype, head_grad))
        return s, jnp.sum(batch["n_items"])

    def reference_loss(params, batch, key=None):
        """The A/B oracle: ``jax.grad`` of the plain block and the plain logits loss."""
        return _sum_and_count(model(params, batch, "reference", ref_attention, key)[1], batch)

    # the run's own path and loss, forward only (no key: no dropout): at real sizes the plain block's [B, H, T, T]
    # probabilities and the [tokens, vocab] logits would not fit where training does
    eval_sums = jax.jit(lambda params, batch: loss(params, batch))

    def evaluate(params):
        s = n = 0.0
        for batch in data.eval_batches():
            si, ni = eval_sums(params, batch)
            s, n = s + float(si), n + float(ni)
        mean = s / n
        return {"heldout_loss": mean, "heldout_perplexity": math.exp(mean), "heldout_tokens": int(n)}

    what = {"full": "trained from scratch" if fit.base is None else "trained on from the checkpoint",
            "lora": "frozen, LoRA", "qlora": "frozen NF4, QLoRA"}[fit.mode]
    adapters = "" if lcfg is None else (f" r={lcfg.r} alpha={lcfg.lora_alpha}"
                                        + (f" dropout={lcfg.lora_dropout}" if lcfg.lora_dropout else "")
                                        + f" on {[n for _, n in lcfg.targets]}, adapters {fit.adapter_dtype_name()}")
    source = "" if fit.base is None else f" from {fit.base}"
    return Task("lora", init=init_fn, loss=loss, reference_loss=reference_loss, batches=data.batches,
                batches_per_epoch=data.batches_per_epoch, evaluate=evaluate, trainable=trainable,
                loss_takes_key=lcfg is not None and lcfg.lora_dropout > 0,
                throughput_unit="tokens", throughput_count=_tokens_in,
                describe=f"Llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
                         f"{cfg.num_key_value_heads} heads, inter {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
                         f"{fit.dtype}, base {what}{source}{adapters}; path: "
                         f"{path.describe(fit.gradient_checkpointing, fit.block_recompute)}, loss {_loss_text(fit, path)}; data: {data.describe}")


def _loss_text(fit: LoraFit, path=None) -> str:
    if fit.loss == "logits":
        return "from logits"
    head = "" if path is None else backend_beside(path.backend, jnp.dtype(fit.dtype), fit.mode == "full")
    return f"fused LM head ({fit.loss_chunk_tokens}-token chunks{', mosaic kernel' if head == 'mosaic' else ''})"


def _tokens_in(batch) -> int:
    """Tokens a batch trains on: every position of byte windows, the real (non-padding) tokens of packed or
    padded rows."""
    if "attention_mask" in batch:
        return int(np.sum(batch["attention_mask"]))
    return int(np.size(batch["input_ids"]))


# ----------------------------------------------------------------------------------------------------------------
# `jaxgrad train lora`
# ----------------------------------------------------------------------------------------------------------------

_ARCH = {"hidden_size": "int?", "num_hidden_layers": "int?", "num_attention_heads": "int?",
         "num_key_value_heads": "int?", "intermediate_size": "int?", "rope_theta": "float?"}
CLI_SCHEMA = {
    "model": {"mode": ("str", "full", MODES), **{k: (kind, None) for k, kind in _ARCH.items()},
              "seq_len": ("int", 32), "dtype": ("str", "float32", DTYPES),
              "adapter_dtype": ("str?", None, DTYPES), "base": ("str?", None), "tokenizer": ("str?", None),
              "base_seed": ("int", 0), "r": ("int", 4), "lora_alpha": ("float", 8.0), "lora_dropout": ("float", 0.0),
              "target_modules": ("strs|str", ["all-linear"]), "use_rslora": ("bool", False),
              "nf4_blocksize": ("int", 64), "double_quant": ("bool", False),
              "backend": ("str", "auto", BACKENDS), "attention": ("str", "auto", ATTENTIONS),
              "gradient_checkpointing": ("str", "none", CHECKPOINT_POLICIES),
              "block_recompute": ("str", "shared", BLOCK_RECOMPUTE),
              "loss": ("str", "fused", LOSSES), "loss_chunk_tokens": ("int", 1024)},
    "data": {"path": ("str?", None), "format": ("str?", None, DATA_FORMATS), "eval_path": ("str?", None),
             "packing": ("bool", True), "completion_only": ("bool", True), "assistant_only": ("bool", True),
             "overlong": ("str", "truncate", OVERLONG), "pattern": ("str?", None),
             "file_format": ("str?", None, FILE_FORMATS), "sample_by": ("str", "line", SAMPLE_BY),
             "files": ("str", "*.py"), "offset": ("int", 0), "n_bytes": ("int", 65536), "held_out": ("float", 0.1),
             "batch_size": ("int", 8), "seed": ("int", 0)},
}
CLI_TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 3e-3, "steps": 200, "log_every": 10, "checkpoint_every": 100}
#: keys that may change on --resume: the code path, not the model, the data or the optimiser state
CLI_RESUMABLE = ("backend", "attention", "gradient_checkpointing", "block_recompute", "loss", "loss_chunk_tokens")
CLI_FIXED = {"model": tuple(k for k in CLI_SCHEMA["model"] if k not in CLI_RESUMABLE), "data": "*"}
CLI_OUTPUTS = ("model", "adapter")


def needs_x64(cfg: dict) -> bool:
    return "float64" in (cfg["model"]["dtype"], cfg["model"]["adapter_dtype"])


def fit_from_config(cfg: dict) -> LoraFit:
    m, d = cfg["model"], cfg["data"]
    tm = m["target_modules"]
    return LoraFit(mode=m["mode"], **{k: m[k] for k in _ARCH}, seq_len=m["seq_len"], dtype=m["dtype"],
                   adapter_dtype=m["adapter_dtype"], base=m["base"], tokenizer=m["tokenizer"],
                   base_seed=m["base_seed"], r=m["r"], lora_alpha=float(m["lora_alpha"]),
                   lora_dropout=float(m["lora_dropout"]),
                   target_modules=tm if isinstance(tm, str) else
                   tm[0] if len(tm) == 1 and tm[0] == "all-linear" else tuple(tm),
                   use_rslora=m["use_rslora"], nf4_blocksize=m["nf4_blocksize"], double_quant=m["double_quant"],
                   backend=m["backend"], attention=m["attention"], gradient_checkpointing=m["gradient_checkpointing"],
                   block_recompute=m["block_recompute"], loss=m["loss"], loss_chunk_tokens=m["loss_chunk_tokens"],
                   data_path=d["path"], data_format=d["format"], eval_path=d["eval_path"], packing=d["packing"],
                   completion_only=d["completion_only"], assistant_only=d["assistant_only"],
                   overlong=d["overlong"], pattern=d["pattern"], file_format=d["file_format"],
                   sample_by=d["sample_by"],
                   files=d["files"], offset=d["offset"], n_bytes=d["n_bytes"], held_out=float(d["held_out"]),
                   batch_size=d["batch_size"], data_seed=d["seed"])


def cli_task(cfg: dict, out, say):
    """``(task, finish)`` for ``jaxgrad train lora``. ``finish`` writes the trained model (``full``: an HF
    checkpoint in ``out/model``, with the tokenizer beside it) or adapter (PEFT's files in ``out/adapter``)."""
    fit = fit_from_config(cfg)
    task = make_task(fit, grad_path=cfg["train"]["grad_path"])

    def finish(result):
        params = jax.device_get(result.state["params"])
        if fit.mode == "full":
            from jaxgrad.lora.hf import save_hf_checkpoint

            tokenizer = load_tokenizer_of(fit)
            vocab = None if tokenizer is None else tokenizer.vocab_size
            # out/model belongs to the run (--overwrite clears it): a resumed run rewrites it
            path = save_hf_checkpoint(pathlib.Path(out) / "model", fit.llama_config(vocab), params, overwrite=True)
            if tokenizer is not None:
                tokenizer.save(path)
            return {"eval": result.eval, "model": str(path)}
        from jaxgrad.lora.peft import save_adapter

        # out/adapter belongs to the run (--overwrite clears it): a resumed run rewrites it
        path = save_adapter(pathlib.Path(out) / "adapter", params["lora"], fit.lora_config(),
                            base_model_name_or_path=fit.base, overwrite=True)
        return {"eval": result.eval, "adapter": str(path)}

    return task, finish
