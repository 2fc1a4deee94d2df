"""The report folder: which files the demo owns, and when it may write them.

Rules (nothing a user wrote is ever deleted):

* an absent or empty folder is used as is;
* a non-empty folder needs ``--overwrite``;
* with ``--overwrite``, a previous demo report (its ``metrics.json`` says ``"report": "jaxgrad demo"``; written
  first, so an interrupted run is recognised too) has its report files replaced; any other folder keeps its
  files, and is refused if it holds a file with the name of a report file (that file is not the demo's to
  replace).
"""

from __future__ import annotations

import json
import pathlib

REPORT_MARK = "jaxgrad demo"
METRICS = "metrics.json"
VERDICTS = "verdicts.txt"
INDEX = "index.html"
KAN_LOSS_PNG = "kan_loss.png"
KAN_ACTIVATIONS_PNG = "kan_activations.png"
DENOISER_LOSS_PNG = "denoiser_loss.png"
DENOISED_EXAMPLES_PNG = "denoised_examples.png"
OWNED = (METRICS, VERDICTS, INDEX, KAN_LOSS_PNG, KAN_ACTIVATIONS_PNG, DENOISER_LOSS_PNG, DENOISED_EXAMPLES_PNG)


class OutDirError(ValueError):
    """The report folder may not be used as asked; the one-line message names it and says what to do."""


def is_demo_report(out: pathlib.Path) -> bool:
    """Whether ``out/metrics.json`` was written by ``jaxgrad demo``."""
    try:
        return json.loads((pathlib.Path(out) / METRICS).read_text()).get("report") == REPORT_MARK
    except (OSError, ValueError, AttributeError):
        return False


def prepare_out_dir(out: pathlib.Path, overwrite: bool) -> None:
    """Check ``out`` against the rules above, then create it (or remove a previous report's files) and write the
    ``metrics.json`` mark. Raises :class:`OutDirError` before touching anything."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out {out}: exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    previous = bool(entries) and is_demo_report(out)
    if entries and not overwrite:
        what = "a previous demo report" if previous else f"files that are not a demo report ({_listing(entries)})"
        raise OutDirError(f"--out {out} is not empty: it holds {what}; choose another --out, or pass --overwrite to "
                          f"{'replace it' if previous else 'write the report next to them'}")
    clashes = [e for e in entries if e in OWNED]
    if clashes and not previous:
        raise OutDirError(f"--overwrite: {out} holds {', '.join(clashes)}, not written by jaxgrad demo; refusing to "
                          f"replace it (choose another --out)")
    out.mkdir(parents=True, exist_ok=True)
    for name in clashes:  # a previous report's files: the new run writes all of them again
        (out / name).unlink()
    (out / METRICS).write_text(json.dumps({"report": REPORT_MARK, "complete": False}) + "\n")


def _listing(entries: list[str]) -> str:
    return ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
