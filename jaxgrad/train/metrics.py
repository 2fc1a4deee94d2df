"""Metrics files and the progress display.

:class:`MetricsLog` appends one JSON object per line to ``metrics.jsonl`` (never truncated; step lines and
``{"event": ...}`` lines) and the step lines to ``metrics.csv`` (one header for the file, also across resumes; only a
change of the columns starts a new header block), and mirrors scalars to TensorBoard when ``tensorboardX`` or
``torch.utils.tensorboard`` is importable. :class:`Reporter` shows a ``rich`` progress bar (step, loss, step/s and
the task's throughput unit per second -- ``items/s``, or ``tokens/s`` for a language model -- and ETA) on a
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
        cut = not _ends_with_newline(self.out / METRICS_FILE)
        self._jsonl = open(self.out / METRICS_FILE, "a")
        if cut:
            self._jsonl.write("\n")  # a line cut short by a crash stays a line of its own
        self._csv_path = self.out / CSV_FILE
        self._csv_fields: list[str] | None = _last_csv_header(self._csv_path)
        if not _ends_with_newline(self._csv_path):
            with open(self._csv_path, "a", newline="") as f:
                f.write("\r\n")  # a row cut short by a crash stays a row of its own
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


def _ends_with_newline(path: pathlib.Path) -> bool:
    """True for an empty or absent file or one whose last byte is a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except FileNotFoundError:
        return True


def _last_csv_header(path: pathlib.Path) -> list[str] | None:
    """The columns of the last header block of an existing ``metrics.csv`` (a header row starts with ``step``,
    a data row with a number), so a resumed run appends to it without a second header."""
    if not path.exists():
        return None
    header = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "step":
                header = row
    return header


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

    def __init__(self, use_bar: bool, total: int, start: int, print_every: int, label: str = "train",
                 unit: str = "items"):
        self.total, self.print_every, self.unit = total, print_every, unit
        self.progress = None
        if use_bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
                                     TextColumn("{task.fields[sps]} step/s"),
                                     TextColumn(f"{{task.fields[ips]}} {unit}/s"),
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
                  f"{fmt(ips, '.0f')} {self.unit}/s", flush=True)
