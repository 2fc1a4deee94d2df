"""The loss curve of a run: read from its ``metrics.jsonl`` (:mod:`jaxgrad.train.metrics`), drawn to a PNG beside it.

What the file holds (one JSON object a line, appended, never truncated): step records ``{"step", "loss", ...}``
(``loss``: the mean over the last ``log_every`` steps of the steps applied, NaN when the NaN guard skipped all of
them; ``skipped``: how many were skipped, under ``nan_policy="skip"``) and events ``{"event": ...}``: ``start`` /
``resume`` at the step the run (re)starts from, ``eval`` with the task's held-out numbers, ``end`` with the final
``eval``. A resumed run restarts from its last checkpoint, so the records past that step written before the
restart were undone: :func:`loss_history` drops them at each ``start`` / ``resume``, and where a step is logged
twice the later record wins. A line cut short by a crash is not JSON and is counted, not read.

Held-out points: the numbers of ``eval`` events (and of the ``end`` event's ``eval``) whose key contains
``"loss"`` (``heldout_loss`` of ``lora``, ``eval_n2n_loss`` of ``cnn``); other numbers (``kan``'s RMSEs) are not
losses and are not drawn on the loss axis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from jaxgrad.train.metrics import METRICS_FILE
from jaxgrad.train.rundir import RUN_FILE

__all__ = ["LOSS_PLOT", "LossHistory", "loss_history", "plot_loss_curve"]

#: the PNG :func:`plot_loss_curve` writes beside ``metrics.jsonl`` by default
LOSS_PLOT = "loss.png"


@dataclasses.dataclass(frozen=True)
class LossHistory:
    """A run's losses by step (sorted), after resumes and duplicates are resolved.

    ``train``: ``{step: loss}`` (NaN where every step of the logged window was skipped); ``skipped``:
    ``{step: n}`` for records that report ``n > 0`` skipped steps; ``heldout``: ``{key: {step: value}}``;
    ``restarts``: the steps a ``resume`` event restarted from; ``bad_lines``: lines that are not JSON objects."""

    train: dict
    skipped: dict
    heldout: dict
    restarts: list
    bad_lines: int


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def loss_history(metrics_path) -> LossHistory:
    """Read ``metrics_path`` (a ``metrics.jsonl`` or a run directory holding one); see the module docstring."""
    path = _metrics_file(metrics_path)
    train, skipped, heldout, restarts, bad = {}, {}, {}, [], 0

    def cut(after: int) -> None:  # records past a restart's step were undone by the restore
        for table in (train, skipped, *heldout.values()):
            for s in [s for s in table if s > after]:
                del table[s]

    def held(step, values) -> None:
        for k, v in values.items():
            if "loss" in k and _number(v):
                heldout.setdefault(k, {})[step] = float(v)

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if not isinstance(rec, dict) or not _number(rec.get("step")):
                bad += 1
                continue
            step, event = int(rec["step"]), rec.get("event")
            if event in ("start", "resume"):
                cut(step)
                if event == "resume":
                    restarts.append(step)
            elif event == "eval":
                held(step, rec)
            elif event == "end" and isinstance(rec.get("eval"), dict):
                held(step, rec["eval"])
            elif event is None and _number(rec.get("loss")):
                train[step] = float(rec["loss"])
                skipped.pop(step, None)
                if _number(rec.get("skipped")) and rec["skipped"] > 0:
                    skipped[step] = int(rec["skipped"])
    return LossHistory(train=dict(sorted(train.items())), skipped=dict(sorted(skipped.items())),
                       heldout={k: dict(sorted(v.items())) for k, v in sorted(heldout.items()) if v},
                       restarts=restarts, bad_lines=bad)


def _metrics_file(metrics_path) -> pathlib.Path:
    try:
        path = pathlib.Path(metrics_path)
    except TypeError:
        raise TypeError(f"plot_loss_curve: 'metrics_path' must be a path, got {type(metrics_path).__name__}") \
            from None
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"plot_loss_curve: 'metrics_path' {metrics_path} is not a metrics file nor a run "
                                f"directory holding {METRICS_FILE}")
    return path


def _family(run_dir: pathlib.Path) -> str | None:
    """The run's family from ``run.json`` (``{"script": "jaxgrad train <family>"}``), if there is one."""
    try:
        script = json.loads((run_dir / RUN_FILE).read_text()).get("script", "")
    except (OSError, ValueError, AttributeError):
        return None
    return script.removeprefix("jaxgrad train ") if isinstance(script, str) and script.startswith("jaxgrad train ") \
        else None


def plot_loss_curve(metrics_path, out_png=None) -> pathlib.Path:
    """Draw a run's training loss per logged step (a log axis when every loss is positive), its held-out loss
    points, the steps a resume restarted from (dotted lines) and the logged windows with skipped steps (red
    ticks), titled with the run's family and directory; write it to ``out_png`` (default :data:`LOSS_PLOT` beside
    the metrics file; parent folders are created). Returns the PNG's path.

    Raises ``FileNotFoundError`` naming ``metrics_path`` when it is neither a metrics file nor a run directory
    holding one, ``ValueError`` naming it when it holds no finite training loss, and naming ``out_png`` when that
    does not end in ``.png``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogFormatter, MaxNLocator
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_loss_curve needs matplotlib (pip install matplotlib)") from e

    path = _metrics_file(metrics_path)
    out = path.parent / LOSS_PLOT if out_png is None else pathlib.Path(out_png)
    if out.suffix.lower() != ".png":
        raise ValueError(f"plot_loss_curve: 'out_png' must be a .png path, got {out_png}")
    hist = loss_history(path)
    finite = [v for v in hist.train.values() if math.isfinite(v)]
    if not finite:
        raise ValueError(f"plot_loss_curve: 'metrics_path' {path} holds no finite training loss (no step record "
                         f"{{'step', 'loss'}} with a number; {len(hist.train)} non-finite, {hist.bad_lines} lines "
                         f"not JSON)")

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # a NaN window stays NaN: the line breaks there instead of bridging it
    ax.plot(list(hist.train), list(hist.train.values()), lw=1.2, color="tab:blue",
            marker="." if len(hist.train) <= 50 else None, label="train loss")
    for i, (key, points) in enumerate(hist.heldout.items()):
        shown = [(s, v) for s, v in points.items() if math.isfinite(v)]
        if shown:
            ax.plot(*zip(*shown), ls="none", marker="o", ms=5, color=f"C{1 + i}", label=key.replace("_", " "))
    n_nan = len(hist.train) - len(finite)
    if hist.skipped:
        ax.plot(list(hist.skipped), [0.0] * len(hist.skipped), ls="none", marker="|", ms=12, color="tab:red",
                transform=ax.get_xaxis_transform(),
                label=f"{sum(hist.skipped.values())} steps skipped (non-finite)")
    for j, s in enumerate(hist.restarts):
        ax.axvline(s, ls=":", lw=0.8, color="gray", label="resumed" if j == 0 else None)
    values = finite + [v for p in hist.heldout.values() for v in p.values() if math.isfinite(v)]
    if min(values) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.1, 1, 10: plain numbers
        ax.yaxis.set_minor_formatter(LogFormatter())  # minor ticks labelled only over a narrow range
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    family = _family(path.parent)
    ax.set_title(f"{'jaxgrad train ' + family if family else 'training'}: {path.parent.name or path.parent}"
                 + (f" ({n_nan} logged window{'s' if n_nan > 1 else ''} with every step skipped)" if n_nan
                    else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
