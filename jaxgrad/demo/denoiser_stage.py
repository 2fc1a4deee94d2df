"""Stage 3 of ``jaxgrad demo``: train the cryo-EM denoiser on synthetic particles (Noise2Noise).

Synthetic particles are projections of a random 3-D density, each written twice with independent noise
(:mod:`jaxgrad.cnn.synthetic`); the network (3x3 convolutions through jaxgrad's hand-written conv VJP) learns to
predict one noisy copy from the other, which teaches it to remove the noise without ever seeing a clean image.
The clean projections are known here, so the result is measured against them: PSNR of the noisy input and of the
denoised output.

The data, model, loss and evaluation are exactly ``jaxgrad train cnn``'s (:func:`jaxgrad.cnn.task.cli_task`);
the engine's :func:`jaxgrad.train.train_in_memory` trains it. The particle stacks go to a temporary directory,
removed at the end; the examples image is moved into the report.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile
import time

import numpy as np

from jaxgrad.demo.plan import DemoPlan

EVAL_KEYS = ("psnr_noisy_db", "psnr_denoised_db", "mse_noisy_vs_clean", "mse_vs_clean_initial", "mse_vs_clean_final",
             "n2n_loss_initial", "n2n_loss_final")


@dataclasses.dataclass(frozen=True)
class DenoiserResult:
    """``evaluation``: :data:`EVAL_KEYS` on the held-out particles (see :func:`jaxgrad.cnn.task.evaluation`);
    ``losses[i]``: the Noise2Noise training loss of step ``i + 1``."""

    evaluation: dict
    losses: np.ndarray
    particles: int
    size: int
    snr: float
    n_eval: int
    steps: int
    batch: int
    seconds: float


def cnn_config(plan: DemoPlan, seed: int = 0) -> dict:
    """The ``jaxgrad train cnn`` configuration (its schema's defaults with the plan's sizes)."""
    from jaxgrad.cnn.task import CLI_SCHEMA

    cfg = {section: {key: spec[1] for key, spec in keys.items()} for section, keys in CLI_SCHEMA.items()}
    cfg["model"].update(channels=list(plan.cnn_channels), residual=False, backend="xla", precision="default")
    cfg["data"].update(kind="synthetic", n=plan.cnn_particles, size=plan.cnn_size, snr=plan.cnn_snr,
                       n_eval=plan.cnn_eval, batch_size=plan.cnn_batch, seed=seed, n_examples=4)
    cfg["train"] = {"seed": seed}
    return cfg


def run_denoiser(plan: DemoPlan, examples_png: pathlib.Path, seed: int = 0) -> DenoiserResult:
    """Train the denoiser of the plan; write its before/after examples to ``examples_png``."""
    import jax.numpy as jnp

    from jaxgrad.cnn.task import cli_task
    from jaxgrad.train import FitResult, TrainConfig, train_in_memory

    t0 = time.perf_counter()
    cfg = cnn_config(plan, seed)
    tcfg = TrainConfig(steps=plan.cnn_steps, optimizer="adam", lr=plan.cnn_lr, nan_policy="stop", seed=seed)
    with tempfile.TemporaryDirectory(prefix="jaxgrad-demo-particles-") as tmp:
        tmp = pathlib.Path(tmp)
        task, finish = cli_task(cfg, tmp, say=lambda msg: None)
        state, losses = train_in_memory(task, tcfg)
        losses = np.asarray(jnp.stack(losses), np.float64)
        result = FitResult(state=state, step=plan.cnn_steps, final_loss=float(losses[-1]), eval=None, traces={},
                           skipped=0)
        ev = finish(result)["eval"]  # writes tmp/examples.png and closes the particle stacks
        shutil.move(tmp / "examples.png", examples_png)  # /tmp may be another file system than the report
    return DenoiserResult(evaluation={k: float(ev[k]) for k in EVAL_KEYS}, losses=losses,
                          particles=plan.cnn_particles, size=plan.cnn_size, snr=plan.cnn_snr, n_eval=plan.cnn_eval,
                          steps=plan.cnn_steps, batch=plan.cnn_batch, seconds=time.perf_counter() - t0)
