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

``main(argv)`` returns the summary dict (tests call it directly); errors in the arguments or the data raise
``SystemExit(2)`` with a message naming the option or file.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxgrad.cnn import data as cnn_data  # noqa: E402
from jaxgrad.cnn import denoiser, synthetic  # noqa: E402

SCRIPT = "cnn_train"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
EXAMPLES_FILE = "examples.png"
CKPT_DIR = "checkpoints"
IMAGES_DIR = "images"
SYNTH_DIR = "synthetic"
OWNED = (RUN_FILE, METRICS_FILE, SUMMARY_FILE, EXAMPLES_FILE, CKPT_DIR, IMAGES_DIR, SYNTH_DIR)

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


class UsageError(ValueError):
    """A bad option or input file; main() turns it into ``SystemExit(2)`` with the message."""


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------------
# Run directory
# ----------------------------------------------------------------------------------------------------------------

def _write_atomic(path: pathlib.Path, data: bytes | str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_run_file(out: pathlib.Path) -> dict | None:
    p = out / RUN_FILE
    if not p.exists():
        return None
    try:
        run = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{p}: not a valid run file ({err})") from None
    if not isinstance(run, dict) or run.get("script") != SCRIPT:
        raise UsageError(f"{p} was not written by {SCRIPT}.py; refusing to touch {out}")
    return run


def _inspect_out_dir(out: pathlib.Path, resume: bool, overwrite: bool) -> dict | None:
    """Read-only checks of DIR; returns the saved run file when resuming (None: fresh run)."""
    if resume and overwrite:
        raise UsageError("give --resume or --overwrite, not both")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    listing = f"{', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}"
    run = _read_run_file(out) if entries else None
    if resume:
        if run is None and entries:
            raise UsageError(f"--resume: {out} is not empty but has no {RUN_FILE} of a {SCRIPT} run; nothing to "
                             f"resume (entries: {listing})")
        return run  # None if DIR is empty or absent: start fresh
    if entries:
        if not overwrite:
            raise UsageError(f"--out {out} is not empty ({listing}); use a new directory, --resume to continue a "
                             f"run, or --overwrite to start again (replaces only this script's files)")
        owned = [e for e in entries if e in OWNED]
        if owned and run is None:
            raise UsageError(f"--overwrite: {out} holds {', '.join(owned)} but no {RUN_FILE} of a {SCRIPT} run; "
                             f"refusing to delete files this script did not create")
    return None


def _clear_owned(out: pathlib.Path) -> None:
    """Delete the entries of DIR this script owns (only called after _inspect_out_dir allowed it)."""
    for e in (*OWNED[1:], RUN_FILE):  # run.json last: an interrupted clean-up can be redone
        p = out / e
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


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


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------

def _fingerprint(stack: cnn_data.MRCStack) -> dict:
    """Name, shape and size of a stack (no directory: a synthetic run directory may be moved and resumed)."""
    return {"name": pathlib.Path(stack.path).name, "shape": list(stack.shape), "bytes": os.path.getsize(stack.path)}


def _open_pairs(inputs: list[str], targets: list[str]) -> tuple[list, list]:
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


def _heldout_seed(seed: int) -> int:
    return int(np.random.SeedSequence(seed, spawn_key=(0x4E32,)).generate_state(1)[0])


def _ensure_synthetic(out: pathlib.Path, spec: dict, seed: int, chunk: int, say) -> None:
    """Write DIR/synthetic/{train,heldout}/*.mrc unless a complete set for ``spec`` is there already."""
    root = out / SYNTH_DIR
    marker = root / "synthetic.json"
    want = {"n": spec["n"], "size": spec["size"], "snr": spec["snr"], "seed": seed, "n_eval": spec["n_eval"],
            "heldout_seed": _heldout_seed(seed)}
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
    _write_atomic(marker, json.dumps(want) + "\n")
    say(f"  done in {time.perf_counter() - t0:.1f} s")


def _standardize_like(ref: np.ndarray, noisy: np.ndarray) -> np.ndarray:
    """``(ref - mean(noisy)) / std(noisy)`` per image (the affine map of ``normalize_per_particle(noisy)``)."""
    mean = noisy.mean(axis=(-2, -1), keepdims=True, dtype=np.float64)
    std = np.sqrt(np.mean(np.square(noisy - mean), axis=(-2, -1), keepdims=True))
    return ((ref - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)


def _eval_set(out: pathlib.Path, cfg: dict, ins: list, outs: list) -> dict:
    """Evaluation particles (normalised as in training): x, target [n, H, W, 1], and ref (clean) or None."""
    spec = cfg["data"]
    n = spec["n_eval"]
    if spec["kind"] == "synthetic":
        d = out / SYNTH_DIR / "heldout"
        with cnn_data.open_stack(d / "noisy_a.mrc") as a, cnn_data.open_stack(d / "noisy_b.mrc") as b, \
                cnn_data.open_stack(d / "clean.mrc") as c:
            xa, xb, clean = a.read(slice(0, n)), b.read(slice(0, n)), c.read(slice(0, n))
        ref = _standardize_like(clean, xa)[..., None]
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


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------

def _optimizer(lr: float) -> optax.GradientTransformation:
    return optax.adam(lr)


@functools.lru_cache(maxsize=None)
def _compiled(lr: float, residual: bool, backend: str, precision_name: str):
    """The jitted train step and apply for one configuration (cached: repeated main() calls compile once)."""
    precision = jax.lax.Precision.HIGHEST if precision_name == "highest" else None
    step = denoiser.make_train_step(_optimizer(lr), residual=residual, backend=backend, precision=precision)
    apply_fn = jax.jit(functools.partial(denoiser.apply, residual=residual, backend=backend, precision=precision))
    return step, apply_fn


def _model_config(cfg: dict) -> denoiser.DenoiserConfig:
    return denoiser.DenoiserConfig(tuple(cfg["channels"]), residual=bool(cfg["residual"]))


def _init_state(cfg: dict):
    params = denoiser.init(jax.random.key(cfg["seed"]), _model_config(cfg))
    return params, _optimizer(cfg["lr"]).init(params)


def _manager(out: pathlib.Path, keep: int, create: bool = True):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=create,
                                        cleanup_tmp_directories=True)
    return ocp.CheckpointManager((out / CKPT_DIR).resolve(), options=opts, item_names=("state", "meta"))


def _save(mngr, step: int, params, opt_state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                                            meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()


def _restore(mngr, step: int, cfg: dict):
    import orbax.checkpoint as ocp

    abstract = jax.eval_shape(lambda: dict(zip(("params", "opt_state"), _init_state(cfg))))
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                   meta=ocp.args.JsonRestore()))
    return r.state["params"], r.state["opt_state"], dict(r.meta)


def load_checkpoint(out, step: int | None = None):
    """``(params, opt_state, meta)`` of checkpoint ``step`` (default: the latest) of the run in ``out``."""
    out = pathlib.Path(out)
    run = _read_run_file(out)
    if run is None:
        raise FileNotFoundError(f"{out}: no {RUN_FILE}")
    mngr = _manager(out, run["config"]["keep"], create=False)
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{out / CKPT_DIR}: no checkpoint")
        return _restore(mngr, step, run["config"])
    finally:
        mngr.close()


# ----------------------------------------------------------------------------------------------------------------
# Images, PSNR
# ----------------------------------------------------------------------------------------------------------------

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
# Training
# ----------------------------------------------------------------------------------------------------------------

class _StopRequest:
    """SIGINT/SIGTERM -> finish the current step, checkpoint, exit. The second signal gets the default action."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def _handler(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.getsignal(s)
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class _Reporter:
    """rich progress bar, or a printed line every ``print_every`` steps."""

    def __init__(self, use_bar: bool, total: int, start: int, print_every: int):
        self.use_bar, self.total, self.print_every = use_bar, total, print_every
        self.progress = None
        if use_bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
                                     TextColumn("{task.fields[sps]} step/s"), TimeElapsedColumn(),
                                     TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=total, completed=start, epoch="-", loss="-", sps="-")

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, flush=True)

    def advance(self, step: int, epoch: int, loss: float | None, sps: float | None) -> None:
        """``loss``/``sps``: of the latest metrics window (None before the first)."""
        if self.progress is not None:
            self.progress.update(self.task, completed=step, epoch=epoch,
                                 loss="-" if loss is None else f"{loss:.4f}", sps="-" if sps is None else f"{sps:.1f}")
        elif step % self.print_every == 0 or step == self.total:
            loss_txt = "-" if loss is None else f"{loss:.5f}"
            sps_txt = "-" if sps is None else f"{sps:.1f}"
            print(f"step {step}/{self.total}  epoch {epoch}  loss {loss_txt}  {sps_txt} step/s", flush=True)


def _last_logged_loss(path: pathlib.Path) -> float | None:
    if not path.exists():
        return None
    loss = None
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if "loss" in rec and "event" not in rec:
                loss = rec["loss"]
    return loss


def main(argv=None, *, step_callback=None):
    """Run the script; returns the summary dict. ``step_callback(step, loss)`` (tests) runs after every step, after
    that step's checkpoint if one is due; ``loss`` is the step's loss as a device scalar."""
    ap = build_parser()
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    ins: list = []
    outs: list = []
    stream = None
    try:
        try:
            # 1. everything that can be checked without touching DIR
            given = _given_config(args)
            saved = _inspect_out_dir(out, args.resume, args.overwrite)
            resuming = saved is not None
            cfg = _merge_config(given, saved["config"] if resuming else None)
            _validate(cfg)
            spec = cfg["data"]
            if spec["kind"] == "pairs":
                ins, outs = _open_pairs(spec["inputs"], spec["targets"])
            n_particles = spec["n"] if spec["kind"] == "synthetic" else sum(len(s) for s in ins)
            if cfg["batch_size"] > n_particles:
                raise UsageError(f"--batch-size ({cfg['batch_size']}) is larger than the number of particles "
                                 f"({n_particles})")
            # 2. DIR: from here on it is a run of this script (run.json first, so that --resume/--overwrite work)
            if not resuming:
                if args.overwrite:
                    _clear_owned(out)
                out.mkdir(parents=True, exist_ok=True)
                _write_atomic(out / RUN_FILE, json.dumps({"script": SCRIPT, "config": cfg, "fingerprints": None},
                                                         indent=1) + "\n")
            if spec["kind"] == "synthetic":
                _ensure_synthetic(out, spec, cfg["seed"], cfg["synthetic_chunk"], print)
                root = out / SYNTH_DIR / "train"
                ins, outs = _open_pairs([str(root / "noisy_a.mrc")], [str(root / "noisy_b.mrc")])
            fingerprints = [_fingerprint(s) for s in ins + outs]
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
            nb = len(stream)
            total = cfg["steps"] if cfg["steps"] is not None else nb * (cfg["epochs"] or DEFAULT_EPOCHS)
            _write_atomic(out / RUN_FILE, json.dumps({"script": SCRIPT, "config": cfg, "fingerprints": fingerprints},
                                                     indent=1) + "\n")
            evalset = _eval_set(out, cfg, ins, outs)
        except (UsageError, cnn_data.MRCFormatError, FileNotFoundError, FileExistsError) as err:
            ap.exit(2, f"{ap.prog}: error: {err}\n")
        use_bar = not args.no_progress and sys.stdout.isatty()
        return _train(out, cfg, stream, nb, total, evalset, resuming, use_bar, argv, step_callback)
    finally:
        if stream is not None:
            stream.close()
        for s in ins + outs:
            s.close()


def _train(out, cfg, stream, nb, total, evalset, resuming, use_bar, argv, step_callback):
    residual, backend = bool(cfg["residual"]), cfg["backend"]
    train_step, apply_fn = _compiled(float(cfg["lr"]), residual, backend, cfg["precision"])
    b = cfg["batch_size"]

    def denoise(params, x):  # in batches of B (padded: one compiled shape)
        outs = []
        for i in range(0, len(x), b):
            xb = x[i:i + b]
            pad = b - len(xb)
            if pad:
                xb = np.concatenate([xb, np.zeros((pad,) + xb.shape[1:], xb.dtype)])
            outs.append(np.asarray(apply_fn(params, jnp.asarray(xb)))[:b - pad])
        return np.concatenate(outs)

    def n2n_loss(d):
        return float(np.mean(np.square(d.astype(np.float64) - evalset["target"])))

    def examples(params, step, loss, path):
        k = min(cfg["n_examples"], len(evalset["x"]))
        x = evalset["x"][:k]
        d = denoise(params, x)
        third, name = ((evalset["ref"][:k], "clean") if evalset["ref"] is not None else
                       (evalset["target"][:k], "other half (target)"))
        full = denoise(params, evalset["x"])
        loss_txt = f"train loss {loss:.4f}" if loss is not None else "train loss -"
        save_examples(path, x, d, third, name, f"step {step}: {loss_txt}, eval N2N loss {n2n_loss(full):.4f}")

    mngr = _manager(out, cfg["keep"])
    metrics_path = out / METRICS_FILE
    metrics = open(metrics_path, "a")
    wall0 = time.perf_counter()

    def log(rec: dict) -> None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    try:
        latest = mngr.latest_step() if resuming else None
        if latest is not None:
            params, opt_state, meta = _restore(mngr, latest, cfg)
            step = int(meta["step"])
            if meta.get("batches_per_epoch") != nb or meta["epoch"] * nb + meta["batch_in_epoch"] != step:
                raise RuntimeError(f"checkpoint {latest}: data position {meta} does not match {nb} batches per "
                                   f"epoch")
        else:
            params, opt_state = _init_state(cfg)
            step = 0
        ckpt_step = step if latest is not None else None
        if step > total:
            print(f"note: the run is at step {step}, past the requested total of {total}; nothing to train",
                  flush=True)
        log({"event": "resume" if resuming else "start", "step": step, "time": time.time(), "total_steps": total,
             "batches_per_epoch": nb, "argv": list(sys.argv[1:] if argv is None else argv),
             "device": str(jax.devices()[0])})
        with _Reporter(use_bar, total, step, cfg["print_every"]) as rep, _StopRequest() as stop:
            rep.say(f"{stream}; {nb} batches per epoch; buffer {stream.buffer_nbytes / 2**20:.1f} MiB; "
                    f"network {list(cfg['channels'])}{' residual' if residual else ''}, "
                    f"{denoiser.parameter_count(params)} params; backend {backend}, precision {cfg['precision']}; "
                    f"{'resuming at' if resuming else 'starting at'} step {step} of {total} "
                    f"(epoch {step // nb}, batch {step % nb}) on {jax.devices()[0]}")
            window: list = []  # device scalars since the last log line
            t_win = time.perf_counter()
            last_loss = last_sps = None

            def checkpoint():
                nonlocal ckpt_step
                if window and not np.isfinite(np.asarray(jnp.stack(window))).all():  # never save diverged params
                    raise FloatingPointError(f"non-finite loss before step {step}; stopping (last good checkpoint: "
                                             f"step {ckpt_step})")
                _save(mngr, step, params, opt_state,
                      {"step": step, "epoch": step // nb, "batch_in_epoch": step % nb, "batches_per_epoch": nb,
                       "loss": last_loss, "time": time.time()})
                metrics.flush()
                os.fsync(metrics.fileno())
                ckpt_step = step

            while step < total and stop.signum is None:
                epoch, skip = divmod(step, nb)
                gen = stream.epoch(epoch)
                try:
                    for _ in range(skip):  # batches of this epoch consumed before the checkpoint
                        next(gen)
                    for x, y in gen:
                        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(x), jnp.asarray(y))
                        step += 1
                        window.append(loss)
                        if step % cfg["log_every"] == 0 or step == total:
                            losses = np.asarray(jnp.stack(window), np.float64)
                            now = time.perf_counter()
                            last_sps = len(window) / max(now - t_win, 1e-9)
                            last_loss = float(losses.mean())
                            log({"step": step, "epoch": (step - 1) // nb, "batch": (step - 1) % nb,
                                 "loss": last_loss, "loss_last": float(losses[-1]), "n_steps": len(window),
                                 "steps_per_s": last_sps, "time": time.time(), "elapsed_s": now - wall0})
                            if not math.isfinite(last_loss):
                                raise FloatingPointError(f"loss is {last_loss} at step {step}; stopping (last good "
                                                         f"checkpoint: step {ckpt_step})")
                            window, t_win = [], now
                        rep.advance(step, (step - 1) // nb, last_loss, last_sps)
                        if step % cfg["checkpoint_every"] == 0 or step == total:
                            checkpoint()
                        if cfg["image_every"] and step % cfg["image_every"] == 0:
                            (out / IMAGES_DIR).mkdir(exist_ok=True)
                            examples(params, step, last_loss, out / IMAGES_DIR / f"step_{step:07d}.png")
                        if step_callback is not None:
                            step_callback(step, loss)
                        if step >= total or stop.signum is not None:
                            break
                finally:
                    gen.close()
            if stop.signum is not None:
                if ckpt_step != step:
                    checkpoint()
                name = signal.Signals(stop.signum).name
                log({"event": "stopped", "step": step, "signal": name, "time": time.time()})
                rep.say(f"stopped by {name} at step {step}; checkpoint written; continue with --resume")
                raise SystemExit(128 + stop.signum)
            if ckpt_step != step:
                checkpoint()

        # -- end of the run: images and summary
        final_loss = last_loss if last_loss is not None else _last_logged_loss(metrics_path)
        examples(params, step, final_loss, out / EXAMPLES_FILE)
        init_params, _ = _init_state(cfg)
        d0, d1 = denoise(init_params, evalset["x"]), denoise(params, evalset["x"])
        ev = {"source": evalset["source"], "n": len(evalset["x"]), "n2n_loss_initial": n2n_loss(d0),
              "n2n_loss_final": n2n_loss(d1)}
        if evalset["ref"] is not None:
            ref = evalset["ref"]
            ev.update(mse_vs_clean_initial=float(np.mean(np.square(d0 - ref), dtype=np.float64)),
                      mse_vs_clean_final=float(np.mean(np.square(d1 - ref), dtype=np.float64)),
                      mse_noisy_vs_clean=float(np.mean(np.square(evalset["x"] - ref), dtype=np.float64)),
                      psnr_denoised_db=psnr_db(d1, ref), psnr_noisy_db=psnr_db(evalset["x"], ref),
                      psnr_definition="per particle 10 log10((max r - min r)^2 / mean((d - r)^2)), averaged; r = "
                                      "clean standardised with its noisy input's mean and std")
        wall = time.perf_counter() - wall0
        summary = {"script": SCRIPT, "step": step, "epoch": step / nb, "batches_per_epoch": nb,
                   "final_loss": final_loss, "eval": ev, "wall_s_this_process": wall,
                   "device": str(jax.devices()[0]), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "versions": {"jax": jax.__version__, "optax": optax.__version__,
                                "python": platform.python_version()},
                   "config": cfg, "out": str(out)}
        _write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
        log({"event": "end", "step": step, "time": time.time(), "final_loss": final_loss})
        msg = f"done: step {step}, final loss {final_loss}, eval N2N loss {ev['n2n_loss_initial']:.4f} -> " \
              f"{ev['n2n_loss_final']:.4f}"
        if "psnr_denoised_db" in ev:
            msg += f", PSNR noisy {ev['psnr_noisy_db']:.2f} dB -> denoised {ev['psnr_denoised_db']:.2f} dB"
        print(msg + f"; wrote {out / SUMMARY_FILE}, {out / EXAMPLES_FILE}", flush=True)
        return summary
    finally:
        with contextlib.suppress(Exception):
            metrics.close()
        mngr.close()


if __name__ == "__main__":
    main()
