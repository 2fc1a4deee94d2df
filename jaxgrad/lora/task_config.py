r"""Settings of ``jaxgrad train lora`` (:class:`LoraFit`) and the fast path they pick (:func:`resolve_path`).

A :class:`LoraFit` holds everything that defines the params' shapes, the data order and the code path of the Llama
causal-LM task (:mod:`jaxgrad.lora.task`). Every value is checked on construction; a bad one raises
:class:`~jaxgrad.train.errors.ConfigError` naming the key.

**The model.** From scratch (``base`` unset), the architecture keys (:data:`ARCHITECTURE`) default to a tiny model
(:data:`SCRATCH`) and the vocabulary is the tokenizer's (``tokenizer``) or the 256 byte values (no tokenizer). With a
Hugging Face checkpoint folder ``base``, the architecture and vocabulary are the checkpoint's ``config.json``: the
architecture keys stay unset, and one that is set must equal the checkpoint's (a mismatch names both values).

**The path** (:func:`resolve_path`). ``backend`` picks the block's custom VJP: ``"xla"``, ``"pallas"`` (Pallas
RMSNorm / SwiGLU / NF4 kernels), ``"mosaic"`` (Mosaic GPU projection kernels, Hopper) or ``"auto"``: ``"mosaic"``
on a GPU of compute capability 9.x with 16-bit activations, else ``"xla"`` (the fastest verified block on each
device: ``docs/design.md``). ``attention``: ``"xla"``, ``"cudnn"`` (GPU, 16-bit), ``"pallas"`` (the flash kernels)
or ``"auto"``: ``"cudnn"`` on a GPU with 16-bit activations, else ``"xla"``. Mode ``"full"`` and
``train.grad_path = "reference"`` differentiate the plain reference block with ``jax.grad`` (``backend`` is then
``"reference"``; the attention choice still applies). ``gradient_checkpointing`` is the ``jax.checkpoint`` policy
of every block (:data:`jaxgrad.lora.config.CHECKPOINT_POLICIES`); ``block_recompute`` (``"shared"`` default,
``"mlp"``, ``"all"``: :data:`jaxgrad.lora.config.BLOCK_RECOMPUTE`) what the block VJP's backward recomputes for real
instead of keeping the forward's activations: memory against time, the same gradients. ``loss``: ``"fused"`` (default) computes the LM
head and the cross-entropy together, ``loss_chunk_tokens`` tokens at a time, never holding ``[tokens, vocab]``
logits (:func:`jaxgrad.ops.lm_head_loss.lm_head_loss`; the logits stay fp32 up to the loss); ``"logits"`` forms the
logits in the activation dtype, then the loss. The held-out evaluation runs the run's own path and loss (forward
only); ``train.grad_path = "reference"`` differentiates the plain block and the plain logits loss.

**Dtypes.** ``dtype`` is the base weights' and the activations' dtype; ``adapter_dtype`` the LoRA factors' (the
optimiser updates them in it): unset, ``float32`` for a 16-bit ``dtype`` (as PEFT's ``autocast_adapter_dtype``)
and ``dtype`` otherwise. The block casts the factors to the activation dtype as operands and returns their
gradients in ``adapter_dtype``. ``mode = "qlora"`` holds the 7 projections of every layer in NF4.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax

from jaxgrad.lora.config import BLOCK_RECOMPUTE, CHECKPOINT_POLICIES, LlamaConfig, LoraConfig
from jaxgrad.train.errors import ConfigError, DataError

MODES = ("full", "lora", "qlora")
DTYPES = ("float32", "float64", "bfloat16")
BACKENDS = ("auto", "xla", "pallas", "mosaic")
ATTENTIONS = ("auto", "xla", "cudnn", "pallas")
DATA_FORMATS = ("text", "prompt_completion", "messages")
LOSSES = ("fused", "logits")
#: the architecture keys: from the checkpoint with ``base``, else :data:`SCRATCH`'s values unless set
ARCHITECTURE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rope_theta")
SCRATCH = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 64, "rope_theta": 10000.0}
BYTE_VOCAB = 256
#: the :class:`LoraFit` settings only some modes use; any other mode refuses one that differs from its default
USED_ONLY_IN = {**{name: ("lora", "qlora") for name in ("r", "lora_alpha", "lora_dropout", "target_modules",
                                                        "use_rslora", "init_lora_weights", "base_seed",
                                                        "adapter_dtype")},
                "nf4_blocksize": ("qlora",), "double_quant": ("qlora",)}
#: the byte-level standard-library data's keys (no ``data_path`` and no tokenizer) and the keys of a data file
BYTE_DATA_KEYS = ("files", "offset", "n_bytes")
FILE_DATA_KEYS = ("data_format", "eval_path", "packing", "completion_only", "assistant_only", "overlong", "pattern",
                  "file_format", "sample_by")
OVERLONG = ("truncate", "split")
SAMPLE_BY = ("line", "paragraph", "document")
FILE_FORMATS = ("json", "parquet", "csv", "text")


@dataclasses.dataclass(frozen=True)
class BlockPath:
    """The code path a run takes: the block backend of the custom-VJP loss (``"reference"``: ``jax.grad`` of the
    plain block), the attention implementation, and why ``"auto"`` chose them."""

    backend: str
    attention: str
    reason: str

    @property
    def pair(self) -> tuple[str, str]:
        return self.backend, self.attention

    def describe(self, gradient_checkpointing: str, block_recompute: str = "shared") -> str:
        return (f"block {self.backend}, attention {self.attention}, checkpointing {gradient_checkpointing}, "
                f"recompute {block_recompute}"
                f"{' (' + self.reason + ')' if self.reason else ''}")


@dataclasses.dataclass(frozen=True)
class LoraFit:
    """Model, adapter, path and data settings of the Llama causal-LM task (module docstring)."""

    mode: str = "full"
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    seq_len: int = 32
    dtype: str = "float32"
    adapter_dtype: str | None = None
    base: str | None = None
    tokenizer: str | None = None
    base_seed: int = 0
    r: int = 4
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    use_rslora: bool = False
    init_lora_weights: bool | str = True
    nf4_blocksize: int = 64
    double_quant: bool = False
    backend: str = "auto"
    attention: str = "auto"
    gradient_checkpointing: str = "none"
    block_recompute: str = "shared"
    loss: str = "fused"
    loss_chunk_tokens: int = 1024
    data_path: str | None = None
    data_format: str | None = None
    eval_path: str | None = None
    packing: bool = True
    completion_only: bool = True
    assistant_only: bool = True
    overlong: str = "truncate"
    pattern: str | None = None
    file_format: str | None = None
    sample_by: str = "line"
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
        need(self.dtype in DTYPES, "dtype", f"one of {DTYPES}")
        need(self.adapter_dtype is None or self.adapter_dtype in DTYPES, "adapter_dtype", f"one of {DTYPES} or unset")
        need(self.backend in BACKENDS, "backend", f"one of {BACKENDS}")
        need(self.attention in ATTENTIONS, "attention", f"one of {ATTENTIONS}")
        need(self.gradient_checkpointing in CHECKPOINT_POLICIES, "gradient_checkpointing",
             f"one of {CHECKPOINT_POLICIES}")
        need(self.block_recompute in BLOCK_RECOMPUTE, "block_recompute", f"one of {BLOCK_RECOMPUTE}")
        need(self.loss in LOSSES, "loss", f"one of {LOSSES}")
        need(isinstance(self.loss_chunk_tokens, int) and self.loss_chunk_tokens >= 1, "loss_chunk_tokens",
             "an int >= 1")
        need(self.data_format is None or self.data_format in DATA_FORMATS, "data_format",
             f"one of {DATA_FORMATS} or unset (inferred from the columns)")
        need(self.overlong in OVERLONG, "overlong", f"one of {OVERLONG}")
        need(self.sample_by in SAMPLE_BY, "sample_by", f"one of {SAMPLE_BY}")
        need(self.file_format is None or self.file_format in FILE_FORMATS, "file_format",
             f"one of {FILE_FORMATS} or unset (from the extension)")
        for f in ("seq_len", "n_bytes", "batch_size"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 2, f, "an int >= 2")
        for f in ("offset", "data_seed", "base_seed"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "an int >= 0")
        for f in ("packing", "completion_only", "assistant_only"):
            need(isinstance(getattr(self, f), bool), f, "true or false")
        need(0.0 < self.held_out < 1.0, "held_out", "a fraction in (0, 1)")
        need(isinstance(self.lora_dropout, (int, float)) and 0.0 <= self.lora_dropout < 1.0, "lora_dropout",
             "a probability in [0, 1)")
        need(isinstance(self.files, str) and self.files.strip() != "", "files", "a glob pattern or path")
        for f in ("base", "tokenizer", "data_path", "eval_path", "pattern"):
            need(getattr(self, f) is None or (isinstance(getattr(self, f), str) and getattr(self, f).strip()), f,
                 "a path or unset")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.base is None:
            for k in ARCHITECTURE:
                if getattr(self, k) is None:
                    object.__setattr__(self, k, SCRATCH[k])
        self._refuse_settings_the_mode_ignores()
        self._refuse_settings_the_data_ignores()
        if "float64" in (self.dtype, self.adapter_dtype) and not jax.config.jax_enable_x64:
            raise ConfigError("LoRA fit: dtype 'float64' needs jax_enable_x64 (set it before creating arrays)")
        if self.base is None:
            try:
                self._scratch_config(BYTE_VOCAB)  # validates the model keys, naming them
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

    def _refuse_settings_the_data_ignores(self) -> None:
        """The byte-level stdlib keys apply without ``data_path`` and tokenizer only; the data-file keys with
        ``data_path`` only; a changed one that would be ignored is refused by name."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        bytes_mode = self.data_path is None and self.tokenizer_path() is None
        unused = FILE_DATA_KEYS if self.data_path is None else BYTE_DATA_KEYS
        bad = [f"'{k}' = {getattr(self, k)!r}" for k in unused if getattr(self, k) != defaults[k]]
        if bad:
            what = ("apply to a data file ('data_path') only" if self.data_path is None else
                    "select the byte-level standard-library text, which 'data_path' replaces")
            raise ConfigError(f"LoRA fit: {', '.join(bad)} would be silently ignored: these keys {what}")
        if self.eval_path is not None and self.held_out != defaults["held_out"]:
            raise ConfigError(f"LoRA fit: 'held_out' = {self.held_out!r} would be silently ignored: 'eval_path' "
                              f"({self.eval_path}) is the held-out set")
        if self.data_path is None and not bytes_mode:
            raise ConfigError(f"LoRA fit: a tokenizer ({self.tokenizer_path()}) needs data to tokenize: set "
                              f"'data_path' (a JSONL / JSON / Parquet / CSV / text file or folder)")
        if self.data_path is not None and self.tokenizer_path() is None:
            raise ConfigError("LoRA fit: 'data_path' needs a tokenizer: set 'tokenizer' to a folder with "
                              "tokenizer.json, or use a 'base' checkpoint folder that has one")

    # ------------------------------------------------------------------------------------------------ the model
    def tokenizer_path(self) -> str | None:
        """``tokenizer``, else the ``base`` folder where it holds a ``tokenizer.json``, else ``None`` (bytes)."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.base is not None and (pathlib.Path(self.base).expanduser() / "tokenizer.json").is_file():
            return self.base
        return None

    def _scratch_config(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           rope_theta=float(self.rope_theta), max_position_embeddings=self.seq_len,
                           vocab_size=vocab_size, num_hidden_layers=self.num_hidden_layers,
                           gradient_checkpointing=self.gradient_checkpointing, block_recompute=self.block_recompute)

    def llama_config(self, vocab_size: int | None = None) -> LlamaConfig:
        """The model: the checkpoint's ``config.json`` with ``base`` (set architecture keys must agree), else the
        scratch model with ``vocab_size`` (the tokenizer's; default 256 bytes). A checkpoint that cannot be read or
        does not match raises :class:`~jaxgrad.train.errors.DataError` naming ``base``."""
        if self.base is None:
            return self._scratch_config(BYTE_VOCAB if vocab_size is None else vocab_size)
        from jaxgrad.lora.hf import CheckpointError, read_llama_config

        folder = pathlib.Path(self.base).expanduser()
        if not folder.is_dir():
            raise DataError(f"LoRA fit: 'base' {self.base!r} does not exist or is not a folder (expected a Hugging "
                            f"Face checkpoint folder: config.json and model*.safetensors)")
        try:
            cfg = read_llama_config(pathlib.Path(self.base).expanduser(),
                                    gradient_checkpointing=self.gradient_checkpointing,
                                    block_recompute=self.block_recompute)
        except (FileNotFoundError, CheckpointError) as err:
            raise DataError(f"LoRA fit: 'base' {self.base}: {err}") from None
        diff = [f"'{k}': checkpoint {getattr(cfg, k)!r}, configured {getattr(self, k)!r}" for k in ARCHITECTURE
                if getattr(self, k) is not None and getattr(self, k) != getattr(cfg, k)]
        if diff:
            raise DataError(f"LoRA fit: 'base' checkpoint {self.base} does not match the configured model: "
                            f"{'; '.join(diff)} (leave the architecture keys unset to take the checkpoint's)")
        if self.seq_len > cfg.max_position_embeddings:
            raise DataError(f"LoRA fit: 'seq_len' = {self.seq_len} exceeds the checkpoint's max_position_embeddings "
                            f"{cfg.max_position_embeddings} ({self.base})")
        if self.mode != "full":
            try:
                self.lora_config().check_layers(cfg.num_hidden_layers)
            except ValueError as err:
                raise ConfigError(f"LoRA fit: {err}") from None
        return cfg

    def lora_config(self) -> LoraConfig:
        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha, lora_dropout=float(self.lora_dropout),
                          target_modules=self.target_modules,
                          use_rslora=self.use_rslora, init_lora_weights=self.init_lora_weights)

    def adapter_dtype_name(self) -> str:
        """``adapter_dtype``, or its default: ``float32`` for a 16-bit ``dtype``, else ``dtype``."""
        if self.adapter_dtype is not None:
            return self.adapter_dtype
        return "float32" if self.dtype == "bfloat16" else self.dtype


def _device_kind() -> tuple[str, str | None]:
    """``(platform, compute capability)`` of JAX's first device (capability ``None`` off GPU)."""
    dev = jax.devices()[0]
    return dev.platform, getattr(dev, "compute_capability", None)


def resolve_path(fit: LoraFit, grad_path: str = "custom_vjp", device: tuple[str, str | None] | None = None
                 ) -> BlockPath:
    """The block backend and attention the run uses (module docstring); ``device``: ``(platform, compute
    capability)``, default JAX's first device. A choice the device cannot run is a
    :class:`~jaxgrad.train.errors.ConfigError` naming the key."""
    platform, capability = _device_kind() if device is None else device
    gpu = platform == "gpu"
    sixteen = fit.dtype == "bfloat16"
    hopper = gpu and capability is not None and str(capability).split(".")[0] == "9"
    reasons = []
    attention = fit.attention
    if attention == "auto":
        attention = "cudnn" if gpu and sixteen else "xla"
        reasons.append(f"attention auto: {'GPU, bfloat16' if attention == 'cudnn' else 'not a GPU with bfloat16'}")
    elif attention == "cudnn" and not (gpu and sixteen):
        raise ConfigError(f"LoRA fit: 'attention' = 'cudnn' needs a GPU and dtype 'bfloat16' (cuDNN's fused "
                          f"attention takes 16-bit inputs); this run has {platform} and {fit.dtype!r}: use 'xla' or "
                          f"'pallas'")
    if fit.mode == "full" or grad_path == "reference":
        if fit.backend not in ("auto",):
            raise ConfigError(f"LoRA fit: 'backend' = {fit.backend!r} would be ignored: "
                              f"{'mode full trains the projections' if fit.mode == 'full' else 'grad_path reference'}"
                              f" and differentiates the plain block with jax.grad; leave 'backend' = 'auto'")
        return BlockPath("reference", attention, "; ".join(reasons + [
            "mode full: jax.grad of the reference block" if fit.mode == "full" else "grad_path reference"]))
    backend = fit.backend
    if backend == "auto":
        backend = "mosaic" if hopper and sixteen else "xla"
        reasons.append(f"backend auto: {'Hopper GPU, bfloat16' if backend == 'mosaic' else 'not a Hopper GPU with bfloat16'}")
    elif backend == "mosaic" and not gpu:
        raise ConfigError(f"LoRA fit: 'backend' = 'mosaic' needs a Hopper GPU (Mosaic GPU kernels); this run has "
                          f"{platform}: use 'xla'")
    return BlockPath(backend, attention, "; ".join(reasons))
