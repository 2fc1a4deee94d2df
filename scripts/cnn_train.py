#!/usr/bin/env python
"""Noise2Noise training of the cryo-EM denoiser (:mod:`jaxgrad.cnn.denoiser`) on particle stacks larger than RAM.

    # real data: two aligned half-set stacks (noisy A -> noisy B), one or several files per side
    python scripts/cnn_train.py --pairs A.mrc B.mrc --out runs/n2n --epochs 20
    python scripts/cnn_train.py --inputs a1.mrc a2.mrc --targets b1.mrc b2.mrc --out runs/n2n --steps 50000
    # synthetic data (written into the run directory first, in chunks), with a held-out clean set for PSNR
    python scripts/cnn_train.py --synthetic 20000 --size 64 --snr 0.1 --out runs/synth --epochs 5
    # continue a run (after a crash, Ctrl-C, a pre-emption, or to train longer)
    python scripts/cnn_train.py --out runs/n2n --resume [--steps 100000]

Data. Batches come from :class:`jaxgrad.cnn.data.ParticleStream` (memory-mapped MRC stacks, chunked shuffle
buffer of ``--buffer-size`` particles, per-particle normalisation, ``drop_last``): at most ``--buffer-size``
particle pairs are held in memory, whatever the size of the stacks. Batch ``k`` of epoch ``e`` is a deterministic
function of ``(--seed, e, k)``; global step ``s`` (0-based) trains on batch ``s mod n_b`` of epoch ``s // n_b``
(``n_b`` = batches per epoch). ``--synthetic N`` first writes ``synthetic/train/{clean,noisy_a,noisy_b,density}.mrc``
(``N`` particles, :func:`jaxgrad.cnn.synthetic.write_synthetic_stacks`, ``--synthetic-chunk`` particles at a
time) and ``synthetic/heldout/`` (``--n-eval`` particles of the same density, other views and noise), and trains
``noisy_a -> noisy_b``; the clean stacks are never used for training.

Model and optimiser: ``--channels 1,16,16,1`` 3x3 conv layers (ReLU between; first and last width must be 1: MRC
particles are single-channel), ``--residual`` (predict ``x + net(x)``), MSE, optax Adam (``--lr``),
``--backend xla|pallas``, ``--precision default|highest`` (default = TF32 for f32 convolutions on the GPU).

Run directory ``--out DIR``. The script owns (and only ever writes, replaces or deletes) these entries of DIR:

* ``run.json``: the run's configuration and a fingerprint (shape, size) of every input stack;
* ``checkpoints/<step>/``: orbax checkpoints (the last ``--keep``), each holding ``state`` = ``{"params",
  "opt_state"}`` (optax Adam state) and ``meta`` = JSON ``{"step", "epoch", "batch_in_epoch",
  "batches_per_epoch", "loss", "time"}``; written every ``--checkpoint-every`` steps, at the end, and when the run
  is stopped by SIGINT/SIGTERM (Ctrl-C, pre-emption: the current step finishes, a checkpoint is written, the
  script exits with status 130/143; a second Ctrl-C kills at once). Saves are synchronous and atomic (orbax
  writes ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete; incomplete ones are ignored and removed on
  resume), so a crash or a ``kill -9`` loses at most the steps since the last checkpoint and never damages an
  earlier one;
* ``metrics.csv``: the step lines of ``metrics.jsonl`` as CSV;
* ``metrics.jsonl``: one JSON object per line, appended (never truncated; fsync'ed at every checkpoint): step lines
  ``{"step", "epoch", "batch", "loss" (mean over the ``n_steps`` steps since the previous line), "loss_last",
  "n_steps", "steps_per_s", "time" (unix), "elapsed_s"}`` every ``--log-every`` steps, and event lines
  ``{"event": "start" | "resume" | "stopped" | "end", "step", "time", ...}``. After a crash the steps past the last
  checkpoint are trained again: a ``resume`` event at step ``s`` supersedes the step lines above it with step > s;
* ``examples.png`` (at the end) and ``images/step_<step>.png`` (every ``--image-every`` steps): ``--n-examples``
  particles, columns noisy input / denoised / clean (synthetic) or noisy / denoised / other half (real pairs), titled
  with the step and the losses;
* ``summary.json`` (at the end): final training loss, N2N loss of the initial and final network on the evaluation
  particles, and for synthetic data the PSNR of the denoised and of the noisy particles against the clean ones;
* ``synthetic/`` (with ``--synthetic``).

A fresh run needs an empty (or absent) DIR; ``--overwrite`` allows a non-empty one and replaces only the owned
entries above (and refuses if any of them exists without a ``run.json`` of this script). ``--resume`` continues the
run in DIR from its latest checkpoint (from step 0 if none was written yet; starts fresh if DIR is empty or absent,
so job scripts can always pass it): the configuration comes from ``run.json``; options that define the model or the
batch sequence (channels, residual, batch/buffer/chunk size, seed, data) may be repeated but must not change, the
others (``--steps``/``--epochs``, ``--lr``, backend, precision, logging, checkpointing, images) may. Resuming
restores params, Adam state and step, re-creates the stream of the saved epoch and skips its already consumed
batches; on the CPU the resumed run's params are bitwise equal to an uninterrupted run's.

Evaluation: the same per-particle normalisation as in training is applied to the evaluation inputs (``x``) and
targets; for synthetic data the clean reference is standardised with the mean and std of its *noisy input*,
``r = (clean - mean(noisy_a)) / std(noisy_a)``, i.e. the same affine map that turns ``noisy_a`` into ``x``
(so ``x = r + noise / std(noisy_a)`` and ``r`` is, up to noise in the std estimates, what the N2N optimum
predicts). PSNR per particle is ``10 log10((max r - min r)^2 / mean((d - r)^2))`` dB, averaged over the held-out
particles, for ``d`` = denoised and ``d = x`` (noisy). With real pairs the evaluation particles are the first
``--n-eval`` particles of the first stacks (training data) and only the N2N loss against the other half is
reported.

Progress: a ``rich`` progress bar (loss, step/s, ETA) when stdout is a terminal; otherwise, or with
``--no-progress``, one line every ``--print-every`` steps.

The training loop, checkpoints (with SHA-256 checksums; a corrupted one is skipped for the previous good one),
signals, metrics and progress are :func:`jaxgrad.train.fit`'s; the model, data and evaluation are
:mod:`jaxgrad.cnn.task`'s; this script is their command line (``jaxgrad train cnn`` is the TOML one).

``main(argv)`` returns the summary dict (tests call it directly); errors in the arguments or the data raise
``SystemExit(2)`` with a message naming the option or file.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from jaxgrad.cnn import data as cnn_data  # noqa: E402
from jaxgrad.cnn import denoiser  # noqa: E402
from jaxgrad.cnn import task as cnn_task  # noqa: E402
from jaxgrad.cnn.task import psnr_db, save_examples  # noqa: E402,F401  (re-exported for users of the script)
from jaxgrad.train import TrainConfig, fit, log_end, rundir  # noqa: E402
from jaxgrad.train.checkpoint import Checkpointer  # noqa: E402
from jaxgrad.train.errors import ConfigError  # noqa: E402
from jaxgrad.train.metrics import CSV_FILE, METRICS_FILE, last_logged_loss  # noqa: E402

SCRIPT = "cnn_train"
RUN_FILE = rundir.RUN_FILE
SUMMARY_FILE = "summary.json"
EXAMPLES_FILE = "examples.png"
CKPT_DIR = "checkpoints"
IMAGES_DIR = "images"
SYNTH_DIR = cnn_task.SYNTH_DIR
OWNED = (RUN_FILE, METRICS_FILE, CSV_FILE, SUMMARY_FILE, EXAMPLES_FILE, CKPT_DIR, IMAGES_DIR, SYNTH_DIR, "tensorboard")

# Options with a value; None in the parsed args means "not given" (so --resume can tell what the user repeated).
DEFAULTS: dict[str, Any] = {
    "channels": [1, 16, 16, 1], "residual": False, "batch_size": 16, "buffer_size": None, "chunk_size": None,
    "seed": 0, "lr": 1e-3, "backend": "xla", "precision": "default", "epochs": None, "steps": None,
    "checkpoint_every": 500, "keep": 3, "log_every": 10, "print_every": 100, "image_every": 0, "n_examples": 4,
    "n_eval": 64, "size": 64, "snr": 0.1, "synthetic_chunk": 256,
}
DEFAULT_EPOCHS = 10
DEFAULT_BUFFER = 1024
# Must not change on --resume: they define the network or the sequence of batches.
FIXED = ("channels", "residual", "batch_size", "buffer_size", "chunk_size", "seed", "data")

UsageError = ConfigError  # a bad option or input file; main() turns it into SystemExit(2) with the message


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cnn_train.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("data (one of --pairs, --inputs/--targets, --synthetic; none with --resume)")
    g.add_argument("--pairs", nargs=2, action="append", metavar=("A.mrc", "B.mrc"),
                   help="two aligned noisy half-set stacks (input, target); repeat for more files")
    g.add_argument("--inputs", nargs="+", metavar="A.mrc", help="input stacks (aligned one-to-one with --targets)")
    g.add_argument("--targets", nargs="+", metavar="B.mrc", help="target stacks")
    g.add_argument("--synthetic", type=int, metavar="N", help="generate N synthetic particle pairs into DIR/synthetic")
    g.add_argument("--size", type=int, help=f"synthetic image size in pixels (default {DEFAULTS['size']})")
    g.add_argument("--snr", type=float, help=f"synthetic signal-to-noise ratio (default {DEFAULTS['snr']})")
    g.add_argument("--synthetic-chunk", type=int, help="particles generated at a time (default 256)")
    g.add_argument("--n-eval", type=int, help="evaluation particles: synthetic held-out set / first particles of "
                                              "the pairs (default 64)")
    g = ap.add_argument_group("model and optimisation")
    g.add_argument("--channels", help="comma-separated widths, first and last 1 (default 1,16,16,1)")
    g.add_argument("--residual", action="store_true", default=None, help="predict x + net(x)")
    g.add_argument("--batch-size", type=int, help="particles per batch (default 16)")
    g.add_argument("--buffer-size", type=int, help="particles held in the shuffle buffer, the memory bound "
                                                   f"(default min(n, max({DEFAULT_BUFFER}, batch size)))")
    g.add_argument("--chunk-size", type=int, help="contiguous particles per read (default buffer size // 16)")
    g.add_argument("--epochs", type=int, help=f"epochs to train (default {DEFAULT_EPOCHS}); or --steps")
    g.add_argument("--steps", type=int, help="total optimiser steps (counted from the start of the run)")
    g.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3)")
    g.add_argument("--backend", choices=("xla", "pallas"), help="conv2d backend (default xla)")
    g.add_argument("--precision", choices=("default", "highest"), help="matmul/conv precision (default: JAX's)")
    g.add_argument("--seed", type=int, help="init, shuffling and synthetic data seed (default 0)")
    g = ap.add_argument_group("run directory, checkpoints, logging")
    g.add_argument("--out", required=True, metavar="DIR", help="run directory")
    g.add_argument("--resume", action="store_true", help="continue the run in DIR from its latest checkpoint")
    g.add_argument("--overwrite", action="store_true", help="start fresh in a non-empty DIR (replaces only the "
                                                            "files this script owns)")
    g.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 500)")
    g.add_argument("--keep", type=int, help="checkpoints kept (default 3)")
    g.add_argument("--log-every", type=int, help="steps per metrics.jsonl line (default 10)")
    g.add_argument("--print-every", type=int, help="steps per printed line without progress bar (default 100)")
    g.add_argument("--image-every", type=int, help="steps between example PNGs in DIR/images (default 0: end only)")
    g.add_argument("--n-examples", type=int, help="particles shown in the PNGs (default 4)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (print lines instead)")
    return ap


def _parse_channels(text: str) -> tuple[int, ...]:
    try:
        chans = tuple(int(c) for c in str(text).split(","))
    except ValueError:
        raise UsageError(f"--channels: expected comma-separated integers such as 1,16,16,1, got {text!r}") from None
    if len(chans) < 2 or min(chans) < 1:
        raise UsageError(f"--channels: need at least two widths >= 1 (input, hidden..., output), got {text!r}")
    if chans[0] != 1 or chans[-1] != 1:
        raise UsageError(f"--channels: the first and last widths must be 1 (MRC particles are single-channel "
                         f"images), got {text!r}")
    return chans


def _check_int(name: str, v, lo: int) -> None:
    if v is not None and v < lo:
        raise UsageError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")


def _data_spec(args) -> dict | None:
    """The data part of the configuration from the command line (None if no data option was given)."""
    pairs = [tuple(p) for p in (args.pairs or [])]
    if args.inputs or args.targets:
        if not (args.inputs and args.targets):
            raise UsageError("--inputs and --targets must be given together")
        if len(args.inputs) != len(args.targets):
            raise UsageError(f"--inputs has {len(args.inputs)} file(s) but --targets has {len(args.targets)}; they "
                             f"are paired one-to-one")
        pairs += list(zip(args.inputs, args.targets))
    if pairs and args.synthetic is not None:
        raise UsageError("give either --pairs/--inputs/--targets or --synthetic, not both")
    if args.synthetic is not None:
        _check_int("synthetic", args.synthetic, 1)
        for name in ("size", "synthetic_chunk"):
            _check_int(name, getattr(args, name), 2 if name == "size" else 1)
        snr = args.snr if args.snr is not None else DEFAULTS["snr"]
        if not snr > 0:
            raise UsageError(f"--snr must be > 0, got {snr}")
        return {"kind": "synthetic", "n": int(args.synthetic),
                "size": int(args.size if args.size is not None else DEFAULTS["size"]), "snr": float(snr),
                "n_eval": int(args.n_eval if args.n_eval is not None else DEFAULTS["n_eval"])}
    for name in ("size", "snr", "synthetic_chunk"):
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} only applies to --synthetic")
    if pairs:
        return {"kind": "pairs", "inputs": [str(pathlib.Path(a).resolve()) for a, _ in pairs],
                "targets": [str(pathlib.Path(b).resolve()) for _, b in pairs],
                "n_eval": int(args.n_eval if args.n_eval is not None else DEFAULTS["n_eval"])}
    return None


def _given_config(args) -> dict:
    """The options given on the command line (canonical form), data spec under "data"."""
    cfg = {}
    for k in DEFAULTS:
        if k in ("size", "snr", "synthetic_chunk", "n_eval"):
            continue
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    if "channels" in cfg:
        cfg["channels"] = list(_parse_channels(cfg["channels"]))
    data = _data_spec(args)
    if data is not None:
        cfg["data"] = data
    if args.synthetic_chunk is not None:
        cfg["synthetic_chunk"] = args.synthetic_chunk
    return cfg


def _validate(cfg: dict) -> None:
    for name, lo in (("batch_size", 1), ("buffer_size", 1), ("chunk_size", 1), ("epochs", 1), ("steps", 1),
                     ("checkpoint_every", 1), ("keep", 1), ("log_every", 1), ("print_every", 1),
                     ("image_every", 0), ("n_examples", 1), ("seed", 0)):
        _check_int(name, cfg.get(name), lo)
    if cfg.get("epochs") is not None and cfg.get("steps") is not None:
        raise UsageError("give --epochs or --steps, not both")
    if not cfg["lr"] > 0:
        raise UsageError(f"--lr must be > 0, got {cfg['lr']}")
    if cfg["data"].get("n_eval", 1) < 1:
        raise UsageError(f"--n-eval must be >= 1, got {cfg['data']['n_eval']}")
    if cfg.get("buffer_size") is not None and cfg["buffer_size"] < cfg["batch_size"]:
        raise UsageError(f"--buffer-size ({cfg['buffer_size']}) must be >= --batch-size ({cfg['batch_size']})")
    if cfg.get("buffer_size") is not None and cfg.get("chunk_size") is not None and \
            cfg["chunk_size"] > cfg["buffer_size"] - cfg["batch_size"] + 1:
        raise UsageError(f"--chunk-size ({cfg['chunk_size']}) must be <= --buffer-size - --batch-size + 1 "
                         f"({cfg['buffer_size'] - cfg['batch_size'] + 1})")
    try:
        denoiser.DenoiserConfig(tuple(cfg["channels"]), residual=bool(cfg["residual"]))
    except ValueError as err:
        raise UsageError(f"--channels/--residual: {err}") from None


def _merge_config(given: dict, saved: dict | None) -> dict:
    if saved is None:
        if "data" not in given:
            raise UsageError("no data: give --pairs A.mrc B.mrc, --inputs ... --targets ..., or --synthetic N")
        cfg = {k: v for k, v in DEFAULTS.items() if k not in ("size", "snr", "n_eval")}
        cfg.update(given)
        return cfg
    cfg = dict(saved)
    for k in FIXED:
        if k in given and given[k] != saved.get(k):
            raise UsageError(f"--resume: {k.replace('_', '-')} was {saved.get(k)!r} in this run, got {given[k]!r}; "
                             f"options that define the model or the batch sequence cannot change")
    for k, v in given.items():
        if k not in FIXED:
            cfg[k] = v
    if "steps" in given:
        cfg["epochs"] = None
    elif "epochs" in given:
        cfg["steps"] = None
    return cfg


def _abstract_state(cfg: dict):
    model = denoiser.DenoiserConfig(tuple(cfg["channels"]), residual=bool(cfg["residual"]))
    params = jax.eval_shape(lambda: denoiser.init(jax.random.key(cfg["seed"]), model))
    return {"params": params, "opt_state": jax.eval_shape(optax.adam(float(cfg["lr"])).init, params),
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}


def load_checkpoint(out, step: int | None = None):
    """``(params, opt_state, meta)`` of checkpoint ``step`` (default: the latest) of the run in ``out``."""
    out = pathlib.Path(out)
    run = rundir.read_run_file(out, SCRIPT)
    if run is None:
        raise FileNotFoundError(f"{out}: no {RUN_FILE}")
    ckpt = Checkpointer(out / CKPT_DIR, run["config"]["keep"], create=False)
    try:
        step = max(ckpt.steps(), default=None) if step is None else step
        if step is None:
            raise FileNotFoundError(f"{out / CKPT_DIR}: no checkpoint")
        state, meta = ckpt.restore(step, _abstract_state(run["config"]))
        return state["params"], state["opt_state"], meta
    finally:
        ckpt.close()


def _prepare(args, out: pathlib.Path):
    """Everything up to training: checks (before DIR is touched), run.json, data, stream, evaluation set."""
    given = _given_config(args)
    saved = rundir.inspect(out, SCRIPT, OWNED, resume=args.resume, overwrite=args.overwrite)
    resuming = saved is not None
    cfg = _merge_config(given, saved["config"] if resuming else None)
    _validate(cfg)
    spec = cfg["data"]
    ins, outs = cnn_task.open_pairs(spec["inputs"], spec["targets"]) if spec["kind"] == "pairs" else ([], [])
    stream = None
    try:
        n_particles = spec["n"] if spec["kind"] == "synthetic" else sum(len(s) for s in ins)
        if cfg["batch_size"] > n_particles:
            raise UsageError(f"--batch-size ({cfg['batch_size']}) is larger than the number of particles "
                             f"({n_particles})")
        # DIR: from here on it is a run of this script (run.json first, so that --resume/--overwrite work)
        if not resuming:
            if args.overwrite:
                rundir.clear_owned(out, OWNED)
            out.mkdir(parents=True, exist_ok=True)
            rundir.write_run_file(out, SCRIPT, cfg, fingerprints=None)
        if spec["kind"] == "synthetic":
            cnn_task.ensure_synthetic(out, spec, cfg["seed"], cfg["synthetic_chunk"], print)
            root = out / SYNTH_DIR / "train"
            ins, outs = cnn_task.open_pairs([str(root / "noisy_a.mrc")], [str(root / "noisy_b.mrc")])
        fingerprints = [cnn_task.fingerprint(s) for s in ins + outs]
        if resuming and saved.get("fingerprints") not in (None, fingerprints):
            raise UsageError(f"--resume: the input stacks changed since the run started (was "
                             f"{saved['fingerprints']}, now {fingerprints})")
        if cfg["buffer_size"] is None:
            cfg["buffer_size"] = max(cfg["batch_size"], min(DEFAULT_BUFFER, n_particles))
        try:
            stream = cnn_data.ParticleStream(None, cfg["batch_size"], buffer_size=cfg["buffer_size"],
                                             seed=cfg["seed"], chunk_size=cfg["chunk_size"], drop_last=True,
                                             pairs=(ins, outs))
        except ValueError as err:
            raise UsageError(str(err).replace("ParticleStream: 'buffer_size'", "--buffer-size")
                             .replace("ParticleStream: 'chunk_size'", "--chunk-size")) from None
        cfg["chunk_size"] = stream.chunk_size
        rundir.write_run_file(out, SCRIPT, cfg, fingerprints=fingerprints)
        evalset = cnn_task.eval_set(out, cfg, ins, outs)
    except BaseException:
        if stream is not None:
            stream.close()
        for s in ins + outs:
            s.close()
        raise
    return cfg, resuming, stream, ins + outs, evalset


def main(argv=None, *, step_callback=None):
    """Run the script; returns the summary dict. ``step_callback(step, loss)`` (tests) runs after every step, after
    that step's checkpoint if one is due; ``loss`` is the step's loss as a device scalar."""
    ap = build_parser()
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    try:
        cfg, resuming, stream, stacks, evalset = _prepare(args, out)
    except (ConfigError, rundir.RunDirError, cnn_data.MRCFormatError, FileNotFoundError, FileExistsError) as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    try:
        nb = len(stream)
        total = cfg["steps"] if cfg["steps"] is not None else nb * (cfg["epochs"] or DEFAULT_EPOCHS)
        tcfg = TrainConfig(steps=total, optimizer="adam", lr=float(cfg["lr"]), seed=cfg["seed"],
                           checkpoint_every=cfg["checkpoint_every"], keep=cfg["keep"], log_every=cfg["log_every"],
                           print_every=cfg["print_every"], nan_policy="stop")
        model_kw = {"residual": bool(cfg["residual"]), "backend": cfg["backend"], "precision": cfg["precision"]}
        den = functools.partial(cnn_task.denoise, batch_size=cfg["batch_size"], **model_kw)
        task = cnn_task.make_task(stream, channels=cfg["channels"], **model_kw,
                                  describe=f"{stream}; buffer {stream.buffer_nbytes / 2**20:.1f} MiB; network "
                                           f"{list(cfg['channels'])}{' residual' if cfg['residual'] else ''}; "
                                           f"backend {cfg['backend']}, precision {cfg['precision']}")

        def images(step, params, loss):
            (out / IMAGES_DIR).mkdir(exist_ok=True)
            cnn_task.write_examples(out / IMAGES_DIR / f"step_{step:07d}.png", params, step, loss, evalset,
                                    cfg["n_examples"], den)

        wall0 = time.perf_counter()
        use_bar = not args.no_progress and sys.stdout.isatty()
        res = fit(task, tcfg, out, resuming=resuming, use_bar=use_bar, argv=argv, step_callback=step_callback,
                  hooks=((cfg["image_every"], images),))
        # -- end of the run: images and summary
        params, step = res.state["params"], res.step
        final_loss = res.final_loss if res.final_loss is not None else last_logged_loss(out / METRICS_FILE)
        cnn_task.write_examples(out / EXAMPLES_FILE, params, step, final_loss, evalset, cfg["n_examples"], den)
        init_params = denoiser.init(jax.random.key(cfg["seed"]),
                                    denoiser.DenoiserConfig(tuple(cfg["channels"]), residual=bool(cfg["residual"])))
        ev = cnn_task.evaluation(params, init_params, evalset, den)
        summary = {"script": SCRIPT, "step": step, "epoch": step / nb, "batches_per_epoch": nb,
                   "final_loss": final_loss, "eval": ev, "wall_s_this_process": time.perf_counter() - wall0,
                   "device": str(jax.devices()[0]), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "versions": {"jax": jax.__version__, "optax": optax.__version__,
                                "python": platform.python_version()},
                   "config": cfg, "out": str(out)}
        cnn_task.write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
        log_end(out, res, final_loss=final_loss)
        msg = f"done: step {step}, final loss {final_loss}, eval N2N loss {ev['n2n_loss_initial']:.4f} -> " \
              f"{ev['n2n_loss_final']:.4f}"
        if "psnr_denoised_db" in ev:
            msg += f", PSNR noisy {ev['psnr_noisy_db']:.2f} dB -> denoised {ev['psnr_denoised_db']:.2f} dB"
        print(msg + f"; wrote {out / SUMMARY_FILE}, {out / EXAMPLES_FILE}", flush=True)
        return summary
    finally:
        stream.close()
        for s in stacks:
            s.close()


if __name__ == "__main__":
    main()
