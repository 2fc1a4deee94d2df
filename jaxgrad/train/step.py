r"""The jit-compiled training step over pure state ``{"params", "opt_state", "rng"}``.

One optimiser step on an accumulation window of micro-batches :math:`j = 1..k` (each split over the mesh):

.. math::

    S_j, n_j, G_j = \sum_{i \in j} \ell_i,\; |j|,\; \sum_{i \in j} \nabla \ell_i
    \qquad\Rightarrow\qquad
    \bar\ell = \frac{\sum_j S_j}{\sum_j n_j}, \qquad g = \frac{\sum_j G_j}{\sum_j n_j}

-- every item weighs ``1 / (items in the window)``. A mean of per-micro-batch means,
:math:`\frac1k \sum_j S_j / n_j` (what ``optax.MultiSteps`` computes from mean losses), differs whenever the
:math:`n_j` differ. ``k = 1`` is a single jitted function (loss, gradient, update); ``k > 1`` runs one jitted
:math:`(S_j, n_j, G_j)` per micro-batch (micro-batches may differ in size) and one jitted update.

Guard: the update is applied only where :math:`\bar\ell` and every entry of :math:`g` are finite
(``jnp.where`` on the whole state, so a skipped step leaves params and optimiser state bit-identical); the step
returns the flag. L-BFGS (``optax.lbfgs``) takes :math:`\bar\ell` as ``value_fn`` for its line search and reuses the
value and gradient the line search stored in its state (``optax.value_and_grad_from_state``); it needs the whole
objective in one batch.

Only the leaves marked trainable (``Task.trainable``; e.g. not a KAN's ``grid``) are differentiated and updated.

Randomness (``Task.loss_takes_key``, e.g. LoRA dropout): micro-batch ``j`` of the step whose state holds the engine
key ``rng`` gets ``fold_in(split(rng)[1], j)`` (``split(rng)[0]`` is the next step's ``rng``), then each device its
own ``fold_in(., shard index)`` (:func:`~jaxgrad.train.grads.global_sum_loss`); L-BFGS's line search reuses the step's
key, so the objective it searches is one function. ``mean_loss`` passes no key (evaluation: no dropout).

A model sharded over ``fsdp`` (``plan``, a :class:`~jaxgrad.train.mesh.ShardPlan`) runs the plan's loss on its
shards (:func:`~jaxgrad.train.grads.plan_sum_loss`); the plan's constants (frozen arrays that are not params, e.g.
NF4 weights) enter every jitted function as an argument (never baked into the program), bound by :class:`Steps`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxgrad.train.grads import global_sum_loss, plan_sum_loss
from jaxgrad.train.mesh import ShardPlan
from jaxgrad.train.precision import Policy
from jaxgrad.train.task import Task


def split_trainable(params, mask):
    """``(trainable, frozen)``: two trees of ``params``'s structure with ``None`` where a leaf belongs to the other."""
    if mask is None:
        return params, jax.tree.map(lambda _: None, params)
    train = jax.tree.map(lambda m, p: p if m else None, mask, params)
    frozen = jax.tree.map(lambda m, p: None if m else p, mask, params)
    return train, frozen


def merge_trainable(train, frozen):
    return jax.tree.map(lambda t, f: f if t is None else t, train, frozen, is_leaf=lambda x: x is None)


def _all_finite(*trees) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(a)) for t in trees for a in jax.tree.leaves(t)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _select(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def step_key(rng, micro_batch=0):
    """The loss's key data for micro-batch ``micro_batch`` of the step whose state holds ``rng`` (key data)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.split(jax.random.wrap_key_data(rng))[1], micro_batch))


@dataclasses.dataclass
class Steps:
    """The compiled pieces of one configuration. ``traces`` counts how often each was traced (a retrace is a
    recompile: shapes or dtypes changed)."""

    init_opt: Callable
    train_step: Callable          # (state, batch) -> (state, loss, finite)          [accumulate == 1]
    grad_sums: Callable           # (params, batch[, key]) -> (S, n, G)                [accumulate > 1]
    apply_sums: Callable          # (state, S, n, G) -> (state, loss, finite)
    mean_loss: Callable           # (params, batch) -> S / n (evaluation, tests)
    traces: dict[str, int]
    keyed: bool = False           # the task's loss takes a key (e.g. LoRA dropout): accumulation needs the rng
    plan: ShardPlan | None = None  # the model's layout over the mesh's fsdp axis (None: replicated)


def make_steps(task: Task, optimizer: optax.GradientTransformation, mesh: Mesh, *, policy: Policy = Policy(),
               grad_path: str = "custom_vjp", lbfgs: bool = False, max_traces: int | None = None,
               plan: ShardPlan | None = None) -> Steps:
    """Build the jitted step functions. ``max_traces``: wrap the train step in ``chex.assert_max_traces`` (a
    retrace beyond it raises). ``plan``: the task's model sharded over the mesh's ``fsdp`` axis."""
    loss = task.loss_for(grad_path)
    mask_fn = task.trainable
    keyed = task.loss_takes_key
    traces = {"train_step": 0, "grad_sums": 0, "apply_sums": 0}

    def loss_of_split(tf, batch, *key):
        return loss(merge_trainable(*tf), batch, *key)

    if plan is None:
        plain_total = global_sum_loss(loss_of_split, mesh, policy, keyed=keyed)

        def total(tf, consts, batch, *key):
            return plain_total(tf, batch, *key)
    else:
        total = plan_sum_loss(plan, mesh, policy, keyed=keyed, grad_path=grad_path)
    consts = None if plan is None else plan.consts

    def split(params):
        return split_trainable(params, None if mask_fn is None else mask_fn(params))

    def sums(params, batch, key=None, consts=None):
        train, frozen = split(params)
        key = (key,) if keyed else ()
        (s, n), (g, _) = jax.value_and_grad(total, has_aux=True)((train, frozen), consts, batch, *key)
        return s, n, g

    def apply(state, loss_value, grads, value_fn=None):
        params, opt_state = state["params"], state["opt_state"]
        train, frozen = split(params)
        if lbfgs:
            updates, new_opt = optimizer.update(grads, opt_state, train, value=loss_value, grad=grads,
                                                value_fn=value_fn)
        else:
            updates, new_opt = optimizer.update(grads, opt_state, train)
        new_train = optax.apply_updates(train, updates)
        ok = _all_finite(loss_value, grads, new_train)
        new_state = {"params": merge_trainable(new_train, frozen), "opt_state": new_opt,
                     "rng": jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])}
        new_state = _select(ok, new_state, dict(state, rng=new_state["rng"]))
        return new_state, loss_value, ok

    def train_step(state, batch, consts=None):
        traces["train_step"] += 1
        key = step_key(state["rng"]) if keyed else None
        if lbfgs:
            train, frozen = split(state["params"])

            def value_fn(tr):
                s, n = total((tr, frozen), consts, batch, *((key,) if keyed else ()))
                return s / n.astype(s.dtype)

            vg = optax.value_and_grad_from_state(value_fn)
            value, grads = vg(train, state=state["opt_state"])
            return apply(state, value, grads, value_fn)
        s, n, g = sums(state["params"], batch, key, consts)
        n = n.astype(s.dtype)
        return apply(state, s / n, jax.tree.map(lambda a: a / n.astype(a.dtype), g))

    def grad_sums(params, batch, key=None, consts=None):
        traces["grad_sums"] += 1
        return sums(params, batch, key, consts)

    def apply_sums(state, s, n, g):
        traces["apply_sums"] += 1
        n = n.astype(s.dtype)
        return apply(state, s / n, jax.tree.map(lambda a: a / n.astype(a.dtype), g))

    def mean_loss(params, batch, consts=None):
        s, n = total(split(params), consts, batch)
        return s / n.astype(s.dtype)

    def init_opt(params):
        return optimizer.init(split(params)[0])

    step_fn = train_step
    if max_traces is not None:
        import chex

        step_fn = chex.assert_max_traces(train_step, n=max_traces)
    def bind(fn):  # the plan's constants: a jit argument of every call, never a constant of the program
        return fn if consts is None else functools.partial(fn, consts=consts)

    return Steps(init_opt=init_opt, train_step=bind(jax.jit(step_fn, donate_argnums=(0,))),
                 grad_sums=bind(jax.jit(grad_sums)), apply_sums=jax.jit(apply_sums, donate_argnums=(0,)),
                 mean_loss=bind(jax.jit(mean_loss)), traces=traces, keyed=keyed, plan=plan)


@jax.jit
def fresh_buffers(tree: Any) -> Any:
    """A copy of ``tree`` in buffers of its own (the step donates its state; optax inits may share a buffer
    between two leaves, which donation refuses), every leaf strongly typed (``optax.lbfgs``'s init has weakly typed
    scalars that its update returns strong: without this the step would retrace after its first call)."""
    return jax.tree.map(lambda a: jax.lax.convert_element_type(a, a.dtype), tree)


def tree_add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


tree_add_jit = jax.jit(tree_add, donate_argnums=(0,))


def accumulate_window(steps: Steps, params, micro_batches, rng=None) -> tuple[Any, Any, Any]:
    r"""``(sum_j S_j, sum_j n_j, sum_j G_j)`` over the micro-batches (each already on the mesh); ``rng``: the
    state's key data, for a task whose loss takes a key (micro-batch ``j`` gets :func:`step_key` ``(rng, j)``); such
    a task without ``rng`` is refused (its loss would silently run without its noise, e.g. without LoRA dropout)."""
    if steps.keyed and rng is None:
        raise ValueError("accumulate_window: the task's loss takes a key (Task.loss_takes_key, e.g. LoRA dropout); "
                         "pass rng (the state's 'rng'), or its micro-batches would run without that randomness")
    acc = None
    for j, mb in enumerate(micro_batches):
        s, n, g = steps.grad_sums(params, mb) if rng is None else steps.grad_sums(params, mb, step_key(rng, j))
        acc = (s, n, g) if acc is None else tree_add_jit(acc, (s, n, g))
    if acc is None:
        raise ValueError("accumulate_window: no micro-batches")
    return acc
