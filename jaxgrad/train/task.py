r"""The protocol a model family implements to be trained by :func:`jaxgrad.train.fit`.

A family (KAN, CNN, later LoRA) is a :class:`Task`: plain functions over a pytree of parameters and numpy batches.
The engine owns everything else (optimiser, accumulation, mesh, precision, checkpoints, metrics).

Loss contract. ``loss(params, batch)`` returns ``(S, n)``: the **sum** of the per-item losses of the batch and the
number of items ``n`` (a scalar, possibly fractional for masked tokens), not their mean. The engine trains on

.. math::

    \mathcal L = \frac{\sum_{j \in W} S_j}{\sum_{j \in W} n_j}

over the micro-batches ``j`` of an accumulation window ``W`` and over the devices of the mesh, so that every item
weighs the same whatever the micro-batch it landed in (a mean of per-micro-batch means would over-weight the items
of a short micro-batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

PyTree = Any
Batch = Any

GRAD_PATHS = ("custom_vjp", "reference")


@dataclasses.dataclass(frozen=True)
class Task:
    """A family's model, data and evaluation, as the engine sees them.

    Attributes:
      name: family name (``"kan"``, ``"cnn"``), written into the run's files.
      init: ``init(key) -> params`` (any pytree of float arrays).
      loss: ``loss(params, batch) -> (sum_of_item_losses, n_items)`` through the family's custom VJPs / kernels.
      reference_loss: the same loss through plain JAX (``jax.grad`` of it is the A/B oracle); ``None``: same as
        ``loss``.
      batches: ``batches(epoch) -> iterator of batches`` (pytrees of numpy arrays whose leading axis is the item
        axis), a deterministic function of the epoch (and of the task's own seed).
      batches_per_epoch: length of every ``batches(epoch)`` iterator.
      evaluate: ``evaluate(params) -> {name: float}`` on held-out data, or ``None``.
      transition: ``transition(params, step) -> params``: called before global step ``step`` is trained, for
        each step in ``transition_steps``; the new params (e.g. a KAN grid refinement, which changes shapes)
        restart the optimiser state. A deterministic, traceable function of ``(params, step)`` (resume replays
        it under ``jax.eval_shape`` to rebuild the shapes a checkpoint holds).
      transition_steps: the steps at which ``transition`` runs.
      trainable: ``trainable(params) -> pytree of bools`` (``optax.masked`` mask), or ``None``: every leaf.
      describe: one line for the log (model size, data).
      loss_takes_key: ``loss`` and ``reference_loss`` are ``(params, batch, key)``: ``key`` is a PRNG key from the
        engine's RNG stream (a fresh one per micro-batch and device, :func:`jaxgrad.train.step.step_key`), or
        ``None`` where no randomness is wanted (evaluation). For dropout-like noise; the data order stays the
        task's own.
      throughput_unit, throughput_count: what the throughput (``<unit>/s`` in the progress display,
        ``<unit>_per_s`` in ``metrics.jsonl`` / ``metrics.csv`` and the run's summary) counts, and
        ``throughput_count(batch) -> int`` counting it on the host (default: the batch's leading axis, ``"items"``).
        A language model reports ``"tokens"`` (every position of every sequence), whatever the accumulation.
    """

    name: str
    init: Callable[[Any], PyTree]
    loss: Callable[[PyTree, Batch], tuple[Any, Any]]
    batches: Callable[[int], Iterator[Batch]]
    batches_per_epoch: int
    reference_loss: Callable[[PyTree, Batch], tuple[Any, Any]] | None = None
    evaluate: Callable[[PyTree], dict] | None = None
    transition: Callable[[PyTree, int], PyTree] | None = None
    transition_steps: tuple[int, ...] = ()
    trainable: Callable[[PyTree], PyTree] | None = None
    describe: str = ""
    loss_takes_key: bool = False
    throughput_unit: str = "items"
    throughput_count: Callable[[Batch], int] | None = None

    def __post_init__(self):
        for field in ("init", "loss", "batches"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Task {self.name!r}: '{field}' must be callable, got {getattr(self, field)!r}")
        if self.transition_steps and self.transition is None:
            raise ValueError(f"Task {self.name!r}: 'transition_steps' given without a 'transition' function")
        if not isinstance(self.batches_per_epoch, int) or self.batches_per_epoch < 1:
            raise ValueError(f"Task {self.name!r}: 'batches_per_epoch' must be an int >= 1, got "
                             f"{self.batches_per_epoch!r}")

        if not (isinstance(self.throughput_unit, str) and self.throughput_unit.isidentifier()):
            raise ValueError(f"Task {self.name!r}: 'throughput_unit' must be a word such as 'items' or 'tokens', got "
                             f"{self.throughput_unit!r}")

    def count(self, batch: Batch) -> int:
        """The batch's throughput count (:attr:`throughput_count`, default: its leading axis)."""
        if self.throughput_count is not None:
            return int(self.throughput_count(batch))
        import jax

        return int(len(jax.tree.leaves(batch)[0]))

    def loss_for(self, grad_path: str) -> Callable:
        """The loss whose gradient the engine takes: ``"custom_vjp"`` (the family's VJPs) or ``"reference"``."""
        if grad_path not in GRAD_PATHS:
            raise ValueError(f"grad_path must be one of {GRAD_PATHS}, got {grad_path!r}")
        if grad_path == "reference":
            return self.reference_loss or self.loss
        return self.loss
