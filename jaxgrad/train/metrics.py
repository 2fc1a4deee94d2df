"""Metrics files and the progress display.

:class:`MetricsLog` appends one JSON object per line to ``metrics.jsonl`` (never truncated; step lines and
``{"event": ...}`` lines) and the step lines to ``metrics.csv`` (header written once; a new column after a resume
starts a new header block), and mirrors scalars to TensorBoard when ``tensorboardX`` or ``torch.utils.tensorboard``
is importable. :class:`Reporter` shows a ``rich`` progress bar (step, loss, step/s and items/s, ETA) on a
terminal, or prints a line every ``print_every`` steps.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib

METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
TB_DIR = "tensorboard"


def _tensorboard_writer(logdir: pathlib.Path):
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            module = __import__(mod, fromlist=["SummaryWriter"])
        except Exception:  # noqa: BLE001 - absent or broken: TensorBoard is optional
            continue
        return module.SummaryWriter(str(logdir))
    return None


class MetricsLog:
    def __init__(self, out: pathlib.Path, *, tensorboard: bool = True):
        self.out = pathlib.Path(out)
        self._jsonl = open(self.out / METRICS_FILE, "a")
        self._csv_path = self.out / CSV_FILE
        self._csv_fields: list[str] | None = None
        self._tb = _tensorboard_writer(self.out / TB_DIR) if tensorboard else None

    def event(self, rec: dict) -> None:
        self._write_json(rec)

    def step(self, rec: dict) -> None:
        self._write_json(rec)
        fields = list(rec)
        new = not self._csv_path.exists()
        with open(self._csv_path, "a", newline="") as f:
            w = csv.writer(f)
            if new or fields != self._csv_fields:
                w.writerow(fields)
                self._csv_fields = fields
            w.writerow([rec[k] for k in fields])
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, rec["step"])

    def _write_json(self, rec: dict) -> None:
        self._jsonl.write(json.dumps(rec, default=float) + "\n")
        self._jsonl.flush()

    def sync(self) -> None:
        """fsync ``metrics.jsonl`` (at every checkpoint: the log never lags a checkpoint after a crash)."""
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def last_logged_loss(path: pathlib.Path) -> float | None:
    path = pathlib.Path(path)
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


class Reporter:
    """rich progress bar, or a printed line every ``print_every`` steps."""

    def __init__(self, use_bar: bool, total: int, start: int, print_every: int, label: str = "train"):
        self.total, self.print_every = total, print_every
        self.progress = None
        if use_bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
                                     TextColumn("{task.fields[sps]} step/s"), TextColumn("{task.fields[ips]} items/s"),
                                     TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.progress.add_task(label, total=total, completed=start, epoch="-", loss="-", sps="-",
                                               ips="-")

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

    def advance(self, step: int, epoch: int, loss: float | None, sps: float | None, ips: float | None) -> None:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)

        if self.progress is not None:
            self.progress.update(self.task, completed=step, epoch=epoch, loss=fmt(loss, ".4g"), sps=fmt(sps, ".1f"),
                                 ips=fmt(ips, ".0f"))
        elif step % self.print_every == 0 or step == self.total:
            print(f"step {step}/{self.total}  epoch {epoch}  loss {fmt(loss, '.5g')}  {fmt(sps, '.1f')} step/s  "
                  f"{fmt(ips, '.0f')} items/s", flush=True)
