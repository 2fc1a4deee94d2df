"""Configuration of the Llama block / model (Hugging Face ``config.json`` names) and of LoRA (PEFT ``LoraConfig``).

Both are frozen, hashable dataclasses, so they are static arguments of ``jit`` and ``custom_vjp``. Every value is
checked on construction and a bad one raises naming the argument and what was expected.

LoRA scale: ``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (PEFT ``update_layer``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["LlamaConfig", "LoraConfig", "PROJECTIONS", "CHECKPOINT_POLICIES", "BLOCK_RECOMPUTE"]

#: The 7 projections of a Llama block, as (group, name), in PEFT / HF order.
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
#: ``gradient_checkpointing`` values: "none" (no jax.checkpoint), "full" (save nothing inside a block), or a
#: ``jax.checkpoint_policies`` name.
CHECKPOINT_POLICIES = ("none", "full", "dots_saveable", "nothing_saveable", "everything_saveable",
                       "dots_with_no_batch_dims_saveable")
#: why "offload" (each block's input in host memory between the forward and the backward) is not a policy
OFFLOAD_REFUSED = ("'offload' (block inputs in host memory) is not offered: on JAX 0.11.2's GPU backend XLA's host "
                   "offload of the block inputs held more device memory than 'full' (an H100: 104.5 against 70.4 MB "
                   "of temporaries at 12 layers x 4096 tokens; 63.9 GiB at 131,072 tokens of Llama-3.1-8B QLoRA, "
                   "where 'full' fits 172,032 in 75.2); use 'full'")
#: ``block_recompute`` values: what the whole-block VJP's backward recomputes for real instead of sharing the
#: forward's identical computation (:mod:`jaxgrad.lora.block`, "What the VJP saves"): "shared" (nothing: fastest,
#: the forward's activations stay alive until the backward), "mlp" (the MLP half: its gate, up and SwiGLU
#: activations are freed after the forward), "all" (both halves: only the block's input and its residual stream
#: between the halves stay alive).
BLOCK_RECOMPUTE = ("shared", "mlp", "all")

# config.json keys that are metadata or runtime switches and do not change the math.
_HF_IGNORED = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
               "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "_name_or_path", "auto_map",
               "output_attentions", "output_hidden_states", "return_dict", "tie_encoder_decoder", "id2label",
               "label2id", "attention_dropout", "pretraining_tp", "mlp_bias", "attention_bias", "hidden_act",
               "rope_parameters"}


_REGEX_LAYERS = 256  # a regex target_modules must select the same projections in layers 0 .. 255


def layer_module_name(layer: int, group: str, name: str) -> str:
    """A projection's full module name in a Hugging Face Llama, what PEFT matches ``target_modules`` against."""
    return f"model.layers.{layer}.{group}.{name}"


def _freeze(value):
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama decoder (HF ``LlamaConfig`` names). ``head_dim`` may differ from ``hidden_size / heads``.

    ``rope_scaling`` is ``None`` or the Llama-3 rule (``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}``); any other type is refused. ``attention_bias``,
    ``mlp_bias`` must be False, ``hidden_act`` ``"silu"``, ``attention_dropout`` 0 and ``pretraining_tp`` 1 (the only
    math implemented). ``gradient_checkpointing`` picks the ``jax.checkpoint`` policy of each block in the model;
    ``block_recompute`` what the hand-written block VJP recomputes for real (:data:`BLOCK_RECOMPUTE`): a runtime
    switch of memory against time, like ``gradient_checkpointing``, with the same gradients.
    """

    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    max_position_embeddings: int = 2048
    vocab_size: int = 32000
    num_hidden_layers: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    pretraining_tp: int = 1
    gradient_checkpointing: str = "none"
    block_recompute: str = "shared"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings",
                     "vocab_size", "num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig: '{name}' must be a positive integer, got {v!r}")
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        kv = self.num_key_value_heads
        if not isinstance(kv, int) or kv <= 0:
            raise ValueError(f"LlamaConfig: 'num_key_value_heads' must be a positive integer, got {kv!r}")
        if self.num_attention_heads % kv:
            raise ValueError(f"LlamaConfig: 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                             f"'num_key_value_heads' ({kv})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"LlamaConfig: 'hidden_size' ({self.hidden_size}) is not divisible by "
                                 f"'num_attention_heads' ({self.num_attention_heads}); give 'head_dim' explicitly")
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig: 'head_dim' must be a positive even integer (RoPE rotates halves), got "
                             f"{self.head_dim!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig: 'rms_norm_eps' must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig: 'rope_theta' must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            from jaxgrad.ops.rope import rope_inv_freq  # validates type and fields, names them

            try:
                rope_inv_freq(self.head_dim, self.rope_theta, rs)
            except ValueError as e:
                raise ValueError(f"LlamaConfig: 'rope_scaling': {e}") from None
            rope_type = rs.get("rope_type", rs.get("type"))
            set_("rope_scaling", None if rope_type == "default" else _freeze(rs))
        for name, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"),
                           ("attention_dropout", 0.0), ("pretraining_tp", 1)):
            if getattr(self, name) != want:
                raise ValueError(f"LlamaConfig: '{name}' = {getattr(self, name)!r} is not supported (only {want!r})")
        if self.gradient_checkpointing == "offload":
            raise ValueError(f"LlamaConfig: 'gradient_checkpointing' = {OFFLOAD_REFUSED}")
        if self.gradient_checkpointing not in CHECKPOINT_POLICIES:
            raise ValueError(f"LlamaConfig: 'gradient_checkpointing' must be one of {CHECKPOINT_POLICIES}, got "
                             f"{self.gradient_checkpointing!r}")
        if self.block_recompute not in BLOCK_RECOMPUTE:
            raise ValueError(f"LlamaConfig: 'block_recompute' must be one of {BLOCK_RECOMPUTE}, got "
                             f"{self.block_recompute!r}")

    @property
    def projection_shapes(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(group, name): (out, in)}``: the HF ``[out, in]`` weight shape of each of the 7 projections, in
        :data:`PROJECTIONS` order (``d`` = ``head_dim``, ``Hq``, ``Hkv`` the query and kv heads)::

            q_proj [Hq d, hidden]    k_proj, v_proj [Hkv d, hidden]    o_proj [hidden, Hq d]
            gate_proj, up_proj [intermediate, hidden]                  down_proj [hidden, intermediate]
        """
        d, hid, inter = self.head_dim, self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes = {"q_proj": (q, hid), "k_proj": (kv, hid), "v_proj": (kv, hid), "o_proj": (hid, q),
                  "gate_proj": (inter, hid), "up_proj": (inter, hid), "down_proj": (hid, inter)}
        return {(g, n): shapes[n] for g, n in PROJECTIONS}

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def num_groups(self) -> int:
        """Query heads per kv head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def check_seq(self, seq: int) -> None:
        if seq > self.max_position_embeddings:
            raise ValueError(f"sequence length {seq} is longer than 'max_position_embeddings' "
                             f"({self.max_position_embeddings})")

    @classmethod
    def from_hf_dict(cls, d: Mapping, **overrides) -> LlamaConfig:
        """From a ``config.json`` dict. A key that would change the math and is not implemented is refused by name;
        metadata keys are ignored; ``rope_parameters`` (transformers 5) is read as ``rope_theta`` + ``rope_scaling``.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kw, unknown = {}, []
        for k, v in d.items():
            if k in fields:
                kw[k] = v
            elif k not in _HF_IGNORED:
                unknown.append(k)
        for k in ("attention_bias", "mlp_bias", "hidden_act", "attention_dropout", "pretraining_tp"):
            if k in d:
                kw[k] = d[k]
        rp = d.get("rope_parameters")
        if isinstance(rp, Mapping):
            kw.setdefault("rope_theta", rp.get("rope_theta", cls.rope_theta))
            if rp.get("rope_type", "default") != "default":
                kw.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})
        if unknown:
            raise ValueError(f"LlamaConfig.from_hf_dict: config.json keys {sorted(unknown)} are not supported "
                             "(refused rather than silently ignored)")
        return cls(**{**kw, **overrides})


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT's ``LoraConfig`` fields that change the math.

    Args:
      r: rank (> 0).
      lora_alpha: scale numerator; ``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).
      lora_dropout: dropout probability on the LoRA input, in [0, 1).
      target_modules: a list of names (``"q_proj"`` or ``"self_attn.q_proj"``; a name matches when equal to the
        module's name or path, or a suffix after a dot), ``"all-linear"`` (all 7), or one string: a regular
        expression matched as PEFT matches it, ``re.fullmatch`` against the module's full name in the model,
        ``"model.layers.{i}.self_attn.q_proj"`` (e.g. ``".*\\.(q_proj|v_proj)"`` or
        ``"model\\.layers\\.\\d+\\.mlp\\..*"`` as Python strings). One set of projections applies to every
        layer, so a regex that picks different projections in different layers is refused (checked for layers 0
        to 255; :meth:`check_layers` checks a model's own count). Default (PEFT's for Llama): q_proj, v_proj.
      use_rslora: rank-stabilised scale.
      init_lora_weights: ``True`` (PEFT: Kaiming-uniform A, i.e. U(+-1/sqrt(in)), zero B), ``"gaussian"``
        (A ~ N(0, 1/r^2), zero B) or ``False`` (random non-zero A and B; for tests).
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: Any = ("q_proj", "v_proj")
    use_rslora: bool = False
    init_lora_weights: Any = True

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"LoraConfig: 'r' must be a positive integer, got {self.r!r}")
        if not self.lora_alpha > 0:
            raise ValueError(f"LoraConfig: 'lora_alpha' must be > 0, got {self.lora_alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig: 'lora_dropout' must be in [0, 1), got {self.lora_dropout!r}")
        if self.init_lora_weights not in (True, False, "gaussian") or isinstance(self.init_lora_weights, int) and \
                not isinstance(self.init_lora_weights, bool):
            raise ValueError(f"LoraConfig: 'init_lora_weights' must be True, False or 'gaussian', got "
                             f"{self.init_lora_weights!r}")
        tm = self.target_modules
        if isinstance(tm, (list, tuple)):
            if not tm or not all(isinstance(t, str) for t in tm):
                raise ValueError(f"LoraConfig: 'target_modules' must be a non-empty list of names, got {tm!r}")
            object.__setattr__(self, "target_modules", tuple(tm))
        elif not isinstance(tm, str):
            raise ValueError(f"LoraConfig: 'target_modules' must be a list of names, 'all-linear' or a regex, got "
                             f"{tm!r}")
        elif tm != "all-linear":
            try:
                re.compile(tm)
            except re.error as err:
                raise ValueError(f"LoraConfig: 'target_modules' {tm!r} is not a valid regular expression ({err})") \
                    from None
            self.check_layers(_REGEX_LAYERS)
        if not self.targets:
            hint = ""
            if isinstance(tm, str):
                hint = (f"; a regex is matched with re.fullmatch against full module names such as "
                        f"'{layer_module_name(0, *PROJECTIONS[0])}' (PEFT's rule), e.g. r'.*\\.(q_proj|v_proj)'")
            elif any(set(t) & set("*+?[]()|\\^$") for t in tm):
                hint = "; a list holds module names: give a regex as one string, not inside a list"
            raise ValueError(f"LoraConfig: 'target_modules' {tm!r} matches none of the block's projections "
                             f"{[f'{g}.{n}' for g, n in PROJECTIONS]}{hint}")

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        """The targeted projections as (group, name), in block order."""
        tm = self.target_modules
        if tm == "all-linear":
            return PROJECTIONS
        if isinstance(tm, str):
            return self._layer_targets(0)
        return tuple((g, n) for g, n in PROJECTIONS
                     if any(t in (n, f"{g}.{n}") or f"{g}.{n}".endswith("." + t) for t in tm))

    def _layer_targets(self, layer: int) -> tuple[tuple[str, str], ...]:
        """A regex ``target_modules``' projections in layer ``layer`` (PEFT's full-name match)."""
        return tuple((g, n) for g, n in PROJECTIONS
                     if re.fullmatch(self.target_modules, layer_module_name(layer, g, n)))

    def check_layers(self, n_layers: int) -> None:
        """Refuse a regex ``target_modules`` that selects different projections in different layers of a model of
        ``n_layers`` layers (one set applies to every layer); names and ``"all-linear"`` always pass."""
        tm = self.target_modules
        if not isinstance(tm, str) or tm == "all-linear":
            return
        first = self._layer_targets(0)
        for i in range(1, n_layers):
            other = self._layer_targets(i)
            if other != first:
                raise ValueError(f"LoraConfig: 'target_modules' regex {tm!r} selects different projections in "
                                 f"different layers (layer 0: {[n for _, n in first]}, layer {i}: "
                                 f"{[n for _, n in other]}); one set applies to every layer: use a regex that does "
                                 f"not depend on the layer index, or a list of names")

    def is_targeted(self, group: str, name: str) -> bool:
        return (group, name) in self.targets
