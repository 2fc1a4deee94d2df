r"""The LoRA / QLoRA Llama sharded over a mesh's ``fsdp`` axis (fully sharded data parallelism on JAX's SPMD engine).

What lies where, on a mesh ``("data", "fsdp")`` of ``D x F`` devices (:func:`jaxgrad.train.mesh.train_mesh`):

* **The frozen base.** Every matrix (the embedding, the LM head, the 7 projections of every layer) is split along
  its largest axis that ``F`` divides (:func:`jaxgrad.train.mesh.shard_axis`); a matrix with no such axis and the
  RMSNorm vectors stay whole. So a device holds about ``1/F`` of the base.
* **NF4 (QLoRA).** A projection is stored as bitsandbytes' bytes (:class:`jaxgrad.ops.nf4.NF4Weight`): the packed
  4-bit codes, the absmax per block (float32, or uint8 codes with their ``absmax2`` and ``offset`` when
  double-quantised). Each of these 1-D arrays is split over ``fsdp`` where ``F`` divides its length (at real sizes
  all but the tiny ``absmax2`` and ``offset``, which stay whole), so a gather moves the 4-bit data and its scales,
  never dequantised weights.
* **The adapters and the optimiser state**: whole on every device, or split like the base
  (``shard_trainable``: the engine gathers them before the loss and reduce-scatters their gradients).
* **The batch** is split over all ``D F`` devices.

The step (:func:`jaxgrad.train.grads.plan_sum_loss`) runs, per device and inside :func:`jax.shard_map`, the model on
the device's rows: the embedding and the head are all-gathered once, and layer ``i``'s projection weights reach its
block as :class:`~jaxgrad.train.mesh.GatheredWeight` -- the device's shards, all-gathered
(:func:`jax.lax.all_gather` over ``fsdp``) where the block uses them: its Pallas / Mosaic kernels and cuDNN
attention see plain whole arrays, exactly as on one device. The block's custom VJP saves the shards, not the whole
weights; its backward's recompute shares the forward's gathered weights (XLA merges the two identical
computations, as on one device), and its ``dY W`` products gather the layer again (tied to ``dY`` by an
optimisation barrier), so no layer's whole weights are kept from the forward through the layers after it. In the
forward a layer's shards wait, by another barrier, for the previous layer's input (its own with no ``fsdp`` split),
so that its gather may overlap the layer before it but no earlier one. At most about two layers' full weights
(plus the embedding and the head) are alive at a time, and the step does the arithmetic of one device's (measured
on the CPU: ``tests/test_lora_sharding.py``). A checkpointing policy puts each layer under ``jax.checkpoint`` as on
one device, with a policy that never saves a gather's output; so does the reference path (``jax.grad`` of the plain
block, which would save the gathered weights), which gathers before the block. The
gradient of the adapters is the ``psum`` over the mesh of the per-device gradients (``psum_scatter`` over ``fsdp``
then ``psum`` over ``data`` when they are sharded): the same sum as on one device, in another order, equal to 1e-12
in float64.

:func:`make_sharded_task` builds the :class:`~jaxgrad.train.Task` and its :class:`~jaxgrad.train.mesh.ShardPlan`
from a :class:`~jaxgrad.lora.task_config.LoraFit`; its parameters are the same tree as
:func:`jaxgrad.lora.task.make_task`'s (the NF4 projections are the plan's constants, not params), so a checkpoint
of either layout resumes on the other.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxgrad.lora.config import CHECKPOINT_POLICIES
from jaxgrad.lora.hf import quantize_projections
from jaxgrad.lora.model import apply, causal_lm_loss, head_weight, hidden_states
from jaxgrad.lora.task import _packing_args, load_base, load_tokenizer_of, lora_mask, make_task, model_config
from jaxgrad.lora.task_config import LoraFit, resolve_path
from jaxgrad.ops.lm_head_loss import backend_beside, lm_head_loss
from jaxgrad.ops.nf4 import NF4Weight
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.grads import plan_sum_loss
from jaxgrad.train.mesh import (ShardPlan, axis_spec, fsdp_size, gather, gathered_weight, put, shard_axis,
                                shard_batch, spec_axis)
from jaxgrad.train.precision import Policy
from jaxgrad.train.step import split_trainable
from jaxgrad.train.task import Task

__all__ = ["cli_task", "make_sharded_task", "param_specs", "gather_nf4", "gather_policy", "nf4_specs"]

_GATHERS = ("all_gather", "all_gather_invariant")  # outputs the layer's checkpoint saves only to keep them
_PROJ_GROUPS = ("self_attn", "mlp")


# ------------------------------------------------------------------------------------------------------ layout


def param_specs(params, n: int):
    """A ``PartitionSpec`` per leaf: matrices split along :func:`~jaxgrad.train.mesh.shard_axis` over ``n`` fsdp
    devices, vectors and scalars whole."""
    def spec(x):
        shape = np.shape(x)
        return axis_spec(len(shape), shard_axis(shape, n) if len(shape) >= 2 else None)
    return jax.tree.map(spec, params)


def nf4_specs(w: NF4Weight, n: int) -> NF4Weight:
    """The specs of an NF4 weight's leaves over ``n`` fsdp devices: each 1-D leaf split where ``n`` divides its
    length, else whole (as the scalar offset)."""
    def one(x):
        return None if x is None else axis_spec(np.ndim(x), shard_axis(np.shape(x), n))
    return dataclasses.replace(w, packed=one(w.packed), absmax=one(w.absmax), absmax2=one(w.absmax2),
                               offset=one(w.offset))


def gather_nf4(w: NF4Weight, specs: NF4Weight) -> NF4Weight:
    """Inside ``shard_map``: the whole NF4 weight from its shards (the 4-bit bytes and the scales gathered)."""
    return jax.tree.map(gather, w, specs)


def _gather_tree(tree, specs):
    """Every leaf of ``tree`` whole (NF4 weights by :func:`gather_nf4`)."""
    def one(x, spec):
        return gather_nf4(x, spec) if isinstance(x, NF4Weight) else gather(x, spec)
    return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, NF4Weight))


def _lazy_layer(layer: dict, specs: dict, fsdp: int, reshard_after_forward: bool = True) -> dict:
    """The layer with its projection weights as :class:`~jaxgrad.train.mesh.GatheredWeight` (gathered inside the
    block where each is used, in the forward and, with ``reshard_after_forward``, again in the backward) and its
    other weights (the norms, whole) gathered now."""
    is_nf4 = lambda x: isinstance(x, NF4Weight)  # noqa: E731
    return {k: (jax.tree.map(lambda x, s: gathered_weight(x, s, fsdp, reshard_after_forward), v, specs[k],
                             is_leaf=is_nf4)
                if k in _PROJ_GROUPS else _gather_tree(v, specs[k])) for k, v in layer.items()}


def gather_policy(gradient_checkpointing: str, reshard_after_forward: bool = True):
    """The ``jax.checkpoint`` policy of a layer's gather-and-block: the model's ``gradient_checkpointing`` policy,
    except that an ``all_gather``'s output (the layer's whole weights) is never saved: the backward gathers the
    layer again, so the forward does not keep every layer's whole weights until the backward. With
    ``reshard_after_forward`` false it is always saved instead (the backward uses the forward's gather)."""
    if gradient_checkpointing not in CHECKPOINT_POLICIES:
        raise ValueError(f"gather_policy: 'gradient_checkpointing' must be one of {CHECKPOINT_POLICIES}, got "
                         f"{gradient_checkpointing!r}")
    cp = jax.checkpoint_policies
    user = {"none": cp.everything_saveable, "full": cp.nothing_saveable}.get(gradient_checkpointing) \
        or getattr(cp, gradient_checkpointing)

    def policy(prim, *args, **params):
        if prim.name in _GATHERS:
            return not reshard_after_forward
        return user(prim, *args, **params)
    return policy


# ------------------------------------------------------------------------------------------------------ loss


def _split_projections(base: dict) -> tuple[dict, list]:
    rest, projs = [], []
    for layer in base["layers"]:
        rest.append({k: v for k, v in layer.items() if k not in _PROJ_GROUPS})
        projs.append({g: layer[g] for g in _PROJ_GROUPS})
    return {**base, "layers": rest}, projs


def _sharded_loss(fit: LoraFit, cfg, lcfg, path, specs, consts_specs, reference: bool, fsdp: int,
                  reshard_after_forward: bool = True):
    """The per-device loss ``(params, consts, batch[, key]) -> (S, n)`` on a device's shards (module docstring).
    A layer's projection weights reach its block as :class:`~jaxgrad.train.mesh.GatheredWeight`: the block's VJP
    saves their shards and gathers where it uses them, so the layers need no ``jax.checkpoint`` (which would make
    each block's backward recompute its whole forward, ``block_recompute="all"``'s work, instead of the VJP's shared
    recompute) unless the model asks for a checkpointing policy; the reference path (``jax.grad`` of the plain
    block) gathers before the block, under ``jax.checkpoint`` when ``fsdp > 1``."""
    base_specs = specs["base"]
    policy = gather_policy(cfg.gradient_checkpointing, reshard_after_forward)
    remat = cfg.gradient_checkpointing != "none" or (reference and fsdp > 1)
    attention = ("xla" if path.attention == "pallas" else path.attention) if reference else path.attention
    backend = "reference" if reference else path.backend

    def loss(params, consts, batch, key=None):
        base = params["base"]
        layers, layer_specs = base["layers"], base_specs["layers"]
        if consts is not None:  # the NF4 projections, the plan's constants
            layers = [{**lay, **c} for lay, c in zip(layers, consts, strict=True)]
            layer_specs = [{**s, **cs} for s, cs in zip(layer_specs, consts_specs, strict=True)]
        whole = {k: (v if k == "layers" else jax.tree.map(gather, v, base_specs[k])) for k, v in base.items()}
        whole["layers"] = layers

        inputs = []  # the layers' inputs, in the order the model calls them

        def layer_call(i, fn, layer, layer_lora, h, k):
            # a layer's gather and NF4 dequantisation depend on its weights alone: left free, the scheduler may run
            # every layer's at the start of the step and hold them all. Tied by a barrier to an earlier input: with
            # fsdp > 1 the previous layer's, so that the gather can overlap that layer's compute (a second layer's
            # whole weights alive meanwhile); without gathers the layer's own, as on one device
            anchor = inputs[-1] if fsdp > 1 and inputs else h
            inputs.append(h)
            _, layer = jax.lax.optimization_barrier((anchor, layer))

            def run(layer, layer_lora, h, k):
                if reference:  # jax.grad of the plain block would save the gathered weights: jax.checkpoint drops them
                    return fn(_gather_tree(layer, layer_specs[i]), layer_lora, h, k)
                return fn(_lazy_layer(layer, layer_specs[i], fsdp, reshard_after_forward), layer_lora, h, k)
            if not remat:
                return run(layer, layer_lora, h, k)
            return jax.checkpoint(run, policy=policy)(layer, layer_lora, h, k)

        kwargs = dict(backend=backend, attention=attention, dropout_key=key, layer_call=layer_call,
                      **_packing_args(batch))
        n = jnp.sum(batch["n_items"])
        if reference or fit.loss == "logits":
            logits = apply(whole, params["lora"], batch["input_ids"], cfg, lcfg, **kwargs)
            return causal_lm_loss(logits, batch["labels"], 1), n
        h = hidden_states(whole, params["lora"], batch["input_ids"], cfg, lcfg, **kwargs)
        s, _ = lm_head_loss(h, head_weight(whole, cfg).astype(h.dtype), batch["labels"],
                            chunk_tokens=fit.loss_chunk_tokens, head_grad=False,  # LoRA modes: the head is frozen
                            backend=backend_beside(backend, h.dtype, False))
        return s, n

    return loss


# ------------------------------------------------------------------------------------------------------ task


def _pad_rows(batch: dict, multiple: int) -> dict:
    """``batch`` with rows appended up to a multiple of ``multiple``: copies of its first row that count nothing
    (labels all ignored, ``n_items`` 0), so an evaluation batch splits over the mesh without changing its sums."""
    b = len(batch["input_ids"])
    extra = (-b) % multiple
    if not extra:
        return batch
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        fill = np.repeat(v[:1], extra, axis=0)
        if k == "labels":
            fill = np.full_like(fill, -100)
        elif k == "n_items":
            fill = np.zeros_like(fill)
        out[k] = np.concatenate([v, fill])
    return out


def _on_host(fn):
    """``fn()`` with JAX's default device the host's CPU (when JAX has one): a base read or initialised there never
    sits whole on an accelerator."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return fn()
    with jax.default_device(cpu):
        return fn()


def make_sharded_task(fit: LoraFit, mesh, *, grad_path: str = "custom_vjp", device=None, base_params=None,
                      shard_trainable: bool = False, reshard_after_forward: bool = True) -> tuple[Task, ShardPlan]:
    """``(task, plan)``: :func:`jaxgrad.lora.task.make_task`'s task with its base laid out over ``mesh``'s
    ``fsdp`` axis (module docstring) and an evaluation that runs sharded too. Train it with
    ``jaxgrad.train.fit(task, cfg, out, mesh=mesh, plan=plan)``.

    ``reshard_after_forward`` (default true): each layer's projection weights are gathered again for the backward's
    ``dY W``, so no layer's whole weights live from the forward to the backward. False: the backward uses the
    forward's gathered (and, for NF4, dequantised) weights, as on one device: one gather a layer a step and no
    second dequantisation, for every layer's whole weights alive from its forward to its backward (peak memory near
    the ``data`` layout's; the base at rest stays split).

    ``base_params``: the frozen base (default: :func:`jaxgrad.lora.task.load_base`, read on the host's CPU), taken
    to the host so that no device holds more than its shards (each process holds the whole base in host memory). Mode ``"full"`` (every weight trained) is refused: it has no frozen base."""
    if fit.mode == "full":
        raise ConfigError("mesh.axes with 'fsdp' shards the frozen base of model.mode 'lora' or 'qlora'; mode 'full' "
                          "trains every weight: use mesh.axes = 'data'")
    n = fsdp_size(mesh)
    path = resolve_path(fit, grad_path, device)
    tokenizer = load_tokenizer_of(fit)
    cfg = model_config(fit, tokenizer, base_params)
    lcfg = fit.lora_config()
    base = _on_host(lambda: load_base(fit, cfg)) if base_params is None else base_params
    if fit.mode == "qlora":
        base = quantize_projections(base, blocksize=fit.nf4_blocksize, double_quant=fit.double_quant)
    base = jax.device_get(base)  # host arrays: each device receives only its shards
    task = make_task(fit, base_params=base, grad_path=grad_path, device=device)
    consts = consts_specs = None
    if fit.mode == "qlora":
        _, projs = _split_projections(base)
        is_nf4 = lambda x: isinstance(x, NF4Weight)  # noqa: E731
        consts_specs = jax.tree.map(lambda w: nf4_specs(w, n), projs, is_leaf=is_nf4)
        shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), consts_specs,
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
        consts = put(projs, shardings)
    abstract = jax.eval_shape(task.init, jax.random.key(0))
    specs = param_specs(abstract, n)
    plan_kwargs = dict(consts=consts, consts_specs=consts_specs, shard_trainable=shard_trainable)
    specs_fn = (lambda reference: _sharded_loss(fit, cfg, lcfg, path, specs, consts_specs, reference, n,
                                                reshard_after_forward))
    plan = ShardPlan(param_specs=specs, loss=specs_fn(False), reference_loss=specs_fn(True),
                     describe=_describe(abstract, specs, consts, n, shard_trainable)
                     + ("" if reshard_after_forward or n == 1 else "; gathered weights kept for the backward"),
                     **plan_kwargs)
    return dataclasses.replace(task, evaluate=_sharded_evaluate(task, plan, mesh, grad_path)), plan


def _sharded_evaluate(task: Task, plan: ShardPlan, mesh, grad_path: str):
    """The held-out loss with the run's sharded path, forward only (no dropout)."""
    if task.evaluate is None:
        return None
    total = jax.jit(plan_sum_loss(plan, mesh, Policy(), grad_path=grad_path))
    data = _eval_batches(task)
    rows = math.prod(mesh.shape[a] for a in mesh.axis_names)

    def evaluate(params):
        s = n = 0.0
        tf = split_trainable(params, lora_mask(params))
        for batch in data():
            si, ni = total(tf, plan.consts, shard_batch(_pad_rows(batch, rows), mesh))
            s, n = s + float(si), n + float(ni)
        mean = s / n
        return {"heldout_loss": mean, "heldout_perplexity": math.exp(mean), "heldout_tokens": int(n)}

    return evaluate


def _eval_batches(task: Task):
    """The task's held-out batches (its data object's ``eval_batches``, reached through its ``batches`` method)."""
    data = getattr(task.batches, "__self__", None)
    if data is None or not hasattr(data, "eval_batches"):
        raise TypeError("make_sharded_task: the task's data has no eval_batches()")
    return data.eval_batches


def _describe(abstract, specs, consts, n: int, shard_trainable: bool) -> str:
    def per_device(tree, specs_tree):
        total = 0
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs_tree, is_leaf=lambda v: isinstance(
                v, PartitionSpec))):
            axis = spec_axis(s)
            size = int(np.prod(x.shape)) // (n if axis is not None else 1)
            total += size * np.dtype(x.dtype).itemsize
        return total
    base = per_device(abstract["base"], specs["base"])
    whole = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract["base"]))
    nf4 = 0 if consts is None else sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                                       for x in jax.tree.leaves(consts))
    return (f"fsdp {n}: frozen base {_size(base)} per device (of {_size(whole)})"
            + (f" + NF4 projections {_size(nf4)} per device" if consts is not None else "")
            + f"; adapters and optimiser state {'sharded' if shard_trainable else 'replicated'}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def plan_on_data_mesh(cfg: dict) -> bool:
    """Whether ``jaxgrad train lora`` on ``mesh.axes = "data"`` takes this module's path (an ``fsdp`` axis of 1:
    every device holds the whole base, as the plain data path does): for QLoRA. Its NF4 projections are then the
    plan's constants, arguments of every step; :func:`jaxgrad.lora.task.make_task`'s loss closes over them, and JAX
    compiles a closed-over array into the program as a constant (the NF4 bytes of Llama-3.1-8B are 3.5 GB)."""
    return cfg["model"]["mode"] == "qlora"


def cli_task(cfg: dict, out, say, mesh, shard_trainable: bool = False):
    """``(task, finish, plan)`` for ``jaxgrad train lora`` on a layout with ``fsdp`` (``mesh.axes``): as
    :func:`jaxgrad.lora.task.cli_task`, with the model sharded over ``mesh`` (:func:`make_sharded_task`).
    ``finish`` writes the adapter (PEFT's files in ``out/adapter``), from process 0 of a multi-process run."""
    import pathlib

    from jaxgrad.lora.task import fit_from_config

    fit = fit_from_config(cfg)
    task, plan = make_sharded_task(fit, mesh, grad_path=cfg["train"]["grad_path"], shard_trainable=shard_trainable,
                                   reshard_after_forward=cfg["mesh"]["reshard_after_forward"])
    whole = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(mesh, PartitionSpec()))

    def finish(result):
        from jaxgrad.lora.peft import save_adapter

        lora = jax.device_get(whole(result.state["params"]["lora"]))  # sharded adapters gathered first
        if jax.process_index() != 0:
            return {"eval": result.eval}
        # out/adapter belongs to the run (--overwrite clears it): a resumed run rewrites it
        path = save_adapter(pathlib.Path(out) / "adapter", lora, fit.lora_config(), base_model_name_or_path=fit.base,
                            overwrite=True)
        return {"eval": result.eval, "adapter": str(path)}

    say(f"layout: {plan.describe}")
    return task, finish, plan
