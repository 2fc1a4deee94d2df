"""One training engine for every jaxgrad family (see ``docs/train.md``).

    from jaxgrad.train import Task, TrainConfig, fit
    result = fit(task, TrainConfig(steps=1000, lr=1e-3), "runs/x")

Modules: :mod:`~jaxgrad.train.task` (the family protocol), :mod:`~jaxgrad.train.config` (engine settings),
:mod:`~jaxgrad.train.step` (the jitted step, accumulation, NaN guard), :mod:`~jaxgrad.train.grads` (loss and
gradient over the mesh), :mod:`~jaxgrad.train.mesh`, :mod:`~jaxgrad.train.precision`, :mod:`~jaxgrad.train.optim`,
:mod:`~jaxgrad.train.checkpoint`, :mod:`~jaxgrad.train.rundir`, :mod:`~jaxgrad.train.metrics`,
:mod:`~jaxgrad.train.loop` (:func:`fit`), :mod:`~jaxgrad.train.toml_config` (the ``jaxgrad train`` front end).
"""

# Imported for its side effect, before any step is traced: JAX's first Pallas lowering imports this module and it
# registers an option of the trace context (pallas_fuser_disable_nested_fuse), so a step traced before that import
# (every Pallas backend: the kernels are imported inside the trace) would retrace once at its second call.
from jax.experimental.pallas import fuser as _pallas_fuser  # noqa: F401

from jaxgrad.train import rundir
from jaxgrad.train.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointSaveError,
                                      NoGoodCheckpointError)
from jaxgrad.train.config import TrainConfig
from jaxgrad.train.errors import ConfigError, DataError
from jaxgrad.train.grads import global_mean_loss, global_sum_loss
from jaxgrad.train.loop import FitResult, TrainingDiverged, build, fit, init_state, log_end, train_in_memory
from jaxgrad.train.mesh import ShardPlan, data_mesh, replicate, shard_batch, train_mesh
from jaxgrad.train.precision import Policy
from jaxgrad.train.step import accumulate_window, make_steps
from jaxgrad.train.task import Task

__all__ = ["Checkpointer", "CheckpointMismatchError", "CheckpointSaveError", "ConfigError", "DataError", "FitResult",
           "NoGoodCheckpointError", "Policy", "Task", "TrainConfig", "TrainingDiverged", "accumulate_window", "build",
           "data_mesh", "fit", "global_mean_loss", "global_sum_loss", "init_state", "log_end", "make_steps",
           "replicate", "rundir", "shard_batch", "ShardPlan", "train_in_memory", "train_mesh"]
