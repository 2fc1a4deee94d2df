"""Several processes (hosts) as one JAX program: :func:`jax.distributed.initialize`, from the environment.

With several processes -- one per host, or one per GPU -- every process runs the same ``jaxgrad train`` command;
after :func:`initialize`, :func:`jax.devices` lists the devices of all of them, the mesh
(:func:`jaxgrad.train.mesh.train_mesh`) spans them, and the step's collectives (``psum``, ``all_gather``,
``psum_scatter`` inside ``shard_map``) run across hosts (NCCL between GPUs; gloo between CPU processes). Each
process builds the same global batch (the data order is a function of the seed) and puts only its own devices'
rows on them (:func:`jaxgrad.train.mesh.put`).

Where the settings come from (:func:`settings_from_env`), as JAX reads them:

* ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, reachable from every process),
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; ``JAX_LOCAL_DEVICE_IDS`` (optional) is read by JAX itself;
* or a cluster JAX detects (``jax.distributed.initialize()`` with no arguments: SLURM's ``srun``, Open MPI's
  ``mpirun``, Kubernetes, ...), asked for with ``JAXGRAD_DISTRIBUTED=auto`` and taken by default inside an
  ``srun`` of more than one task (``SLURM_NTASKS`` > 1) or an ``mpirun`` of more than one rank.

Nothing set: one process, no initialisation. On the CPU, collectives across processes need
``jax_cpu_collectives_implementation = "gloo"``, set here before JAX's backends start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from jaxgrad.train.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_MODE = "JAXGRAD_DISTRIBUTED"  # "auto": let JAX detect the cluster; "off": never initialise


def _int(env: Mapping[str, str], name: str, lo: int) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < lo:
        raise ConfigError(f"environment variable {name} must be >= {lo}, got {value}")
    return value


def settings_from_env(env: Mapping[str, str] | None = None) -> dict | None:
    """The arguments of :func:`jax.distributed.initialize` the environment asks for (module docstring), ``{}`` for
    JAX's cluster auto-detection, or ``None``: a single process. A partial or inconsistent setting is a
    :class:`~jaxgrad.train.errors.ConfigError` naming the variable."""
    env = os.environ if env is None else env
    mode = env.get(ENV_MODE, "").strip().lower()
    if mode not in ("", "auto", "off"):
        raise ConfigError(f"environment variable {ENV_MODE} must be 'auto' or 'off', got {env.get(ENV_MODE)!r}")
    if mode == "off":
        return None
    address = env.get(ENV_COORDINATOR) or None
    n = _int(env, ENV_NUM_PROCESSES, 1)
    pid = _int(env, ENV_PROCESS_ID, 0)
    if address is not None or n is not None or pid is not None:
        missing = [k for k, v in ((ENV_COORDINATOR, address), (ENV_NUM_PROCESSES, n), (ENV_PROCESS_ID, pid))
                   if v is None]
        if missing and mode != "auto":
            raise ConfigError(f"several processes need {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}; "
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (or set "
                              f"{ENV_MODE}=auto to let JAX detect the cluster)")
        if n is not None and pid is not None and pid >= n:
            raise ConfigError(f"{ENV_PROCESS_ID} = {pid} must be < {ENV_NUM_PROCESSES} = {n}")
        if n == 1 and not missing:
            return None
        return {k: v for k, v in (("coordinator_address", address), ("num_processes", n), ("process_id", pid))
                if v is not None}
    if mode == "auto":
        return {}
    tasks = _int(env, "SLURM_NTASKS", 1) or 1
    ranks = _int(env, "OMPI_COMM_WORLD_SIZE", 1) or 1
    return {} if max(tasks, ranks) > 1 else None


def initialize(settings: dict | None = None, *, cpu_collectives: str = "gloo") -> bool:
    """Start JAX's distributed runtime with ``settings`` (default :func:`settings_from_env`); ``False`` (nothing
    done) for a single process. Call it before anything touches a JAX device."""
    settings = settings_from_env() if settings is None else settings
    if settings is None:
        return False
    import jax

    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(**settings)
    return True


def is_primary() -> bool:
    """This process writes the run's files (process 0; the only one without :func:`initialize`)."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier ``name`` (no-op for one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
