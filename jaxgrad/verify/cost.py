"""Wall time per stage of one :func:`jaxgrad.verify.check_vjp` (``VJPReport.timings``, the report's footer).

``check_vjp`` opens :func:`recording` and calls :func:`lap` at the end of each of its stages: the time since the
previous lap goes to that stage. The modules it calls time their own work with :func:`stage` (the magnitude pass,
the emulated replicas, the float64 oracle at the replicas' points); a lap does not count again what a stage inside it
recorded. Times are wall seconds, compilation included. Outside a recording both cost one ``perf_counter`` call and
record nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

__all__ = ["lap", "recording", "stage"]


class _Recording:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()
        self.inner = 0.0  # seconds recorded by stages since the last lap
        self.depth = 0

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + max(seconds, 0.0)


_ACTIVE: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("jaxgrad_verify_timings", default=None)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the stages and laps inside the block into the yielded dict (seconds per stage name, in the order
    they first occurred)."""
    rec = _Recording()
    token = _ACTIVE.set(rec)
    try:
        yield rec.times
    finally:
        _ACTIVE.reset(token)


def lap(name: str) -> None:
    """Add the time since the previous lap (or the start of the recording), less what stages recorded meanwhile, to
    stage ``name``."""
    rec = _ACTIVE.get()
    if rec is None:
        return
    now = time.perf_counter()
    rec.add(name, now - rec.last - rec.inner)
    rec.last, rec.inner = now, 0.0


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Add the block's wall time to stage ``name`` of the active recording (none: nothing is recorded). A stage inside
    another one is counted in both."""
    rec = _ACTIVE.get()
    t0 = time.perf_counter()
    if rec is not None:
        rec.depth += 1
    try:
        yield
    finally:
        if rec is not None:
            dt = time.perf_counter() - t0
            rec.depth -= 1
            rec.add(name, dt)
            if rec.depth == 0:
                rec.inner += dt
