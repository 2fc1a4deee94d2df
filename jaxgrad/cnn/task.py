r"""The CNN denoiser as a :class:`jaxgrad.train.Task`, and the Noise2Noise run around it (data, evaluation, images).

Loss (Noise2Noise MSE). Item ``i`` is one particle pair; its loss is the mean over pixels,
:math:`\ell_i = \frac{1}{HWC} \sum_{hwc} (\hat y_{ihwc} - t_{ihwc})^2`, and the task returns
:math:`(\sum_i \ell_i,\; B)`, so the engine's loss is the plain mean over the particles of the window (equal to
:func:`jaxgrad.cnn.denoiser.mse_loss` for one batch). ``grad_path="custom_vjp"`` differentiates
:func:`jaxgrad.cnn.denoiser.apply` (hand-written conv VJPs, ``backend`` xla or pallas);
``"reference"`` differentiates :func:`jaxgrad.cnn.denoiser.apply_lax` (plain ``lax.conv_general_dilated``).

Data. :class:`jaxgrad.cnn.data.ParticleStream` over two aligned half-set stacks (real pairs, or synthetic ones
written into the run directory by :func:`ensure_synthetic`); batch ``k`` of epoch ``e`` is a deterministic function
of ``(seed, e, k)``. Evaluation (:func:`eval_set`, :func:`evaluate`): the N2N loss on evaluation particles and, for
synthetic data, the PSNR against the clean particles.

``jaxgrad train cnn`` (:data:`CLI_SCHEMA`, :func:`cli_task`) adds to the engine's run directory ``examples.png``
(noisy / denoised / clean or other half), ``images/step_<step>.png`` at every evaluation when
``data.eval_images`` is set, ``synthetic/`` (the generated stacks) and ``inputs.json`` (name, shape and size of
every input stack: a resume refuses stacks that changed). :func:`load_checkpoint` reads a run's checkpoint back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.cnn import data as cnn_data
from jaxgrad.cnn import denoiser, synthetic
from jaxgrad.train.checkpoint import write_atomic
from jaxgrad.train.errors import ConfigError, DataError
from jaxgrad.train.task import Task

SYNTH_DIR = "synthetic"
EXAMPLES_FILE = "examples.png"
IMAGES_DIR = "images"
INPUTS_FILE = "inputs.json"
UsageError = DataError  # an input file or data set that cannot be used: one line, exit status 2


def fingerprint(stack: cnn_data.MRCStack) -> dict:
    """Name, shape and size of a stack (no directory: a synthetic run directory may be moved and resumed)."""
    return {"name": pathlib.Path(stack.path).name, "shape": list(stack.shape), "bytes": os.path.getsize(stack.path)}


def open_pairs(inputs: list[str], targets: list[str]) -> tuple[list, list]:
    """Open and cross-check the stacks; errors name the option and the file."""
    ins, outs = [], []
    try:
        for opt, paths, into in (("--inputs", inputs, ins), ("--targets", targets, outs)):
            for p in paths:
                if not os.path.isfile(p):
                    raise UsageError(f"{opt}: {p}: no such file")
                try:
                    into.append(cnn_data.open_stack(p))
                except cnn_data.MRCFormatError as err:
                    raise UsageError(f"{opt}: {err}") from None
        first = ins[0]
        for opt, stacks in (("--inputs", ins), ("--targets", outs)):
            for s in stacks:
                if s.shape[1:] != first.shape[1:]:
                    raise UsageError(f"{opt}: {s.path} has images of {s.shape[1]} x {s.shape[2]} pixels but "
                                     f"{first.path} has {first.shape[1]} x {first.shape[2]}; all stacks must have the "
                                     f"same image size")
        for a, b in zip(ins, outs):
            if len(a) != len(b):
                raise UsageError(f"paired stacks differ in length: {a.path} (input) has {len(a)} particles but "
                                 f"{b.path} (target) has {len(b)}; pairs must be aligned one-to-one")
    except BaseException:
        for s in ins + outs:
            s.close()
        raise
    return ins, outs


def heldout_seed(seed: int) -> int:
    return int(np.random.SeedSequence(seed, spawn_key=(0x4E32,)).generate_state(1)[0])


def ensure_synthetic(out: pathlib.Path, spec: dict, seed: int, chunk: int, say) -> None:
    """Write DIR/synthetic/{train,heldout}/*.mrc unless a complete set for ``spec`` is there already."""
    root = out / SYNTH_DIR
    marker = root / "synthetic.json"
    want = {"n": spec["n"], "size": spec["size"], "snr": spec["snr"], "seed": seed, "n_eval": spec["n_eval"],
            "heldout_seed": heldout_seed(seed)}
    if marker.exists():
        if json.loads(marker.read_text()) == want:
            return
        raise UsageError(f"{root}: synthetic data of another configuration ({marker.read_text().strip()}); expected "
                         f"{want}")
    t0 = time.perf_counter()
    say(f"writing {spec['n']} + {spec['n_eval']} synthetic particles of {spec['size']} x {spec['size']} "
        f"(snr {spec['snr']}) into {root}")
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "heldout").mkdir(parents=True, exist_ok=True)
    # overwrite=True: only files of an earlier, interrupted generation (no marker yet) can be there.
    paths = synthetic.write_synthetic_stacks(root / "train", spec["n"], spec["size"], spec["snr"], seed, chunk=chunk,
                                             overwrite=True)
    with cnn_data.open_stack(paths["density"]) as vol:
        density = vol.read(slice(None))
    synthetic.write_synthetic_stacks(root / "heldout", spec["n_eval"], spec["size"], spec["snr"], want["heldout_seed"],
                                     chunk=chunk, density=density, overwrite=True)
    write_atomic(marker, json.dumps(want) + "\n")
    say(f"  done in {time.perf_counter() - t0:.1f} s")


def standardize_like(ref: np.ndarray, noisy: np.ndarray) -> np.ndarray:
    """``(ref - mean(noisy)) / std(noisy)`` per image (the affine map of ``normalize_per_particle(noisy)``)."""
    mean = noisy.mean(axis=(-2, -1), keepdims=True, dtype=np.float64)
    std = np.sqrt(np.mean(np.square(noisy - mean), axis=(-2, -1), keepdims=True))
    return ((ref - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)


def eval_set(out: pathlib.Path, cfg: dict, ins: list, outs: list) -> dict:
    """Evaluation particles (normalised as in training): x, target [n, H, W, 1], and ref (clean) or None."""
    spec = cfg["data"]
    n = spec["n_eval"]
    if spec["kind"] == "synthetic":
        d = out / SYNTH_DIR / "heldout"
        with cnn_data.open_stack(d / "noisy_a.mrc") as a, cnn_data.open_stack(d / "noisy_b.mrc") as b, \
                cnn_data.open_stack(d / "clean.mrc") as c:
            xa, xb, clean = a.read(slice(0, n)), b.read(slice(0, n)), c.read(slice(0, n))
        ref = standardize_like(clean, xa)[..., None]
        source = f"{n} held-out synthetic particles ({d})"
    else:
        xa, xb, k = [], [], 0
        for a, b in zip(ins, outs):  # the first n particles in file order
            m = min(len(a), n - k)
            if m <= 0:
                break
            xa.append(a.read(slice(0, m)))
            xb.append(b.read(slice(0, m)))
            k += m
        xa, xb, ref = np.concatenate(xa), np.concatenate(xb), None
        source = f"first {k} particles of the input/target stacks (training data)"
    x = cnn_data.normalize_per_particle(xa)[..., None]
    y = cnn_data.normalize_per_particle(xb)[..., None]
    return {"x": x, "target": y, "ref": ref, "source": source}


def psnr_db(d: np.ndarray, ref: np.ndarray) -> float:
    """Mean over images of ``10 log10((max ref - min ref)^2 / mean((d - ref)^2))``; ``[n, H, W(, 1)]`` arrays."""
    d = np.asarray(d, np.float64).reshape(len(d), -1)
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    peak = ref.max(axis=1) - ref.min(axis=1)
    mse = np.maximum(np.mean(np.square(d - ref), axis=1), 1e-30)
    return float(np.mean(10 * np.log10(np.square(peak) / mse)))


def save_examples(path: pathlib.Path, x: np.ndarray, denoised: np.ndarray, third: np.ndarray, third_name: str,
                  title: str) -> None:
    """PNG grid: one row per particle, columns noisy / denoised / ``third_name`` (Agg backend, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(x)
    fig = Figure(figsize=(7.5, 2.5 * n + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 3, squeeze=False)
    for i in range(n):
        for j, (img, name) in enumerate(((x[i], "noisy input"), (denoised[i], "denoised"), (third[i], third_name))):
            img = np.asarray(img)[..., 0]
            lo, hi = np.percentile(img, [1, 99])
            ax = axes[i, j]
            ax.imshow(img, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(name, fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)




# ----------------------------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------------------------

def per_item_mse_sum(y: jax.Array, target: jax.Array) -> tuple[jax.Array, int]:
    r"""``(sum_i mean_pixels (y_i - t_i)^2, B)``; bf16 activations are compared in f32, f64 stays f64."""
    acc = jnp.promote_types(y.dtype, jnp.float32)
    d = y.astype(acc) - target.astype(acc)
    return jnp.sum(jnp.mean(jnp.square(d), axis=tuple(range(1, d.ndim)))), y.shape[0]


def lax_precision(name: str | None):
    """``"highest"`` -> ``Precision.HIGHEST``; ``"default"``/``None`` -> JAX's default (TF32 convs on a GPU)."""
    return jax.lax.Precision.HIGHEST if name == "highest" else None


def make_task(stream, *, channels, residual: bool = False, backend: str = "xla", precision: str | None = "default",
              dtype=jnp.float32, evaluate=None, describe: str = "") -> Task:
    """The denoiser on ``stream`` (anything with ``epoch(e)`` yielding ``(x, y)`` NHWC batches and ``len``)."""
    model = denoiser.DenoiserConfig(tuple(channels), residual=bool(residual))
    prec = lax_precision(precision)

    def init(key):
        return denoiser.init(key, model, dtype)

    def loss(params, batch):
        x, y = batch
        return per_item_mse_sum(denoiser.apply(params, x, residual=model.residual, backend=backend, precision=prec),
                                y)

    def reference_loss(params, batch):
        x, y = batch
        out = denoiser.apply_lax(params, x, precision=prec)
        return per_item_mse_sum(x + out if model.residual else out, y)

    return Task("cnn", init=init, loss=loss, reference_loss=reference_loss, batches=stream.epoch,
                batches_per_epoch=len(stream), evaluate=evaluate, describe=describe)


@functools.lru_cache(maxsize=None)
def _apply_jit(residual: bool, backend: str, precision: str | None):
    return jax.jit(functools.partial(denoiser.apply, residual=residual, backend=backend,
                                     precision=lax_precision(precision)))


def denoise(params, x: np.ndarray, batch_size: int, *, residual: bool, backend: str = "xla",
            precision: str | None = "default") -> np.ndarray:
    """Denoise ``x[n, H, W, 1]`` in batches of ``batch_size`` (the last one zero-padded: one compiled shape)."""
    apply_fn = _apply_jit(bool(residual), backend, precision)
    outs = []
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size]
        pad = batch_size - len(xb)
        if pad:
            xb = np.concatenate([xb, np.zeros((pad,) + xb.shape[1:], xb.dtype)])
        outs.append(np.asarray(apply_fn(params, jnp.asarray(xb)))[:batch_size - pad])
    return np.concatenate(outs)


def n2n_loss(d: np.ndarray, evalset: dict) -> float:
    return float(np.mean(np.square(d.astype(np.float64) - evalset["target"])))


def evaluation(params, init_params, evalset: dict, den) -> dict:
    """N2N loss of the initial and final network on the evaluation particles (+ PSNR/MSE vs clean if known).
    ``den(params, x)``: the denoiser."""
    d0, d1 = den(init_params, evalset["x"]), den(params, evalset["x"])
    ev = {"source": evalset["source"], "n": len(evalset["x"]), "n2n_loss_initial": n2n_loss(d0, evalset),
          "n2n_loss_final": n2n_loss(d1, evalset)}
    if evalset["ref"] is not None:
        ref = evalset["ref"]
        ev.update(mse_vs_clean_initial=float(np.mean(np.square(d0 - ref), dtype=np.float64)),
                  mse_vs_clean_final=float(np.mean(np.square(d1 - ref), dtype=np.float64)),
                  mse_noisy_vs_clean=float(np.mean(np.square(evalset["x"] - ref), dtype=np.float64)),
                  psnr_denoised_db=psnr_db(d1, ref), psnr_noisy_db=psnr_db(evalset["x"], ref),
                  psnr_definition="per particle 10 log10((max r - min r)^2 / mean((d - r)^2)), averaged; r = "
                                  "clean standardised with its noisy input's mean and std")
    return ev


def write_examples(path: pathlib.Path, params, step: int, loss: float | None, evalset: dict, n_examples: int,
                   den) -> None:
    """``n_examples`` particles: noisy input / denoised / clean (synthetic) or the other half (real pairs)."""
    k = min(n_examples, len(evalset["x"]))
    x = evalset["x"][:k]
    third, name = ((evalset["ref"][:k], "clean") if evalset["ref"] is not None else
                   (evalset["target"][:k], "other half (target)"))
    loss_txt = f"train loss {loss:.4f}" if loss is not None else "train loss -"
    full = den(params, evalset["x"])
    save_examples(path, x, den(params, x), third, name,
                  f"step {step}: {loss_txt}, eval N2N loss {n2n_loss(full, evalset):.4f}")


# ----------------------------------------------------------------------------------------------------------------
# `jaxgrad train cnn`
# ----------------------------------------------------------------------------------------------------------------

CLI_SCHEMA = {
    "model": {"channels": ("ints", [1, 16, 16, 1]), "residual": ("bool", False),
              "backend": ("str", "xla", ("xla", "pallas")), "precision": ("str", "default", ("default", "highest"))},
    "data": {"kind": ("str", "synthetic", ("synthetic", "pairs")), "n": ("int", 2048), "size": ("int", 64),
             "snr": ("float", 0.1), "n_eval": ("int", 64), "inputs": ("strs", []), "targets": ("strs", []),
             "batch_size": ("int", 16), "buffer_size": ("int?", None), "chunk_size": ("int?", None),
             "seed": ("int", 0), "n_examples": ("int", 4), "synthetic_chunk": ("int", 256),
             "eval_images": ("bool", False)},
}
CLI_TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "steps": 1000, "log_every": 10, "checkpoint_every": 200}
CLI_FIXED = {"model": ("channels", "residual"), "data": ("kind", "n", "size", "snr", "n_eval", "inputs", "targets",
                                                         "batch_size", "buffer_size", "chunk_size", "seed")}
CLI_OUTPUTS = (EXAMPLES_FILE, IMAGES_DIR, INPUTS_FILE, SYNTH_DIR)


def needs_x64(cfg: dict) -> bool:
    return False


def cli_task(cfg: dict, out, say):
    """``(task, finish)`` for ``jaxgrad train cnn`` (synthetic data written into ``out/synthetic``)."""
    out = pathlib.Path(out)
    m, d = cfg["model"], cfg["data"]
    try:
        denoiser.DenoiserConfig(tuple(m["channels"]), residual=m["residual"])
    except ValueError as err:
        raise ConfigError(f"[model] 'model.channels' / 'model.residual': {err}") from None
    if m["channels"][0] != 1 or m["channels"][-1] != 1:
        raise ConfigError(f"[model] 'model.channels': the first and last widths must be 1 (single-channel "
                          f"particles), got {m['channels']}")
    for key, lo in (("batch_size", 1), ("n_eval", 1), ("n_examples", 0), ("n", 1), ("size", 2), ("seed", 0),
                    ("synthetic_chunk", 1)):
        if d[key] < lo:
            raise ConfigError(f"[data] 'data.{key}' must be an integer >= {lo}, got {d[key]}")
    if d["kind"] == "synthetic":
        # checked before any particle is written: a refused run leaves no data behind
        if d["batch_size"] > d["n"]:
            raise ConfigError(f"[data] 'data.batch_size' ({d['batch_size']}) is larger than the number of particles "
                              f"('data.n' = {d['n']})")
        if not d["snr"] > 0:
            raise ConfigError(f"[data] 'data.snr' must be > 0, got {d['snr']}")
        spec = {"kind": "synthetic", "n": d["n"], "size": d["size"], "snr": d["snr"], "n_eval": d["n_eval"]}
        ensure_synthetic(out, spec, d["seed"], d["synthetic_chunk"], say)
        root = out / SYNTH_DIR / "train"
        ins, outs = open_pairs([str(root / "noisy_a.mrc")], [str(root / "noisy_b.mrc")])
    else:
        if not d["inputs"] or len(d["inputs"]) != len(d["targets"]):
            raise ConfigError(f"[data] 'data.inputs' and 'data.targets' must list the same number (>= 1) of MRC "
                              f"stacks for kind 'pairs', got {len(d['inputs'])} and {len(d['targets'])}")
        spec = {"kind": "pairs", "inputs": d["inputs"], "targets": d["targets"], "n_eval": d["n_eval"]}
        ins, outs = open_pairs(d["inputs"], d["targets"])
    try:
        n = sum(len(s) for s in ins)
        if d["batch_size"] > n:
            raise ConfigError(f"[data] 'data.batch_size' ({d['batch_size']}) is larger than the number of particles "
                              f"({n})")
        buffer = d["buffer_size"] or max(d["batch_size"], min(1024, n))
        try:
            stream = cnn_data.ParticleStream(None, d["batch_size"], buffer_size=buffer, seed=d["seed"],
                                             chunk_size=d["chunk_size"], drop_last=True, pairs=(ins, outs))
        except ValueError as err:
            raise ConfigError(f"[data] {err}") from None
        check_inputs(out, [fingerprint(s) for s in ins + outs])
        evalset = eval_set(out, {"data": spec}, ins, outs)
    except BaseException:
        for s in ins + outs:
            s.close()
        raise
    den = functools.partial(denoise, batch_size=d["batch_size"], residual=m["residual"], backend=m["backend"],
                            precision=m["precision"])

    # The engine draws the k micro-batches of step s (indices s k - k .. s k - 1) right before training it, so
    # after step s the last one drawn is s k - 1: the step an evaluation (or an image) belongs to.
    nb, k = len(stream), cfg["train"].get("accumulate", 1)
    drawn = {"micro_batch": None}

    def batches(epoch):
        for i, batch in enumerate(stream.epoch(epoch)):
            drawn["micro_batch"] = epoch * nb + i
            yield batch

    def evaluate(params):
        if d["eval_images"] and drawn["micro_batch"] is not None:
            step = (drawn["micro_batch"] + 1) // k
            (out / IMAGES_DIR).mkdir(exist_ok=True)
            write_examples(out / IMAGES_DIR / f"step_{step:07d}.png", params, step, None, evalset,
                           max(d["n_examples"], 1), den)
        return {"eval_n2n_loss": n2n_loss(den(params, evalset["x"]), evalset)}

    task = make_task(stream, channels=m["channels"], residual=m["residual"], backend=m["backend"],
                     precision=m["precision"], evaluate=evaluate,
                     describe=f"{stream}; buffer {stream.buffer_nbytes / 2**20:.1f} MiB; network "
                              f"{list(m['channels'])}{' residual' if m['residual'] else ''}; backend {m['backend']}, "
                              f"precision {m['precision']}")
    task = dataclasses.replace(task, batches=batches)

    def finish(result):
        params = result.state["params"]
        init = denoiser.init(jax.random.key(cfg["train"]["seed"]),
                             denoiser.DenoiserConfig(tuple(m["channels"]), residual=m["residual"]))
        if d["n_examples"]:
            write_examples(out / EXAMPLES_FILE, params, result.step, result.final_loss, evalset, d["n_examples"],
                           den)
        try:
            return {"epoch": result.step * k / nb, "batches_per_epoch": nb,
                    "eval": evaluation(params, init, evalset, den)}
        finally:
            stream.close()
            for s in ins + outs:
                s.close()

    return task, finish


def check_inputs(out: pathlib.Path, fingerprints: list[dict]) -> None:
    """Record the input stacks' fingerprints in ``out/inputs.json``, or, when a run's record is there (a resume),
    refuse stacks that differ from it."""
    path = out / INPUTS_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != fingerprints:
            raise DataError(f"--resume: the input stacks changed since the run started (was {saved}, now "
                            f"{fingerprints})")
        return
    write_atomic(path, json.dumps(fingerprints, indent=1) + "\n")


def load_checkpoint(out, step: int | None = None):
    """``(params, opt_state, meta)`` of checkpoint ``step`` (default: the latest) of the ``jaxgrad train cnn`` run
    in ``out``."""
    from jaxgrad.train import build, rundir
    from jaxgrad.train.checkpoint import Checkpointer
    from jaxgrad.train.cli_train import owner_of
    from jaxgrad.train.loop import abstract_state
    from jaxgrad.train.toml_config import train_config

    out = pathlib.Path(out)
    run = rundir.read_run_file(out, owner_of("cnn"))
    if run is None:
        raise FileNotFoundError(f"{out}: no {rundir.RUN_FILE}")
    cfg = run["config"]
    tcfg = train_config(cfg)
    model = denoiser.DenoiserConfig(tuple(cfg["model"]["channels"]), residual=cfg["model"]["residual"])
    shape_only = Task("cnn", init=lambda key: denoiser.init(key, model), loss=lambda p, b: (0.0, 1),
                      batches=lambda e: iter(()), batches_per_epoch=1)
    ckpt = Checkpointer(out / "checkpoints", tcfg.keep, create=False)
    try:
        step = max(ckpt.steps(), default=None) if step is None else step
        if step is None:
            raise FileNotFoundError(f"{out / 'checkpoints'}: no checkpoint")
        state, meta = ckpt.restore(step, abstract_state(shape_only, tcfg, build(shape_only, tcfg)[1], step))
        return state["params"], state["opt_state"], meta
    finally:
        ckpt.close()
