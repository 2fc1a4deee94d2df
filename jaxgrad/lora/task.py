r"""Causal-LM training of the Llama family (:mod:`jaxgrad.lora`) as a :class:`jaxgrad.train.Task`.

Data: byte-level tokens (vocab 256) of real text that ships with every Python, the standard library's own source:
the files matching ``files`` (a glob relative to ``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded;
or an absolute path or glob, ``~`` expanded, for text of your own; ``**`` matches directories recursively)
in sorted order, concatenated, bytes ``[offset, offset + n_bytes)``. The first ``1 - held_out`` of them train, the
rest is held out (split by position). A training batch is ``batch_size`` windows of ``seq_len`` bytes starting at
positions drawn by ``numpy.random.default_rng([seed, epoch, index])``: a deterministic function of
``(seed, epoch, index)``. The held-out set is its consecutive non-overlapping windows.

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

``grad_path="custom_vjp"`` differentiates the model through the whole-block custom VJP (``backend="xla"``),
``"reference"`` is ``jax.grad`` of the plain reference block (``backend="reference"``), both in LoRA modes.

Throughput is counted in tokens (every position of every window, ``batch_size * seq_len`` per micro-batch,
whatever the accumulation): ``tokens/s`` in the progress display, ``tokens_per_s`` in the metrics and the summary.

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
``evaluate`` returns the held-out mean token loss :math:`\bar\ell` (nats per byte) and perplexity
:math:`e^{\bar\ell}`.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.model import apply, causal_lm_loss, count_items, init, init_lora
from jaxgrad.train.errors import ConfigError, DataError
from jaxgrad.train.task import Task

MODES = ("full", "lora", "qlora")
#: the :class:`LoraFit` settings only some modes use; any other mode refuses one that differs from its default
USED_ONLY_IN = {**{name: ("lora", "qlora") for name in ("r", "lora_alpha", "lora_dropout", "target_modules",
                                                        "use_rslora", "init_lora_weights", "base_seed")},
                "nf4_blocksize": ("qlora",), "double_quant": ("qlora",)}
VOCAB = 256


@dataclasses.dataclass(frozen=True)
class LoraFit:
    """Model, adapter and data settings (everything that defines the params' shapes and the data order)."""

    mode: str = "full"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    seq_len: int = 32
    dtype: str = "float32"
    base: str | None = None
    base_seed: int = 0
    r: int = 4
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    use_rslora: bool = False
    init_lora_weights: bool | str = True
    nf4_blocksize: int = 64
    double_quant: bool = False
    files: str = "*.py"
    offset: int = 0
    n_bytes: int = 65536
    held_out: float = 0.1
    batch_size: int = 8
    data_seed: int = 0

    def __post_init__(self):
        def need(cond, field, expected):
            if not cond:
                raise ConfigError(f"LoRA fit: '{field}' must be {expected}, got {getattr(self, field)!r}")

        need(self.mode in MODES, "mode", f"one of {MODES}")
        need(self.dtype in ("float32", "float64", "bfloat16"), "dtype", "'float32', 'float64' or 'bfloat16'")
        for f in ("seq_len", "n_bytes", "batch_size"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 2, f, "an int >= 2")
        for f in ("offset", "data_seed", "base_seed"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "an int >= 0")
        need(0.0 < self.held_out < 1.0, "held_out", "a fraction in (0, 1)")
        need(isinstance(self.lora_dropout, (int, float)) and 0.0 <= self.lora_dropout < 1.0, "lora_dropout",
             "a probability in [0, 1)")
        need(isinstance(self.files, str) and self.files.strip() != "", "files", "a glob pattern or path")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        self._refuse_settings_the_mode_ignores()
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("LoRA fit: dtype 'float64' needs jax_enable_x64 (set it before creating arrays)")
        try:
            self.llama_config()  # validates the model keys, naming them
            if self.mode != "full":
                self.lora_config().check_layers(self.num_hidden_layers)
        except ConfigError:
            raise
        except ValueError as err:  # LlamaConfig / LoraConfig name the key
            raise ConfigError(f"LoRA fit: {err}") from None

    def _refuse_settings_the_mode_ignores(self) -> None:
        """A setting the mode does not use must keep its default (:data:`USED_ONLY_IN`): mode ``"full"`` has no
        adapters and no frozen base (its model starts from ``base`` or the engine's seed, not ``base_seed``), only
        ``"qlora"`` quantises, and ``base_seed`` seeds only a random base (no ``base``). A changed one would be
        silently ignored, so it is refused, by name."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        bad = []
        for name, modes in USED_ONLY_IN.items():
            value = getattr(self, name)
            if name == "target_modules" and value == ("all-linear",):
                value = "all-linear"
            if self.mode not in modes and value != defaults[name]:
                bad.append(f"'{name}' = {getattr(self, name)!r} (used in mode{'s' if len(modes) > 1 else ''} "
                           f"{' and '.join(map(repr, modes))}; default {defaults[name]!r})")
        if self.mode != "full" and self.base is not None and self.base_seed != defaults["base_seed"]:
            bad.append(f"'base_seed' = {self.base_seed!r} (seeds a random base, used without 'base'; default "
                       f"{defaults['base_seed']!r})")
        if bad:
            raise ConfigError(f"LoRA fit: {'; '.join(bad)} would be silently ignored in mode {self.mode!r}"
                              f"{' with this base' if self.base is not None and self.mode != 'full' else ''}: leave "
                              f"{'it' if len(bad) == 1 else 'them'} at the default or change 'mode'")

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           rope_theta=self.rope_theta, max_position_embeddings=self.seq_len, vocab_size=VOCAB,
                           num_hidden_layers=self.num_hidden_layers)

    def lora_config(self) -> LoraConfig:
        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha, lora_dropout=float(self.lora_dropout),
                          target_modules=self.target_modules,
                          use_rslora=self.use_rslora, init_lora_weights=self.init_lora_weights)


# ------------------------------------------------------------------------------------------------------------ data


def stdlib_files(pattern: str) -> list[pathlib.Path]:
    """The files matching ``pattern``, sorted: a glob relative to the standard library (``site-packages``
    excluded), or an absolute path or glob (``~`` expanded; ``**`` recursive). No match: a
    :class:`~jaxgrad.train.errors.DataError` naming ``files``."""
    expanded = os.path.expanduser(pattern)
    if os.path.isabs(expanded):
        files = sorted(pathlib.Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"LoRA fit: 'files' {pattern!r} matches no file")
        return files
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob(pattern) if p.is_file() and "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise DataError(f"LoRA fit: 'files' pattern {pattern!r} matches no file under {root} (a relative pattern is "
                        f"a glob in the standard library; give an absolute path for other files)")
    return files


def stdlib_bytes(pattern: str, offset: int, n_bytes: int) -> np.ndarray:
    """Bytes ``[offset, offset + n_bytes)`` of the concatenated files (uint8); an error if there are fewer."""
    chunks, have, need = [], 0, offset + n_bytes
    for f in stdlib_files(pattern):
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
    """The base model: the HF checkpoint directory ``fit.base`` (its config must equal the configured model), or
    :func:`jaxgrad.lora.model.init` from ``fit.base_seed``."""
    dtype = jnp.dtype(fit.dtype)
    if fit.base is None:
        return init(jax.random.key(fit.base_seed), cfg, dtype)
    from jaxgrad.lora.hf import CheckpointError, load_hf_checkpoint

    try:
        ck_cfg, params = load_hf_checkpoint(fit.base, dtype=dtype)
    except (FileNotFoundError, CheckpointError) as err:
        raise DataError(f"LoRA fit: 'base' {fit.base}: {err}") from None
    diff = [f"{f.name}: checkpoint {getattr(ck_cfg, f.name)!r}, configured {getattr(cfg, f.name)!r}"
            for f in dataclasses.fields(LlamaConfig) if getattr(ck_cfg, f.name) != getattr(cfg, f.name)]
    if diff:
        raise DataError(f"LoRA fit: 'base' checkpoint {fit.base} does not match the configured model: "
                         + "; ".join(diff))
    return params


def lora_mask(params: dict) -> dict:
    """The engine's ``trainable`` mask in LoRA modes: the adapters only."""
    return {"base": jax.tree.map(lambda _: False, params["base"]), "lora": jax.tree.map(lambda _: True, params["lora"])}


# ------------------------------------------------------------------------------------------------------------ task


def _sum_and_count(logits, batch):
    """``(S, n)``: sum of the token losses (``causal_lm_loss`` with ``n_items = 1``) and ``sum_b n_items[b]``."""
    return causal_lm_loss(logits, batch["labels"], 1), jnp.sum(batch["n_items"])


def make_task(fit: LoraFit, base_params: dict | None = None) -> Task:
    """The :class:`~jaxgrad.train.Task`. ``base_params`` (LoRA modes): the frozen base (default
    :func:`load_base`); in ``"full"`` mode, the initial model (default: the checkpoint ``fit.base`` if given, else
    ``init(key)`` of the engine's seed: training continues from a checkpoint)."""
    cfg = fit.llama_config()
    lcfg = None if fit.mode == "full" else fit.lora_config()
    dtype = jnp.dtype(fit.dtype)
    train, held = split_text(stdlib_bytes(fit.files, fit.offset, fit.n_bytes), fit.held_out)
    if len(train) < fit.seq_len or len(held) < fit.seq_len:
        raise DataError(f"LoRA fit: 'n_bytes' = {fit.n_bytes} leaves {len(train)} train / {len(held)} held-out "
                         f"bytes, fewer than 'seq_len' = {fit.seq_len}")
    nb = max(1, len(train) // (fit.batch_size * fit.seq_len))

    def batches(epoch):
        for i in range(nb):
            yield window_batch(train, train_starts(len(train), fit.seq_len, fit.batch_size, fit.data_seed, epoch, i),
                               fit.seq_len)

    projs = None
    if fit.mode == "full":
        start = load_base(fit, cfg) if base_params is None and fit.base is not None else base_params

        def init_fn(key):
            return init(key, cfg, dtype) if start is None else start

        def model(params, batch, backend, key=None):
            return apply(params, None, batch["input_ids"], cfg, None, backend="reference", train_base=True)
        trainable = None
    else:
        base = load_base(fit, cfg) if base_params is None else base_params
        if fit.mode == "qlora":
            from jaxgrad.lora.hf import quantize_projections

            base, projs = _split_projections(quantize_projections(base, blocksize=fit.nf4_blocksize,
                                                                  double_quant=fit.double_quant))

        def init_fn(key):
            return {"base": base, "lora": init_lora(key, cfg, lcfg, dtype)}

        def model(params, batch, backend, key=None):
            b = params["base"] if projs is None else _join_projections(params["base"], projs)
            return apply(b, params["lora"], batch["input_ids"], cfg, lcfg, backend=backend, dropout_key=key)
        trainable = lora_mask

    def loss(params, batch, key=None):
        """``key``: the LoRA dropout key (``Task.loss_takes_key`` when ``lora_dropout > 0``); None: no dropout."""
        return _sum_and_count(model(params, batch, "xla", key), batch)

    def reference_loss(params, batch, key=None):
        return _sum_and_count(model(params, batch, "reference", key), batch)

    eval_starts = np.arange(0, len(held) - fit.seq_len + 1, fit.seq_len)
    eval_sums = jax.jit(lambda params, batch: reference_loss(params, batch))  # no key: no dropout

    def evaluate(params):
        s = n = 0.0
        for i in range(0, len(eval_starts), fit.batch_size):
            si, ni = eval_sums(params, window_batch(held, eval_starts[i:i + fit.batch_size], fit.seq_len))
            s, n = s + float(si), n + float(ni)
        mean = s / n
        return {"heldout_loss": mean, "heldout_perplexity": math.exp(mean), "heldout_tokens": int(n)}

    what = {"full": "trained from scratch", "lora": "frozen, LoRA", "qlora": "frozen NF4, QLoRA"}[fit.mode]
    adapters = "" if lcfg is None else (f" r={lcfg.r} alpha={lcfg.lora_alpha}"
                                        + (f" dropout={lcfg.lora_dropout}" if lcfg.lora_dropout else "")
                                        + f" on {[n for _, n in lcfg.targets]}")
    return Task("lora", init=init_fn, loss=loss, reference_loss=reference_loss, batches=batches,
                batches_per_epoch=nb, evaluate=evaluate, trainable=trainable,
                loss_takes_key=lcfg is not None and lcfg.lora_dropout > 0,
                throughput_unit="tokens", throughput_count=lambda batch: int(np.size(batch["input_ids"])),
                describe=f"Llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
                         f"{cfg.num_key_value_heads} heads, inter {cfg.intermediate_size}, {fit.dtype}, base {what}"
                         f"{adapters}; stdlib {fit.files!r} bytes {fit.offset}+{fit.n_bytes}: {len(train)} train / "
                         f"{len(held)} held-out, batch {fit.batch_size} x {fit.seq_len}")


# ----------------------------------------------------------------------------------------------------------------
# `jaxgrad train lora`
# ----------------------------------------------------------------------------------------------------------------

CLI_SCHEMA = {
    "model": {"mode": ("str", "full", MODES), "hidden_size": ("int", 32), "num_hidden_layers": ("int", 2),
              "num_attention_heads": ("int", 4), "num_key_value_heads": ("int", 2),
              "intermediate_size": ("int", 64), "rope_theta": ("float", 10000.0), "seq_len": ("int", 32),
              "dtype": ("str", "float32", ("float32", "float64", "bfloat16")), "base": ("str?", None),
              "base_seed": ("int", 0), "r": ("int", 4), "lora_alpha": ("float", 8.0), "lora_dropout": ("float", 0.0),
              "target_modules": ("strs|str", ["all-linear"]), "use_rslora": ("bool", False),
              "nf4_blocksize": ("int", 64), "double_quant": ("bool", False)},
    "data": {"files": ("str", "*.py"), "offset": ("int", 0), "n_bytes": ("int", 65536), "held_out": ("float", 0.1),
             "batch_size": ("int", 8), "seed": ("int", 0)},
}
CLI_TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 3e-3, "steps": 200, "log_every": 10, "checkpoint_every": 100}
CLI_FIXED = {"model": tuple(k for k in CLI_SCHEMA["model"]), "data": "*"}
CLI_OUTPUTS = ("model", "adapter")


def needs_x64(cfg: dict) -> bool:
    return cfg["model"]["dtype"] == "float64"


def fit_from_config(cfg: dict) -> LoraFit:
    m, d = cfg["model"], cfg["data"]
    tm = m["target_modules"]
    return LoraFit(mode=m["mode"], hidden_size=m["hidden_size"], num_hidden_layers=m["num_hidden_layers"],
                   num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_key_value_heads"],
                   intermediate_size=m["intermediate_size"], rope_theta=float(m["rope_theta"]), seq_len=m["seq_len"],
                   dtype=m["dtype"], base=m["base"], base_seed=m["base_seed"], r=m["r"],
                   lora_alpha=float(m["lora_alpha"]), lora_dropout=float(m["lora_dropout"]),
                   target_modules=tm if isinstance(tm, str) else
                   tm[0] if len(tm) == 1 and tm[0] == "all-linear" else tuple(tm),
                   use_rslora=m["use_rslora"], nf4_blocksize=m["nf4_blocksize"], double_quant=m["double_quant"],
                   files=d["files"], offset=d["offset"], n_bytes=d["n_bytes"], held_out=float(d["held_out"]),
                   batch_size=d["batch_size"], data_seed=d["seed"])


def cli_task(cfg: dict, out, say):
    """``(task, finish)`` for ``jaxgrad train lora``. ``finish`` writes the trained model (``full``: an HF
    checkpoint in ``out/model``) or adapter (PEFT's files in ``out/adapter``)."""
    fit = fit_from_config(cfg)
    task = make_task(fit)

    def finish(result):
        params = jax.device_get(result.state["params"])
        if fit.mode == "full":
            from jaxgrad.lora.hf import save_hf_checkpoint

            # out/model belongs to the run (--overwrite clears it): a resumed run rewrites it
            path = save_hf_checkpoint(pathlib.Path(out) / "model", fit.llama_config(), params, overwrite=True)
            return {"eval": result.eval, "model": str(path)}
        from jaxgrad.lora.peft import save_adapter

        # out/adapter belongs to the run (--overwrite clears it): a resumed run rewrites it
        path = save_adapter(pathlib.Path(out) / "adapter", params["lora"], fit.lora_config(),
                            base_model_name_or_path=fit.base, overwrite=True)
        return {"eval": result.eval, "adapter": str(path)}

    return task, finish
