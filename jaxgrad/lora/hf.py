r"""Hugging Face Llama checkpoints: a local transformers directory into the model pytree (and back).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``).
Pickled ``pytorch_model.bin`` files are not read.

``config.json`` -> :class:`jaxgrad.lora.config.LlamaConfig` (``LlamaConfig.from_hf_dict``): what real Llama-family
checkpoints use is accepted (``rope_scaling`` with the Llama 3 rule, or transformers 5's ``rope_parameters``;
``tie_word_embeddings``; an explicit ``head_dim``); a field that changes the math and is not implemented
(``attention_bias: true``, ``mlp_bias: true``, ``hidden_act`` other than ``"silu"``, another ``rope_scaling`` type,
``pretraining_tp > 1``, ``sliding_window``, ...) is refused by name; metadata fields (``architectures``,
``torch_dtype``/``dtype``, token ids, ``transformers_version``, ...) are accepted and ignored. ``model_type`` must
be ``"llama"`` (when present).

Weights (HF names -> the pytree shared with :mod:`jaxgrad.lora.model`):

=============================================  ==================================================  =============
``model.embed_tokens.weight``                  ``params["embed_tokens"]["weight"]``                [vocab, hidden]
``model.layers.{i}.self_attn.q_proj.weight``   ``params["layers"][i]["self_attn"]["q_proj"]["weight"]``  [out, in]
(k_proj, v_proj, o_proj; mlp.gate_proj, up_proj, down_proj likewise)
``model.layers.{i}.input_layernorm.weight``    ``params["layers"][i]["input_layernorm"]["weight"]``      [hidden]
``model.layers.{i}.post_attention_layernorm.weight``  likewise                                              [hidden]
``model.norm.weight``                          ``params["norm"]["weight"]``                        [hidden]
``lm_head.weight``                             ``params["lm_head"]["weight"]`` (absent when tied)  [vocab, hidden]
=============================================  ==================================================  =============

Every expected key must be present with its exact shape and no other key may be there (the error names it),
except two harmless extras: ``...self_attn.rotary_emb.inv_freq`` buffers (old checkpoints; recomputed from the
config) and, for a tied model, an ``lm_head.weight`` equal to the embedding.

Options: ``dtype`` (cast every weight; ``None`` keeps the stored dtype) and ``quantize="nf4"`` (the 7 projection
weights of every layer become :class:`jaxgrad.ops.nf4.NF4Weight`, quantised from the weight *after* the cast to
``dtype``, as transformers + bitsandbytes do with ``torch_dtype`` and ``load_in_4bit``). The embedding, the norms
and the LM head are never quantised (bitsandbytes leaves them alone too). Names and shapes are checked from the
files' headers before any data is read; weights are then read, cast and quantised one at a time, so loading a
model in NF4 never holds the whole dense model in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxgrad.checks import check_float_dtype
from jaxgrad.lora.config import LlamaConfig, layer_module_name
from jaxgrad.lora.peft import MODULE_GROUPS, _check_output_directory, _replacing
from jaxgrad.ops.nf4 import NF4Weight, nf4_dequantize, nf4_quantize

__all__ = [
    "CONFIG_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "CheckpointError",
    "read_llama_config",
    "expected_shapes",
    "params_from_state_dict",
    "state_dict_from_params",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "quantize_projections",
    "dequantize_projections",
    "llama_config_to_hf_dict",
]

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config or the pytree: the message names the file and the key."""


# --------------------------------------------------------------------------------------------- config


def read_llama_config(directory: str | pathlib.Path, **overrides: Any) -> LlamaConfig:
    """``config.json`` of a checkpoint directory as a :class:`LlamaConfig` (see the module docstring).
    ``overrides`` (e.g. ``gradient_checkpointing="full"``) replace fields after reading."""
    path = pathlib.Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing (a Hugging Face checkpoint needs {CONFIG_NAME})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported (only 'llama')")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)})
    if unknown:
        raise TypeError(f"config override {unknown[0]!r} is not a field of jaxgrad.lora.config.LlamaConfig")
    try:
        return LlamaConfig.from_hf_dict(raw, **overrides)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def llama_config_to_hf_dict(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` transformers reads for this config (``LlamaForCausalLM``, transformers 4 names)."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling_dict,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
    }
    return out


# --------------------------------------------------------------------------------------------- names and shapes


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape, for every weight the checkpoint must hold (no ``lm_head`` when tied)."""
    h, v = config.hidden_size, config.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        for (group, module), shape in config.projection_shapes.items():
            out[f"{layer_module_name(layer, group, module)}.weight"] = shape
        prefix = f"model.layers.{layer}"
        out[f"{prefix}.input_layernorm.weight"] = (h,)
        out[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def _pytree_path(name: str) -> tuple:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``("layers", 3, "self_attn", "q_proj", "weight")``."""
    parts = name.split(".")
    if parts[0] == "lm_head":
        return ("lm_head", "weight")
    parts = parts[1:]  # drop "model"
    if parts[0] == "layers":
        return ("layers", int(parts[1]), *parts[2:])
    return tuple(parts)


def _is_ignorable_extra(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".self_attn.rotary_emb.inv_freq")


def _shape_of(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
    shape = getattr(tensors, "shape_of", None)
    return shape(name) if shape is not None else tuple(np.shape(tensors[name]))


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 6 and parts[1] == "layers" and parts[4] in MODULE_GROUPS


def params_from_state_dict(
    tensors: Mapping[str, Any],
    config: LlamaConfig,
    *,
    dtype: Any = None,
    quantize: str | None = None,
    blocksize: int = 64,
    double_quant: bool = False,
    source: str = "state dict",
) -> dict:
    """Check ``{hf_name: array}`` against ``config`` and build the pytree. Errors name the key: missing,
    unexpected, or of the wrong shape (all checked before any weight is read, from the files' headers).

    Weights are read one at a time, cast to ``dtype`` (NumPy, round to nearest even) when given, and with
    ``quantize="nf4"`` the 7 projections are quantised right away, so the host never holds the whole dense model.
    """
    if quantize not in (None, "nf4"):
        raise ValueError(f"quantize must be None or 'nf4', got {quantize!r}")
    check_float_dtype(dtype, "params_from_state_dict", allow_none=True)
    want = expected_shapes(config)
    for name in tensors:
        if name in want or _is_ignorable_extra(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            if "model.embed_tokens.weight" in tensors and np.array_equal(
                np.asarray(tensors[name]), np.asarray(tensors["model.embed_tokens.weight"])
            ):
                continue
            raise CheckpointError(
                f"{source}: 'lm_head.weight' differs from 'model.embed_tokens.weight' but config.json says "
                "tie_word_embeddings = true"
            )
        raise CheckpointError(f"{source}: unexpected key {name!r} (not a weight of LlamaForCausalLM with this config)")
    missing = [n for n in want if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: key {missing[0]!r}{more} is missing")
    for name, shape in want.items():
        got = _shape_of(tensors, name)
        if got != shape:
            raise CheckpointError(f"{source}: {name!r} has shape {got}, expected {shape} from config.json")
    params: dict = {"layers": [{} for _ in range(config.num_hidden_layers)]}
    target = None if dtype is None else np.dtype(jnp.dtype(dtype))
    for name in want:
        value = np.asarray(tensors[name])
        if target is not None:
            value = value.astype(target)
        if quantize == "nf4" and _is_projection(name):
            leaf: Any = nf4_quantize(value, blocksize, double_quant)
        else:
            leaf = jnp.asarray(value)
        path = _pytree_path(name)
        node = params
        for key in path[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[path[-1]] = leaf
    return params


def state_dict_from_params(params: Mapping[str, Any], config: LlamaConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_state_dict` (host arrays). NF4 weights are written dequantised, in their
    original dtype: a transformers checkpoint has no NF4 layout."""
    out: dict[str, np.ndarray] = {}
    for name in expected_shapes(config):
        node: Any = params
        for key in _pytree_path(name):
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                raise CheckpointError(f"params has no entry for {name!r}") from None
        if isinstance(node, NF4Weight):
            node = nf4_dequantize(node, jnp.dtype(node.dtype))
        out[name] = np.asarray(node)
    return out


# --------------------------------------------------------------------------------------------- files


class _SafetensorsFiles(Mapping):
    """``{name: tensor}`` over one or more safetensors files, read one tensor at a time on access; shapes come
    from the headers (:meth:`shape_of`) without reading data."""

    def __init__(self, files: dict[str, pathlib.Path]):
        self._files = files

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "np") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def shape_of(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "np") as f:
            return tuple(f.get_slice(name).get_shape())


def _keys_of(path: pathlib.Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "np") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None


def _read_weights(directory: pathlib.Path) -> _SafetensorsFiles:
    single, index = directory / SAFE_WEIGHTS_NAME, directory / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():
        return _SafetensorsFiles({name: single for name in _keys_of(single)})
    if not index.is_file():
        pickled = [p.name for p in directory.glob("pytorch_model*.bin")]
        hint = f" ({pickled[0]} is a pickle and is not read: re-save with safe_serialization=True)" if pickled else ""
        raise FileNotFoundError(
            f"{str(directory)!r} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}{hint}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object ({exc})") from None
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object {{name: shard file}}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: 'weight_map' entry {name!r} is {shard!r}; expected a shard file name")
    files: dict[str, pathlib.Path] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or pathlib.Path(shard).name != shard:
            raise CheckpointError(f"{index}: shard {shard!r} is not a file name in the checkpoint directory")
        shard_path = directory / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"shard {shard!r} listed in {index} is missing")
        for name in _keys_of(shard_path):
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{shard_path}: key {name!r} is not listed for this shard in {index.name}")
            files[name] = shard_path
    absent = [n for n in weight_map if n not in files]
    if absent:
        raise CheckpointError(f"{index}: key {absent[0]!r} is listed for {weight_map[absent[0]]!r} but not in it")
    return _SafetensorsFiles(files)


def load_hf_checkpoint(
    directory: str | pathlib.Path,
    *,
    dtype: Any = None,
    quantize: str | None = None,
    blocksize: int = 64,
    double_quant: bool = False,
    **config_overrides: Any,
) -> tuple[LlamaConfig, dict]:
    """Load a local transformers Llama checkpoint: ``(LlamaConfig, params)``.

    ``dtype``: cast every weight (``None``: as stored). ``quantize="nf4"``: the 7 projection weights of every
    layer become NF4 (``blocksize``, ``double_quant`` as bitsandbytes' ``bnb_4bit_use_double_quant``).
    ``config_overrides``: LlamaConfig fields to replace (e.g. ``gradient_checkpointing``).
    """
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"checkpoint directory {str(directory)!r} is a file; expected a directory holding "
                                 f"{CONFIG_NAME} and the safetensors weights")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    if quantize not in (None, "nf4"):
        raise ValueError(f"quantize must be None or 'nf4', got {quantize!r}")
    check_float_dtype(dtype, "load_hf_checkpoint", allow_none=True)
    config = read_llama_config(directory, **config_overrides)
    tensors = _read_weights(directory)
    params = params_from_state_dict(tensors, config, dtype=dtype, quantize=quantize, blocksize=blocksize,
                                    double_quant=double_quant, source=str(directory))
    return config, params


def save_hf_checkpoint(
    directory: str | pathlib.Path,
    config: LlamaConfig,
    params: Mapping[str, Any],
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write ``config.json`` and the weights as transformers does: one ``model.safetensors``, or, with
    ``max_shard_size`` (bytes), shards ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    NF4 weights are written dequantised (e.g. a merged QLoRA model).

    A ``directory`` that already holds a checkpoint (``config.json`` or weights) is refused (``FileExistsError``
    naming it) unless ``overwrite=True``, which replaces that checkpoint: its ``config.json``, and its weight files
    in either layout (a single ``model.safetensors`` left next to new shards would be what the loader reads);
    other files are kept. Everything is checked before anything is written.
    """
    from safetensors.numpy import save_file

    if max_shard_size is not None and (isinstance(max_shard_size, bool)
                                       or not isinstance(max_shard_size, (int, float, np.integer, np.floating))
                                       or not max_shard_size > 0):
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"save_hf_checkpoint: 'config' must be a LlamaConfig, got {type(config).__name__}")
    tensors = state_dict_from_params(params, config)
    directory = pathlib.Path(directory)
    old_files = _checkpoint_files(directory)
    _check_output_directory(directory, [p.name for p in old_files] or [CONFIG_NAME], overwrite,
                            "save_hf_checkpoint", "a checkpoint")
    with _replacing(directory / CONFIG_NAME) as tmp:
        tmp.write_text(json.dumps(llama_config_to_hf_dict(config), indent=2) + "\n")
    meta = {"format": "pt"}
    if max_shard_size is None:
        with _replacing(directory / SAFE_WEIGHTS_NAME) as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), meta)
        _remove_stale(old_files, {CONFIG_NAME, SAFE_WEIGHTS_NAME})
        return directory
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        with _replacing(directory / file) as tmp:
            save_file({name: np.ascontiguousarray(v) for name, v in shard.items()}, str(tmp), meta)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))}, "weight_map": weight_map}
    with _replacing(directory / SAFE_WEIGHTS_INDEX_NAME) as tmp:
        tmp.write_text(json.dumps(index, indent=2) + "\n")
    _remove_stale(old_files, {CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, *weight_map.values()})
    return directory


def _remove_stale(old_files: list[pathlib.Path], written: set[str]) -> None:
    """After an ``overwrite=True`` save: delete the replaced checkpoint's files that the new one did not rewrite
    (the other layout's weights, surplus shards), once the new checkpoint is complete."""
    for path in old_files:
        if path.name not in written and path.exists():
            path.unlink()


def _checkpoint_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files of a transformers checkpoint in ``directory``: ``config.json``, ``model.safetensors``, the index
    and its ``model-*-of-*.safetensors`` shards (what :func:`save_hf_checkpoint` writes)."""
    if not directory.is_dir():
        return []
    names = (CONFIG_NAME, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    return sorted([directory / n for n in names if (directory / n).is_file()]
                  + [p for p in directory.glob("model-*-of-*.safetensors") if p.is_file()])


# --------------------------------------------------------------------------------------------- quantisation


def quantize_projections(params: Mapping[str, Any], *, blocksize: int = 64, double_quant: bool = False) -> dict:
    """A new pytree with the 7 projection weights of every layer in NF4 (already-NF4 weights kept as they are).

    Used at load time and to **re-quantise** a merged model: that step is lossy (NF4's ~9 % relative error on
    the whole weight, W + s B A included), so a merged-then-re-quantised model is not the model that was trained
    (base NF4 + adapter); keep the adapter separate when that matters.
    """
    layers = []
    for layer in params["layers"]:
        new = {k: v for k, v in layer.items()}
        for group in ("self_attn", "mlp"):
            new[group] = {
                m: ({**w, "weight": w["weight"] if isinstance(w["weight"], NF4Weight)
                     else nf4_quantize(w["weight"], blocksize, double_quant)})
                for m, w in layer[group].items()
            }
        layers.append(new)
    return {**params, "layers": layers}


def dequantize_projections(params: Mapping[str, Any], dtype: Any = None) -> dict:
    """A new pytree with every NF4 projection weight dequantised (to ``dtype``, default its original dtype)."""
    layers = []
    for layer in params["layers"]:
        new = {k: v for k, v in layer.items()}
        for group in ("self_attn", "mlp"):
            new[group] = {
                m: ({**w, "weight": nf4_dequantize(w["weight"], dtype or jnp.dtype(w["weight"].dtype))}
                    if isinstance(w["weight"], NF4Weight) else w)
                for m, w in layer[group].items()
            }
        layers.append(new)
    return {**params, "layers": layers}
