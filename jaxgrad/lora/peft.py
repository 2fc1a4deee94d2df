r"""PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` in and out, merge and unmerge.

Semantics (PEFT ``tuners/lora``): a targeted linear ``y = x W^T`` becomes ``y = x W^T + s (drop(x) A^T) B^T``
with ``A: [r, in]``, ``B: [out, r]`` and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

Files, as ``PeftModel.save_pretrained`` writes them for a ``LlamaForCausalLM``:

* ``adapter_model.safetensors``: ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
  ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (``base_model`` = PEFT's ``LoraModel``, ``.model`` = the
  ``LlamaForCausalLM``, ``.model`` = its ``LlamaModel``);
* ``adapter_config.json``: ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
  ``use_rslora``, ``init_lora_weights``, ``base_model_name_or_path``, ``task_type``, ... .

What is refused, by name, when it carries anything but its default (the math would differ or the weights would
not fit our pytree): ``bias``, ``modules_to_save``, ``rank_pattern``, ``alpha_pattern``, ``use_dora``,
``lora_bias``, ``fan_in_fan_out``, ``layers_to_transform``, ``layer_replication``,
``exclude_modules``, ``trainable_token_indices``, ``target_parameters``, ``use_qalora``, ``alora_invocation_tokens``,
``peft_type`` other than ``LORA``, ... A field this module does not know is accepted only when it is empty
(``None``, ``False``, ``{}``, ``[]``, ``""``) and refused by name otherwise.

In-memory layout (shared with :mod:`jaxgrad.lora.model`): per layer ``{"self_attn": {"q_proj": {"lora_A": A,
"lora_B": B}, ...}, "mlp": {...}}`` for the targeted modules only; a model's adapters are ``{"layers": [layer, ...]}``.

Merge: ``W' = W + (B A) s`` in float32 (float64 for float64 weights), rounded in PEFT's order (the product, the
scaled product, the sum: no fused multiply-add), checked for inf/nan, cast back to ``W``'s dtype; on the CPU the
result is bit-identical to PEFT's ``merge_and_unload`` (tests/test_lora_io.py). An NF4 weight is dequantised
first and **stays dequantised** (``W'`` dense, in the NF4 weight's original dtype): merging onto the original
full-precision weight would be a different model than the one trained.
Re-quantising a merged weight (:func:`jaxgrad.lora.hf.quantize_projections`) is a separate, lossy step (NF4's own
~9 % relative error on the whole weight, not only on ``s B A``). Unmerge subtracts the same product.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.lora.config import PROJECTIONS, LoraConfig
from jaxgrad.ops.nf4 import NF4Weight, nf4_dequantize

__all__ = [
    "MODULE_GROUPS",
    "PEFT_KEY_PREFIX",
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "AdapterError",
    "lora_scale",
    "adapter_key",
    "resolve_target_modules",
    "parse_adapter_config",
    "adapter_config_json",
    "adapters_to_state_dict",
    "state_dict_to_adapters",
    "check_adapter_shapes",
    "save_adapter",
    "load_adapter",
    "merge_adapters",
    "unmerge_adapters",
]

#: The 7 projections of a Llama layer and the sub-module each lives in (Hugging Face names), in
#: :data:`jaxgrad.lora.config.PROJECTIONS` order.
MODULE_GROUPS: dict[str, str] = {name: group for group, name in PROJECTIONS}
#: PEFT's prefix of the layer stack for a ``LlamaForCausalLM`` wrapped by ``get_peft_model``.
PEFT_KEY_PREFIX = "base_model.model.model.layers"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_KEY_RE = re.compile(
    rf"^base_model\.model\.model\.layers\.(\d+)\.({'|'.join(dict.fromkeys(g for g, _ in PROJECTIONS))})\."
    rf"({'|'.join(n for _, n in PROJECTIONS)})\.(lora_A|lora_B)\.weight$"
)


class AdapterError(ValueError):
    """An adapter (config or weights) that this package cannot load as asked: the message names the key."""


# --------------------------------------------------------------------------------------------- config


#: Fields we implement (name -> PEFT's default).
_SUPPORTED_DEFAULTS: dict[str, Any] = {
    "r": 8,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "target_modules": None,
    "use_rslora": False,
    "init_lora_weights": True,
}
#: Fields that do not change the adapter's math: accepted with any value.
_METADATA_FIELDS = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "task_type",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "megatron_config",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "runtime_config",
        "layers_pattern",  # only meaningful together with layers_to_transform, which is checked
    }
)
#: Fields we do not implement: refused unless they hold the value given here (PEFT's default / "off").
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "bias": ("none",),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "exclude_modules": (None, [], ""),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "qalora_group_size": None,  # any value: meaningful only with use_qalora, which is checked
    "alora_invocation_tokens": (None, []),
    "arrow_config": (None,),
    "ensure_weight_tying": (False, None),
}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def lora_scale(r: int, lora_alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (a Python float)."""
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0:
        raise AdapterError(f"r must be a positive int, got {r!r}")
    return float(lora_alpha) / (math.sqrt(r) if use_rslora else r)


def parse_adapter_config(cfg: Mapping[str, Any], *, source: str = ADAPTER_CONFIG_NAME) -> dict[str, Any]:
    """Check a PEFT ``adapter_config.json`` (as a dict) and return our fields: ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``, ``use_rslora``, ``init_lora_weights``, ``base_model_name_or_path``.

    Raises :class:`AdapterError` naming the first unsupported field that carries a non-default value.
    """
    if not isinstance(cfg, Mapping):
        raise AdapterError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{source}: peft_type {peft_type!r} is not supported (only 'LORA')")
    for name, value in cfg.items():
        if name in _SUPPORTED_DEFAULTS or name in _METADATA_FIELDS or name == "peft_type":
            continue
        if name in _UNSUPPORTED_DEFAULTS:
            allowed = _UNSUPPORTED_DEFAULTS[name]
            if allowed is not None and value not in allowed:
                raise AdapterError(
                    f"{source}: field {name!r} = {value!r} is not supported (only {allowed[0]!r}); "
                    "it changes what the adapter computes or which weights it has"
                )
            continue
        if not _is_empty(value):
            raise AdapterError(f"{source}: unknown field {name!r} = {value!r}; refusing to ignore it")
    out = {k: cfg.get(k, d) for k, d in _SUPPORTED_DEFAULTS.items()}
    r = out["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{source}: r must be a positive int, got {r!r}")
    if not isinstance(out["lora_alpha"], (int, float)) or isinstance(out["lora_alpha"], bool):
        raise AdapterError(f"{source}: lora_alpha must be a number, got {out['lora_alpha']!r}")
    d = out["lora_dropout"]
    if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= d < 1.0:
        raise AdapterError(f"{source}: lora_dropout must be a number in [0, 1), got {d!r}")
    if not isinstance(out["use_rslora"], bool):
        raise AdapterError(f"{source}: use_rslora must be true or false, got {out['use_rslora']!r}")
    init = out["init_lora_weights"]
    if not (isinstance(init, bool) or init == "gaussian"):
        raise AdapterError(
            f"{source}: init_lora_weights {out['init_lora_weights']!r} is not supported (true, false or 'gaussian')"
        )
    tm = out["target_modules"]
    if tm is None:
        raise AdapterError(f"{source}: target_modules is missing (PEFT's per-architecture default is not guessed)")
    if not (isinstance(tm, str) or (isinstance(tm, list) and tm and all(isinstance(t, str) for t in tm))):
        raise AdapterError(f"{source}: target_modules must be a non-empty list of names or a regex string, got {tm!r}")
    out["base_model_name_or_path"] = cfg.get("base_model_name_or_path")
    return out


def resolve_target_modules(target_modules: str | list[str] | tuple[str, ...], n_layers: int) -> list[tuple[str, ...]]:
    """The targeted projections of each layer, PEFT's matching rules applied to the names
    ``model.layers.{i}.{self_attn|mlp}.{module}``: a list (or tuple) matches a name equal to an entry or ending in
    ``"." + entry``; a string is a regex that must match the whole name (``re.fullmatch``), except
    ``"all-linear"`` (all 7; PEFT leaves ``lm_head`` out). An entry of a list that matches nothing is an error,
    as is a target set that matches nothing at all."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
        raise AdapterError(f"n_layers must be a positive int, got {n_layers!r}")
    names = [[f"model.layers.{i}.{g}.{m}" for m, g in MODULE_GROUPS.items()] for i in range(n_layers)]
    modules = list(MODULE_GROUPS)
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            per_layer = [tuple(modules) for _ in range(n_layers)]
        else:
            try:
                pattern = re.compile(target_modules)
            except re.error as exc:
                raise AdapterError(f"target_modules: invalid regex {target_modules!r}: {exc}") from None
            per_layer = [tuple(m for m, n in zip(modules, layer) if pattern.fullmatch(n)) for layer in names]
    elif isinstance(target_modules, (list, tuple, set, frozenset)) and target_modules:
        entries = list(target_modules)
        for t in entries:
            if not isinstance(t, str) or not any(n == t or n.endswith("." + t) for layer in names for n in layer):
                raise AdapterError(
                    f"target_modules: {t!r} matches no module of a Llama layer (expected names among {modules})"
                )
        per_layer = [
            tuple(m for m, n in zip(modules, layer) if any(n == t or n.endswith("." + t) for t in entries))
            for layer in names
        ]
    else:
        raise AdapterError(
            f"target_modules must be a non-empty "
            f"list of names or a regex string, got {target_modules!r}"
        )
    if not any(per_layer):
        raise AdapterError(f"target_modules {target_modules!r} matches no projection of the model")
    return per_layer


def adapter_config_json(
    *,
    r: int,
    lora_alpha: float,
    target_modules: Any,
    lora_dropout: float = 0.0,
    use_rslora: bool = False,
    init_lora_weights: Any = True,
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT reads (every field it needs; the unsupported ones at their defaults)."""
    tm = target_modules
    if isinstance(tm, (list, tuple, set, frozenset)) and all(t in MODULE_GROUPS for t in tm):
        tm = sorted(tm, key=list(MODULE_GROUPS).index)  # projection order, as our LoraConfig lists them
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(r),
        "lora_alpha": lora_alpha,
        "lora_dropout": float(lora_dropout),
        "target_modules": list(tm) if not isinstance(tm, str) else tm,
        "use_rslora": bool(use_rslora),
        "init_lora_weights": init_lora_weights,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "inference_mode": True,
        "revision": None,
    }


# --------------------------------------------------------------------------------------------- weights


def adapter_key(layer: int, module: str, factor: str) -> str:
    """PEFT's safetensors key, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if module not in MODULE_GROUPS:
        raise AdapterError(f"module {module!r} is not a Llama projection (expected one of {list(MODULE_GROUPS)})")
    if factor not in ("lora_A", "lora_B"):
        raise AdapterError(f"factor must be 'lora_A' or 'lora_B', got {factor!r}")
    return f"{PEFT_KEY_PREFIX}.{layer}.{MODULE_GROUPS[module]}.{module}.{factor}.weight"


def _layers_of(adapters: Any, name: str = "adapters") -> list:
    if not isinstance(adapters, Mapping) or "layers" not in adapters:
        raise AdapterError(f"{name} must be {{'layers': [per-layer adapters, ...]}}, got {type(adapters).__name__}")
    layers = adapters["layers"]
    if not isinstance(layers, (list, tuple)):
        raise AdapterError(f"{name}['layers'] must be a list, got {type(layers).__name__}")
    return list(layers)


def adapters_to_state_dict(adapters: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{"layers": [...]}`` -> ``{peft_key: numpy array}`` (host copies, dtypes kept)."""
    out: dict[str, np.ndarray] = {}
    for i, layer in enumerate(_layers_of(adapters)):
        for group, modules in layer.items():
            for module, factors in modules.items():
                if MODULE_GROUPS.get(module) != group:
                    raise AdapterError(
                        f"adapters['layers'][{i}][{group!r}][{module!r}]: "
                        f"not a Llama projection of {group!r}"
                    )
                for factor in ("lora_A", "lora_B"):
                    if factor not in factors:
                        raise AdapterError(f"adapters['layers'][{i}][{group!r}][{module!r}] has no {factor!r}")
                    out[adapter_key(i, module, factor)] = np.asarray(factors[factor])
    if not out:
        raise AdapterError("adapters hold no LoRA weights")
    return out


def state_dict_to_adapters(tensors: Mapping[str, Any], n_layers: int, *, source: str = ADAPTER_WEIGHTS_NAME) -> dict:
    """``{peft_key: array}`` -> ``{"layers": [...]}`` with ``n_layers`` layers (layers without LoRA get ``{}``).

    Every key must be a LoRA A/B of one of the 7 projections of a layer ``< n_layers``; each module needs both.
    """
    layers: list[dict] = [{} for _ in range(n_layers)]
    for key, value in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise AdapterError(
                f"{source}: key {key!r} is not a LoRA weight of a Llama projection "
                f"(expected '{PEFT_KEY_PREFIX}.<i>.<self_attn|mlp>.<module>.lora_A|lora_B.weight')"
            )
        layer, group, module, factor = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if MODULE_GROUPS[module] != group:
            raise AdapterError(f"{source}: key {key!r}: {module} belongs to {MODULE_GROUPS[module]}, not {group}")
        if layer >= n_layers:
            raise AdapterError(f"{source}: key {key!r} is for layer {layer}, but the base model has {n_layers} layers")
        layers[layer].setdefault(group, {}).setdefault(module, {})[factor] = value
    for i, layer in enumerate(layers):
        for group, modules in layer.items():
            for module, factors in modules.items():
                for factor in ("lora_A", "lora_B"):
                    if factor not in factors:
                        raise AdapterError(f"{source}: {adapter_key(i, module, factor)!r} is missing")
    return {"layers": layers}


def _weight_shape(w: Any) -> tuple[int, ...]:
    return tuple(w.shape)


def check_adapter_shapes(adapters: Mapping[str, Any], params: Mapping[str, Any], r: int | None = None) -> None:
    """Every A must be ``[r, in]`` and every B ``[out, r]`` for the base weight ``W [out, in]`` it sits on;
    the error names the PEFT key, the shape found and the one expected."""
    base_layers = params["layers"] if isinstance(params, Mapping) and "layers" in params else None
    if base_layers is None:
        raise AdapterError("params must be a model pytree {'layers': [...], ...}")
    layers = _layers_of(adapters)
    if len(layers) != len(base_layers):
        raise AdapterError(f"adapters have {len(layers)} layers, the base model {len(base_layers)}")
    for i, (layer, base) in enumerate(zip(layers, base_layers)):
        for group, modules in layer.items():
            for module in modules:
                if MODULE_GROUPS.get(module) != group:
                    raise AdapterError(f"adapters['layers'][{i}][{group!r}][{module!r}]: not a Llama projection")
        for module, group in MODULE_GROUPS.items():  # projection order, so the first error is the natural one
            factors = layer.get(group, {}).get(module)
            if factors is None:
                continue
            where = f"adapters['layers'][{i}][{group!r}][{module!r}]"
            missing = [f for f in ("lora_A", "lora_B") if not isinstance(factors, Mapping) or f not in factors]
            if missing:
                raise AdapterError(f"{where} has no {missing[0]!r} (each adapted module needs 'lora_A' [r, in] and "
                                   f"'lora_B' [out, r])")
            try:
                out_f, in_f = _weight_shape(base[group][module]["weight"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise AdapterError(f"{where}: params has no 2-D weight model.layers.{i}.{group}.{module}.weight "
                                   f"for it") from None
            a, b = factors["lora_A"], factors["lora_B"]
            rank = r if r is not None else np.shape(a)[0]
            where = f"for base weight model.layers.{i}.{group}.{module}.weight {(out_f, in_f)}"
            if tuple(np.shape(a)) != (rank, in_f):
                raise AdapterError(
                    f"{adapter_key(i, module, 'lora_A')}: shape {tuple(np.shape(a))}, "
                    f"expected (r={rank}, in={in_f}) {where}"
                )
            if tuple(np.shape(b)) != (out_f, rank):
                raise AdapterError(
                    f"{adapter_key(i, module, 'lora_B')}: shape {tuple(np.shape(b))}, "
                    f"expected (out={out_f}, r={rank}) {where}"
                )


def _targets_of(adapters: Mapping[str, Any]) -> list[tuple[str, ...]]:
    return [
        tuple(m for m in MODULE_GROUPS if m in layer.get(MODULE_GROUPS[m], {}))
        for layer in _layers_of(adapters)
    ]


def save_adapter(
    directory: str | pathlib.Path,
    adapters: Mapping[str, Any],
    lora_config: Any,
    *,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's names and layouts) into
    ``directory`` (created if needed). ``lora_config``: an object or mapping with ``r``, ``lora_alpha``,
    ``target_modules`` and optionally ``lora_dropout``, ``use_rslora``, ``init_lora_weights``. The weights'
    targets must be what ``target_modules`` resolves to.

    A ``directory`` that already holds either file is refused (``FileExistsError`` naming it) unless
    ``overwrite=True``, which replaces those two files and nothing else (PEFT's ``save_pretrained`` overwrites
    without asking; here replacing a saved adapter is asked for). A ``directory`` that is an existing file is
    refused either way. Everything is checked before anything is written; each file is written to a temporary
    name in ``directory`` and then renamed over its target, so an interrupted save leaves no half-written file.
    """
    from safetensors.numpy import save_file

    fields = _lora_fields(lora_config)
    tensors = adapters_to_state_dict(adapters)
    n_layers = len(_layers_of(adapters))
    expected = resolve_target_modules(fields["target_modules"], n_layers)
    found = _targets_of(adapters)
    if expected != found:
        i = next(k for k in range(n_layers) if expected[k] != found[k])
        raise AdapterError(
            f"adapters' layer {i} has LoRA on {list(found[i])}, but target_modules "
            f"{fields['target_modules']!r} selects {list(expected[i])}"
        )
    for key, value in tensors.items():
        if value.ndim != 2 or (key.endswith("lora_A.weight") and value.shape[0] != fields["r"]) or (
            key.endswith("lora_B.weight") and value.shape[1] != fields["r"]
        ):
            raise AdapterError(f"{key}: shape {value.shape} does not have rank r={fields['r']} in the right place")
    directory = pathlib.Path(directory)
    _check_output_directory(directory, (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME), overwrite, "save_adapter",
                            "an adapter")
    cfg = adapter_config_json(**fields, base_model_name_or_path=base_model_name_or_path)
    with _replacing(directory / ADAPTER_CONFIG_NAME) as tmp:
        tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    with _replacing(directory / ADAPTER_WEIGHTS_NAME) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    return directory


def _check_output_directory(directory: pathlib.Path, names: Sequence[str], overwrite: bool, caller: str,
                            what: str) -> None:
    """Refuse (``FileExistsError``, naming the path) a ``directory`` that is a file or holds any of ``names``
    (unless ``overwrite``); then create it. Nothing is written or deleted here."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"{caller}: 'overwrite' must be True or False, got {overwrite!r}")
    for parent in (directory, *directory.parents):
        if parent.exists() and not parent.is_dir():
            raise FileExistsError(f"{caller}: {str(parent)!r} exists and is not a directory; {caller} writes "
                                  f"{what} into a directory (nothing was written)")
    if directory.is_dir() and not overwrite:
        present = [n for n in names if (directory / n).exists()]
        if present:
            listing = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
            raise FileExistsError(f"{caller}: {str(directory)!r} already holds {what} ({listing}); pass "
                                  f"overwrite=True to replace it, or choose another directory (nothing was written)")
    directory.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _replacing(path: pathlib.Path):
    """Yield a temporary path next to ``path``; rename it over ``path`` when the block succeeds, delete it
    otherwise (an interrupted save never leaves a half-written ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _lora_fields(lora_config: Any) -> dict[str, Any]:
    def get(name, default=None):
        if isinstance(lora_config, Mapping):
            return lora_config.get(name, default)
        return getattr(lora_config, name, default)

    targets = getattr(lora_config, "targets", None)  # jaxgrad.lora.config.LoraConfig: its resolved projections
    tm = [name for _, name in targets] if targets is not None else get("target_modules")
    if tm is None:
        raise AdapterError("lora_config has no target_modules")
    fields = {
        "r": get("r"),
        "lora_alpha": get("lora_alpha"),
        "lora_dropout": get("lora_dropout", 0.0),
        "target_modules": list(tm) if isinstance(tm, (list, tuple, set, frozenset)) else tm,
        "use_rslora": bool(get("use_rslora", False)),
        "init_lora_weights": get("init_lora_weights", True),
    }
    lora_scale(fields["r"], fields["lora_alpha"], fields["use_rslora"])  # validates r
    return fields


def load_adapter(
    directory: str | pathlib.Path,
    params: Mapping[str, Any] | None = None,
    *,
    n_layers: int | None = None,
    base_model_name_or_path: str | None = None,
    dtype: Any = None,
) -> tuple[dict, LoraConfig]:
    """Read a PEFT adapter directory. Returns ``(adapters, lora_config)``: ``adapters = {"layers": [...]}`` (JAX
    arrays, in ``dtype`` if given, else as stored) and a :class:`jaxgrad.lora.config.LoraConfig` whose
    ``target_modules`` are the projections PEFT's rules select (an explicit tuple of names).

    With ``params`` (the base model pytree) the shapes are checked against its weights (an adapter trained for a
    different model fails here, naming the key); ``n_layers`` defaults to the base's layer count. With
    ``base_model_name_or_path``, an adapter whose own ``base_model_name_or_path`` is set and different is refused.
    The keys must be exactly what ``target_modules`` selects: both factors of every targeted module, nothing else.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = pathlib.Path(directory)
    cfg_path, w_path = directory / ADAPTER_CONFIG_NAME, directory / ADAPTER_WEIGHTS_NAME
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"adapter directory {str(directory)!r} is a file; expected a directory holding "
                                 f"{ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}")
    if not directory.is_dir():
        raise FileNotFoundError(f"adapter directory {str(directory)!r} does not exist")
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(cfg_path)!r} is missing (a PEFT adapter needs {ADAPTER_CONFIG_NAME})")
    if not w_path.is_file():
        alt = directory / "adapter_model.bin"
        hint = ""
        if alt.exists():
            hint = " (adapter_model.bin, a pickle, is not read: re-save with safe_serialization=True)"
        raise FileNotFoundError(f"{str(w_path)!r} is missing{hint}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{cfg_path}: not valid JSON: {exc}") from None
    fields = parse_adapter_config(raw, source=str(cfg_path))
    theirs = fields["base_model_name_or_path"]
    if base_model_name_or_path and theirs and theirs != base_model_name_or_path:
        raise AdapterError(
            f"{cfg_path}: base_model_name_or_path is {theirs!r}, but the base model is {base_model_name_or_path!r}"
        )
    if params is not None:
        if not isinstance(params, Mapping) or not isinstance(params.get("layers"), (list, tuple)):
            raise AdapterError(f"load_adapter: 'params' must be the base model pytree {{'layers': [...], ...}}, got "
                               f"{type(params).__name__}")
        n_layers = len(params["layers"])
    elif n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0):
        raise AdapterError(f"load_adapter: 'n_layers' must be a positive int, got {n_layers!r}")
    try:
        if n_layers is None:
            n_layers = 1 + max((int(m.group(1)) for k in _safe_keys(w_path) if (m := _KEY_RE.match(k))), default=-1)
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{w_path}: not a readable safetensors file ({exc}); expected PEFT's "
                           f"{ADAPTER_WEIGHTS_NAME}") from None
    if not tensors:
        raise AdapterError(f"{w_path}: holds no tensors; expected the LoRA weights "
                           f"'{PEFT_KEY_PREFIX}.<i>.<self_attn|mlp>.<module>.lora_A|lora_B.weight'")
    for key, value in tensors.items():
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise AdapterError(f"{w_path}: {key!r} has dtype {value.dtype}; LoRA weights are floating point")
    adapters = state_dict_to_adapters(tensors, n_layers, source=str(w_path))
    expected = resolve_target_modules(fields["target_modules"], n_layers)
    found = _targets_of(adapters)
    for i, (e, f) in enumerate(zip(expected, found)):
        for module in e:
            if module not in f:
                raise AdapterError(
                    f"{w_path}: {adapter_key(i, module, 'lora_A')!r} "
                    f"is missing (target_modules selects it)"
                )
        for module in f:
            if module not in e:
                raise AdapterError(
                    f"{w_path}: {adapter_key(i, module, 'lora_A')!r} is present, but target_modules "
                    f"{fields['target_modules']!r} does not select it"
                )
    for key, value in adapters_to_state_dict(adapters).items():
        rank_axis = 0 if key.endswith("lora_A.weight") else 1
        if value.ndim != 2 or value.shape[rank_axis] != fields["r"]:
            raise AdapterError(
                f"{w_path}: {key!r} has shape "
                f"{value.shape}, expected rank r={fields['r']} on axis {rank_axis}"
            )
    if params is not None:
        check_adapter_shapes(adapters, params, r=fields["r"])
    if len(set(expected)) > 1:
        raise AdapterError(
            f"{cfg_path}: target_modules {fields['target_modules']!r} selects different projections in different "
            f"layers ({[list(e) for e in expected]}); jaxgrad's LoraConfig applies one set to every layer"
        )
    adapters = jax.tree_util.tree_map(lambda x: jnp.asarray(x) if dtype is None else jnp.asarray(x, dtype), adapters)
    try:
        lora_config = LoraConfig(
            r=fields["r"],
            lora_alpha=fields["lora_alpha"],
            lora_dropout=fields["lora_dropout"],
            target_modules=tuple(expected[0]),
            use_rslora=fields["use_rslora"],
            init_lora_weights=fields["init_lora_weights"],
        )
    except ValueError as exc:
        raise AdapterError(f"{cfg_path}: {exc}") from None
    return adapters, lora_config


def _safe_keys(path: pathlib.Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return list(f.keys())


# --------------------------------------------------------------------------------------------- merge


def _merge_one(w: Any, a: Any, b: Any, scale: float, sign: float, where: str) -> jax.Array:
    """``W + sign * ((B @ A) * scale)`` in at least float32, finite-checked, cast back to W's dtype."""
    out_dtype = jnp.dtype(w.dtype)
    w_full = nf4_dequantize(w, jnp.float32) if isinstance(w, NF4Weight) else jnp.asarray(w)
    merged, finite = _merge_dense(w_full, jnp.asarray(a), jnp.asarray(b), signed_scale=sign * scale,
                                  out_dtype=out_dtype)
    if not bool(finite):
        raise FloatingPointError(f"{where}: merging the adapter gives non-finite values (inf/nan); weights untouched")
    return merged


@functools.partial(jax.jit, static_argnames=("signed_scale", "out_dtype"))
def _merge_dense(w, a, b, *, signed_scale: float, out_dtype):
    """``W + (B @ A) * signed_scale`` (PEFT's ``get_delta_weight`` order) in ``promote_types(out_dtype, f32)`` at
    full matmul precision, cast to ``out_dtype``, and whether it is all finite (checked before the cast)."""
    compute = jnp.promote_types(out_dtype, jnp.float32)
    delta = jnp.matmul(b.astype(compute), a.astype(compute), precision=jax.lax.Precision.HIGHEST)
    scaled = jax.lax.optimization_barrier(delta * jnp.asarray(signed_scale, compute))  # no FMA: round as PEFT does
    merged = w.astype(compute) + scaled
    return merged.astype(out_dtype), jnp.all(jnp.isfinite(merged))


def _apply(params: Mapping[str, Any], adapters: Mapping[str, Any], scale: float, sign: float) -> dict:
    check_adapter_shapes(adapters, params)
    new_layers = []
    for i, (base, layer) in enumerate(zip(params["layers"], _layers_of(adapters))):
        base = {g: (dict(v) if isinstance(v, Mapping) else v) for g, v in base.items()}
        for group, modules in layer.items():
            base[group] = {m: dict(v) for m, v in base[group].items()}
            for module, f in modules.items():
                where = f"model.layers.{i}.{group}.{module}.weight"
                base[group][module]["weight"] = _merge_one(
                    base[group][module]["weight"], f["lora_A"], f["lora_B"], scale, sign, where
                )
        new_layers.append(base)
    return {**params, "layers": new_layers}


def _scale_of(lora_config: Any) -> float:
    if isinstance(lora_config, LoraConfig):
        return float(lora_config.scale)
    if isinstance(lora_config, (int, float)) and not isinstance(lora_config, bool):
        return float(lora_config)
    raise TypeError(f"lora_config must be a LoraConfig or the scale s (a float), got {type(lora_config).__name__}")


def merge_adapters(params: Mapping[str, Any], adapters: Mapping[str, Any], lora_config: LoraConfig | float) -> dict:
    """A new model pytree with ``W + s B A`` on every projection that has an adapter (see the module
    docstring: fp32, inf check, cast; NF4 weights come back dequantised, in their original dtype).
    ``lora_config``: a :class:`LoraConfig` (its ``scale``) or the scale itself."""
    return _apply(params, adapters, _scale_of(lora_config), 1.0)


def unmerge_adapters(params: Mapping[str, Any], adapters: Mapping[str, Any], lora_config: LoraConfig | float) -> dict:
    """The inverse of :func:`merge_adapters`: ``W - s B A`` (exact up to the rounding of the two casts; an NF4
    base does not come back quantised: re-quantise explicitly if wanted, a lossy step)."""
    return _apply(params, adapters, _scale_of(lora_config), -1.0)
