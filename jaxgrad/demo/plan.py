"""How big each stage of ``jaxgrad demo`` is: :data:`FULL` (under 5 minutes on a 2-core CPU) and :data:`QUICK`
(tiny, for tests).

The sizes are chosen by cost, and the cost on a CPU is mostly XLA compilation, not arithmetic: one ``check_vjp``
compiles ~150 small programs (about 15 CPU-seconds per op and size), so the audit checks each op at its smallest
registered size only (``jaxgrad audit`` runs all of them); the two trainings are small enough that their steps
cost about as much as their compilation.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    """Sizes of the three stages.

    Attributes:
      name: ``"full"`` or ``"quick"``.
      audit_ops: names of the :func:`jaxgrad.ops.registry.all_audit_cases` to check (``None``: every case).
      audit_sizes: how many of each case's registered sizes to check, smallest first.
      kan_grids: the KAN's grid sizes, refined in this order.
      kan_adam_steps: Adam steps on the first grid before L-BFGS (from the random initialisation, L-BFGS alone
        often stalls in a poor basin; see ``scripts/kan_fit.py``).
      kan_lbfgs_steps: L-BFGS iterations on every grid.
      kan_n_train, kan_n_test: samples of the target function.
      cnn_particles, cnn_size, cnn_snr, cnn_eval: synthetic particle pairs for training, their size in pixels,
        signal-to-noise ratio, and held-out particles for the evaluation.
      cnn_steps, cnn_batch, cnn_lr, cnn_channels: the denoiser's Adam training.
    """

    name: str
    audit_ops: tuple[str, ...] | None
    audit_sizes: int
    kan_grids: tuple[int, ...]
    kan_adam_steps: int
    kan_lbfgs_steps: int
    kan_n_train: int
    kan_n_test: int
    cnn_particles: int
    cnn_size: int
    cnn_snr: float
    cnn_eval: int
    cnn_steps: int
    cnn_batch: int
    cnn_lr: float
    cnn_channels: tuple[int, ...] = (1, 16, 16, 1)


FULL = DemoPlan(name="full", audit_ops=None, audit_sizes=1, kan_grids=(3, 5, 10), kan_adam_steps=1000,
                kan_lbfgs_steps=100, kan_n_train=1000, kan_n_test=1000, cnn_particles=512, cnn_size=48, cnn_snr=0.1,
                cnn_eval=32, cnn_steps=300, cnn_batch=16, cnn_lr=3e-3)

# two cheap ops of the audit (kan_linear alone costs ~3x swiglu + conv2d: it traces high-order B-splines; the KAN
# stage still trains through its VJP) and a few dozen steps per training
QUICK = DemoPlan(name="quick", audit_ops=("swiglu[xla]", "conv2d[xla]"), audit_sizes=1,
                 kan_grids=(3, 5), kan_adam_steps=200, kan_lbfgs_steps=20, kan_n_train=500, kan_n_test=500,
                 cnn_particles=64, cnn_size=32, cnn_snr=0.1, cnn_eval=16, cnn_steps=40, cnn_batch=8, cnn_lr=3e-3)


def plan_for(quick: bool) -> DemoPlan:
    """:data:`QUICK` or :data:`FULL`."""
    return QUICK if quick else FULL
