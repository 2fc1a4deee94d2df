r"""The collective time of a training step, from a ``jax.profiler`` trace of a few steps (the ``scaling`` suite).

The trace is read with :mod:`jaxgrad.bench.hlo_profile` (:func:`~jaxgrad.bench.hlo_profile.find_trace`,
:func:`~jaxgrad.bench.hlo_profile.load_events`, :func:`~jaxgrad.bench.hlo_profile.device_events`), one device at a
time on a GPU (each ``/device:GPU:k`` process of the trace). An event is a collective when its HLO op or its kernel
names one (XLA names the instruction after its opcode, ``all-gather-start.3``; NCCL its kernels,
``ncclDevKernel_AllGather_RING_LL``): ``all_gather``, ``reduce_scatter``, ``all_reduce``, or ``other_collective``
(collective-permute, all-to-all, send / recv); every other event is compute. Per device and per step:

.. math::

    t_c = \sum_{e \in c} \mathrm{dur}(e) \quad (c = \text{each collective kind}), \qquad
    t_\mathrm{compute} = \Big|\bigcup_{e\ \mathrm{compute}} [s_e, s_e + d_e)\Big|, \qquad
    t_\mathrm{exposed} = \Big|\bigcup_{e\ \mathrm{collective}} I_e \setminus \bigcup_{e\ \mathrm{compute}} I_e\Big|

``exposed`` is the collective time no compute kernel of that device overlaps: what communication adds to the step
if nothing else stalls. NCCL runs on its own streams, so ``t_c`` may overlap compute and need not add to the step.
On the CPU (fake devices, tests) the trace's op events carry no device: every device's events form one group, its
collective sums divided by the device count (each device runs each collective), its compute the union of all.
"""

from __future__ import annotations

import collections
import re

from jaxgrad.bench import hlo_profile as hp

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "other_collective")
_PATTERNS = (("all_gather", re.compile(r"all[-_]?gather", re.I)),
             ("reduce_scatter", re.compile(r"reduce[-_]?scatter", re.I)),
             ("all_reduce", re.compile(r"all[-_]?reduce", re.I)),
             ("other_collective", re.compile(r"collective[-_]?permute|all[-_]?to[-_]?all|sendrecv|nccl", re.I)))


def kind_of(op: str, kernel: str) -> str:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``other_collective``, or ``compute``."""
    for kind, pattern in _PATTERNS:
        if pattern.search(op or "") or pattern.search(kernel or ""):
            return kind
    return "compute"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def exposed_length(outer: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """``|union(outer) \\ union(cover)|``."""
    return union_length(outer + cover) - union_length(cover)


def _device_groups(events: list[dict]) -> tuple[dict[str, list], str]:
    """``{device: [KernelEvent]}`` (one group per GPU process; one ``host`` group without GPUs) and which lines."""
    procs = {e["pid"]: (e.get("args") or {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = sorted((p for p, n in procs.items() if "/device:GPU" in n), key=lambda p: procs[p])
    if not gpus:
        found, which = hp.device_events(events)
        return {"host": found}, which + " (devices not separated)"
    meta = [e for e in events if e.get("ph") == "M"]
    by_pid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpus:
            by_pid[e["pid"]].append(e)
    groups, which = {}, ""
    for p in gpus:
        groups[procs[p]], which = hp.device_events(meta + by_pid[p])
    return groups, which


def summarize(events: list[dict], steps: int, n_devices: int = 1) -> dict:
    """Per-step collective and compute milliseconds of each device (module docstring), and their means over the
    devices (``mean``) and maxima (``max``)."""
    groups, which = _device_groups(events)
    per_device = {}
    for name, evs in groups.items():
        sums = dict.fromkeys(COLLECTIVES, 0.0)
        coll, comp = [], []
        for ev in evs:
            kind = kind_of(ev.op, ev.kernel)
            interval = (ev.ts, ev.ts + ev.dur_us)
            if kind == "compute":
                comp.append(interval)
            else:
                sums[kind] += ev.dur_us
                coll.append(interval)
        share = n_devices if name == "host" else 1  # the host group holds every device's collectives
        ms = {k: v / 1e3 / steps / share for k, v in sums.items()}
        ms["collective"] = sum(ms[k] for k in COLLECTIVES)
        ms["compute"] = union_length(comp) / 1e3 / steps
        ms["exposed_collective"] = exposed_length(coll, comp) / 1e3 / steps / share
        ms["events"] = len(evs)
        per_device[name] = ms
    keys = (*COLLECTIVES, "collective", "compute", "exposed_collective")
    devices = [d for d in per_device.values() if d["events"]]
    if not devices:
        raise ValueError(f"the trace has no op events ({which})")
    mean = {k: sum(d[k] for d in devices) / len(devices) for k in keys}
    top = {k: max(d[k] for d in devices) for k in keys}
    return {"steps": steps, "lines": which, "per_device": per_device, "mean": mean, "max": top}


def profile_steps(run_step, steps: int, log_dir, n_devices: int = 1) -> dict:
    """Trace ``steps`` calls of ``run_step()`` (each waits for its result) and :func:`summarize` the trace."""
    import jax

    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        for _ in range(steps):
            run_step()
    return summarize(hp.load_events(hp.find_trace(log_dir)), steps, n_devices)
