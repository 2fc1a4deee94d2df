r"""Merge a PEFT adapter into its base and export a Hugging Face folder: ``jaxgrad merge``.

    jaxgrad merge --base runs/ex/base/model --adapter runs/ex/qlora/adapter --out runs/ex/merged-qlora

The merged model is one ``LlamaForCausalLM`` checkpoint (``config.json``, ``model.safetensors``) with, on every
projection the adapter targets,

.. math::

    W' = W_\text{trained} + s\,B A, \qquad s = \text{lora\_alpha} / r \;(\text{or } / \sqrt r \text{ with rsLoRA}),

computed in float32 (:func:`jaxgrad.lora.peft.merge_adapters`), plus the base folder's tokenizer files, copied as
they are. :math:`W_\text{trained}` is the weight the adapter was trained against:

* LoRA: the base weight :math:`W` as stored;
* QLoRA: :math:`\operatorname{dequant}(\operatorname{quant}_\text{NF4}(W))` with the run's block size and double
  quantisation. Merging onto the 16-bit originals instead gives a model that was never trained: it differs from the
  fine-tuned one by the whole quantisation error of every projection (about 9 % of each weight), far more than the
  adapter's own change.

Nothing in PEFT's ``adapter_config.json`` says whether the base was quantised, so the setting comes from the run
that trained the adapter: an ``--adapter`` folder written by ``jaxgrad train lora`` sits in its run folder, whose
``run.json`` holds the run's ``model.mode``, ``nf4_blocksize`` and ``double_quant``. ``--nf4`` / ``--dense``
(``nf4=True / False``) and ``--nf4-blocksize`` / ``--double-quant`` give it for an adapter from elsewhere; given
with a run that says otherwise, they are refused (naming both), since either way one of them is wrong.

The merged weights are written in ``dtype`` (default: the base's stored dtype of the embedding).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TOKENIZER_FILES", "run_quantization", "merge_adapter_folder"]

#: the base folder's tokenizer files that the merged folder gets (those that exist; ``additional_chat_templates``
#: is a folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json", "additional_chat_templates")
RUN_OWNER = "jaxgrad train lora"


def run_quantization(adapter: str | pathlib.Path) -> dict | None:
    """How the run that wrote ``adapter`` held its base: ``{"nf4": bool, "blocksize": int, "double_quant": bool,
    "dtype": str, "run": path}`` from the ``run.json`` of the folder above ``adapter`` (a ``jaxgrad train lora``
    run), or ``None`` where there is no such run file."""
    run_file = pathlib.Path(adapter).expanduser().resolve().parent / "run.json"
    if not run_file.is_file():
        return None
    try:
        run = json.loads(run_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"merge: {run_file}: not a valid run file ({err})") from None
    if not isinstance(run, dict) or run.get("script") != RUN_OWNER:
        return None
    model = run.get("config", {}).get("model", {})
    mode = model.get("mode")
    if mode not in ("lora", "qlora"):
        raise ValueError(f"merge: 'adapter' {adapter}: its run ({run_file}) has model.mode {mode!r}, which trains "
                         f"no adapter")
    return {"nf4": mode == "qlora", "blocksize": int(model.get("nf4_blocksize", 64)),
            "double_quant": bool(model.get("double_quant", False)), "dtype": model.get("dtype", "float32"),
            "run": str(run_file)}


def _resolve_quantization(adapter, nf4, blocksize, double_quant) -> dict:
    """The quantisation to merge onto: the run's, checked against the explicit arguments, else the arguments."""
    run = run_quantization(adapter)
    if run is None:
        if not nf4 and (blocksize is not None or double_quant):
            raise ValueError("merge: --nf4-blocksize / --double-quant (blocksize, double_quant) describe an NF4 base; "
                             "give --nf4 (nf4=True) with them, or leave them out for a dense base")
        return {"nf4": bool(nf4), "blocksize": 64 if blocksize is None else blocksize,
                "double_quant": bool(double_quant), "dtype": None, "source": "arguments" if nf4 else "default (dense)"}
    given = {"nf4": nf4, "blocksize": blocksize, "double_quant": double_quant}
    flags = {"nf4": "--nf4/--dense (nf4)", "blocksize": "--nf4-blocksize (blocksize)",
             "double_quant": "--double-quant (double_quant)"}
    for key, value in given.items():
        if value is not None and (run["nf4"] or key == "nf4") and value != run[key]:
            raise ValueError(f"merge: {flags[key]} = {value!r}, but the run that trained the adapter ({run['run']}) "
                             f"has {key} = {run[key]!r}; merging onto another base than the one trained gives a "
                             f"different model (leave it unset to take the run's)")
    if not run["nf4"] and (blocksize is not None or double_quant):
        raise ValueError(f"merge: --nf4-blocksize / --double-quant given, but the run that trained the adapter "
                         f"({run['run']}) had a dense base (mode lora)")
    return {**run, "source": run["run"]}


def _check_out(base: pathlib.Path, out: pathlib.Path, overwrite: bool) -> None:
    if out.exists() and out.resolve() == base.resolve():
        raise ValueError(f"merge: 'out' {out} is the base folder; write the merged model to another folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"merge: 'out' {out} exists and is not a folder")
    if out.is_dir() and not overwrite:
        present = sorted(p.name for p in out.iterdir())
        if present:
            raise FileExistsError(f"merge: 'out' {out} is not empty ({', '.join(present[:4])}"
                                  f"{' ...' if len(present) > 4 else ''}); pass --overwrite (overwrite=True) to "
                                  f"replace the merged model in it, or choose another folder")


def _stored_dtype(base: pathlib.Path):
    """The dtype of the base's embedding as stored (the merged model's default dtype)."""
    from jaxgrad.lora.hf import _read_weights

    return jnp.dtype(_read_weights(base)["model.embed_tokens.weight"].dtype)


def merge_adapter_folder(base: str | pathlib.Path, adapter: str | pathlib.Path, out: str | pathlib.Path, *,
                         dtype: Any = None, nf4: bool | None = None, blocksize: int | None = None,
                         double_quant: bool | None = None, overwrite: bool = False) -> dict:
    """Merge the PEFT adapter folder ``adapter`` into the HF checkpoint folder ``base`` and write the merged model,
    with the base's tokenizer files, to ``out`` (module docstring). ``nf4`` / ``blocksize`` / ``double_quant``:
    ``None`` takes the training run's (else dense); ``dtype``: the merged weights' dtype (default the base's).

    Returns ``{"out", "nf4", "blocksize", "double_quant", "source", "scale", "merged_modules", "dtype",
    "tokenizer_files"}``. Errors name the argument: a missing folder (``FileNotFoundError``), an adapter that does
    not fit the base (:class:`~jaxgrad.lora.peft.AdapterError`, a ``ValueError``), a setting that contradicts the
    run, an ``out`` that is the base or is not empty without ``overwrite`` (``FileExistsError``)."""
    from jaxgrad.lora.hf import load_hf_checkpoint, save_hf_checkpoint
    from jaxgrad.lora.peft import load_adapter, merge_adapters

    base, adapter, out = (pathlib.Path(p).expanduser() for p in (base, adapter, out))
    for name, path in (("base", base), ("adapter", adapter)):
        if not path.is_dir():
            raise FileNotFoundError(f"merge: '{name}' {path} is not a folder")
    if blocksize is not None and (isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1):
        raise ValueError(f"merge: 'blocksize' must be a positive int or None, got {blocksize!r}")
    _check_out(base, out, overwrite)
    q = _resolve_quantization(adapter, nf4, blocksize, double_quant)
    # quantise from the weights as the run held them (its model.dtype) so that the NF4 codes are the trained ones
    load_dtype = jnp.dtype(q["dtype"]) if q.get("dtype") else None
    cfg, params = load_hf_checkpoint(base, dtype=load_dtype, quantize="nf4" if q["nf4"] else None,
                                     blocksize=q["blocksize"], double_quant=q["double_quant"])
    out_dtype = jnp.dtype(dtype) if dtype is not None else _stored_dtype(base)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"merge: 'dtype' must be a floating dtype, got {dtype!r}")
    lora, lcfg = load_adapter(adapter, params)
    merged = merge_adapters(params, lora, lcfg)
    merged = jax.tree.map(lambda w: np.asarray(jnp.asarray(w).astype(out_dtype)), merged)
    save_hf_checkpoint(out, cfg, merged, overwrite=overwrite)
    copied = []
    for name in TOKENIZER_FILES:
        src = base / name
        if src.is_dir():
            shutil.copytree(src, out / name, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, out / name)
        else:
            continue
        copied.append(name)
    n_modules = sum(len(group) for layer in lora["layers"] for group in layer.values())
    return {"out": str(out), "nf4": q["nf4"], "blocksize": q["blocksize"] if q["nf4"] else None,
            "double_quant": q["double_quant"] if q["nf4"] else None, "source": q["source"], "scale": lcfg.scale,
            "merged_modules": n_modules, "dtype": str(out_dtype), "tokenizer_files": copied}
