"""TensorBoard: a training run mirrors its logged scalars to an event file TensorBoard reads.

Specification: with ``tensorboardX`` installed (a ``dev`` dependency), ``fit`` writes ``<run>/tensorboard/``; its
event file holds every logged step's loss (and throughput) at the logged steps, equal to ``metrics.jsonl``'s values
(TensorBoard stores float32). The event file is read back with the TFRecord framing and tensorboardX's own protobuf,
so the test needs neither TensorFlow nor the TensorBoard server.
"""

import json
import pathlib
import struct

import numpy as np
import pytest

from jaxgrad.train import fit
from jaxgrad.train.metrics import METRICS_FILE, TB_DIR

tensorboardX = pytest.importorskip("tensorboardX", reason="tensorboardX is part of the dev extra")
from tensorboardX.proto import event_pb2  # noqa: E402

from tests.test_train_engine import CFG, toy_task  # noqa: E402


def _events(path: pathlib.Path):
    """Every Event record of a TFRecord file (u64 length, u32 crc, payload, u32 crc)."""
    data = path.read_bytes()
    pos, out = 0, []
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 12
        ev = event_pb2.Event()
        ev.ParseFromString(data[pos:pos + n])
        out.append(ev)
        pos += n + 4
    return out


def test_logged_scalars_reach_tensorboard(tmp_path):
    out = tmp_path / "run"
    fit(toy_task(), CFG.replace(steps=6, log_every=2), out)
    files = list((out / TB_DIR).glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    scalars = {}
    for ev in _events(files[0]):
        for v in ev.summary.value:
            scalars.setdefault(v.tag, {})[ev.step] = v.simple_value
    logged = [json.loads(s) for s in (out / METRICS_FILE).read_text().splitlines()]
    steps = [r for r in logged if "event" not in r]
    assert sorted(scalars["loss"]) == [r["step"] for r in steps] == [2, 4, 6]
    for r in steps:
        assert scalars["loss"][r["step"]] == pytest.approx(np.float32(r["loss"]), rel=1e-7)
    assert "steps_per_s" in scalars and "step" not in scalars and "time" not in scalars
