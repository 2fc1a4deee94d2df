"""The ``kan_trace`` tool: its reading of Mosaic GPU's on-device traces, and how kernels are asked to record one."""

import pytest

from jaxgrad.bench import kan_trace
from jaxgrad.ops import mgpu_common


def _events(tid, spans):
    """Chrome-trace events of one warpgroup: ``spans`` are ``(name, begin_cycles, end_cycles, children)``."""
    out = []
    for name, b, e, children in spans:
        out.append({"name": name, "ph": "B", "ts": b / 1e3, "tid": tid, "pid": 1})
        out += _events(tid, children)
        out.append({"name": name, "ph": "E", "ts": e / 1e3, "tid": tid, "pid": 1})
    return out


def test_summary_gives_cycles_per_entry_and_shares_of_the_compute_warpgroups_windows():
    # CTA 0: warpgroups tid 1, 2 compute, tid 3 memory (ignored); each compute window is 1000 cycles
    step = lambda t0: [("bases", t0, t0 + 300, []), ("wait", t0 + 300, t0 + 400, [])]  # noqa: E731
    events = (_events(1, step(0) + step(600)[:1] + [("wait", 900, 1000, [])])
              + _events(2, step(0) + step(600)[:1] + [("wait", 900, 1000, [])])
              + _events(3, [("bases", 0, 5000, [])]))
    s = kan_trace.summarise({"traceEvents": events})
    assert s["warpgroups"] == 2 and s["window_cycles_per_wg"] == pytest.approx(1000)
    assert s["regions"]["bases"]["entries_per_wg"] == 2
    assert s["regions"]["bases"]["cycles_per_entry"] == pytest.approx(300)
    assert s["regions"]["bases"]["share"] == pytest.approx(0.6)
    assert s["regions"]["wait"]["share"] == pytest.approx(0.2)
    assert s["outside"] == pytest.approx(0.2)  # 400 .. 600 and nothing else


def test_nested_regions_are_reported_by_path_and_counted_once_in_the_outside_share():
    events = _events(1, [("step", 0, 1000, [("bases", 100, 400, []), ("wait", 400, 900, [])])])
    s = kan_trace.summarise({"traceEvents": events})
    assert set(s["regions"]) == {"step", "step/bases", "step/wait"}
    assert s["regions"]["step/wait"]["cycles_per_entry"] == pytest.approx(500)
    assert s["outside"] == pytest.approx(0.0)


def test_kernels_record_a_trace_only_inside_kernel_traces(monkeypatch, tmp_path):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    seen = []
    monkeypatch.setattr(plgpu, "kernel", lambda body, **kw: seen.append(kw["compiler_params"]))
    monkeypatch.setattr("jax.clear_caches", lambda: None)
    mgpu_common.persistent_kernel(None, None, 132)
    with mgpu_common.kernel_traces(str(tmp_path), 64):
        mgpu_common.persistent_kernel(None, None, 132)
    mgpu_common.persistent_kernel(None, None, 132)
    assert [p.profile_space for p in seen] == [0, 64, 0]
    assert seen[1].profile_dir == str(tmp_path) and seen[1].profile_bounds_check


def test_the_tool_refuses_bad_arguments_by_name():
    with pytest.raises(SystemExit):
        kan_trace.main(["--kernels", "forward,backward"])
    with pytest.raises(SystemExit):
        kan_trace.main(["--grids", "5-3"])
