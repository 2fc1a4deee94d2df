r"""One row of the ``scaling`` suite (:mod:`jaxgrad.bench.scaling`): a workload trained on the first ``N`` devices
with one layout, through the engine's own path, in this process (``python -m jaxgrad.bench.scaling_run --row JSON``
runs it in a fresh one and prints the result after :data:`jaxgrad.bench.fresh_process.ROW_TAG`).

* LoRA / QLoRA Llama: the real-size random base (:func:`host_base`: llama_real's weights, N(0, 0.02^2) and random
  NF4 codes with real block statistics, built one layer at a time on the first device and kept in host memory), a
  :class:`~jaxgrad.lora.task_config.LoraFit` of the same shapes, then what ``jaxgrad train lora`` does: layout
  ``data``: :func:`jaxgrad.lora.task.make_task` with the base replicated on the mesh, the engine's data mesh (QLoRA:
  the planned path with an ``fsdp`` axis of 1, as ``jaxgrad train lora`` takes it);
  layout ``fsdp``: :func:`jaxgrad.lora.sharding.make_sharded_task` (``base_params=``) on
  :func:`jaxgrad.train.mesh.train_mesh`; both trained by :func:`jaxgrad.train.build` / ``init_state`` /
  ``steps.train_step`` (Adam on the adapters, the whole step jitted with the state donated).
* KAN and CNN: :func:`jaxgrad.kan.task.make_task` / :func:`jaxgrad.cnn.task.make_task` on the data mesh.

The batch is the per-device micro-batch times ``N`` (weak scaling), random tokens (LoRA: uniform in the vocabulary,
labels = inputs) or uniform / normal inputs, put on the mesh once. Measured: the first step (compile + run), the
median of ``repeats`` steps after ``warmup``, every device's ``peak_bytes_in_use`` (also once the state is placed,
before the first step, with ``bytes_in_use``: what setting up alone reached), the frozen base's bytes per device
(:func:`jaxgrad.train.mesh.bytes_per_device`), then ``profile_steps`` more steps under ``jax.profiler``
(:mod:`jaxgrad.bench.scaling_profile`). An out-of-memory error anywhere is a result (``status`` ``out of
memory``); anything else propagates. :data:`INJECT_OOM` makes a named row fail as out of memory (tests).

A row of one process per device (``row["processes"] > 1``: :func:`jaxgrad.bench.scaling.run_processes`) runs this
in each process: JAX's distributed runtime joins them (:func:`jaxgrad.train.distributed.initialize`), the mesh spans
every process's device, and each process reports its own device's memory and profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

#: environment variable: comma-separated ``workload:N:layout`` rows that raise an out-of-memory error before their
#: state is placed (tests of the does-not-fit path on machines without a memory limit)
INJECT_OOM = "JAXGRAD_SCALING_INJECT_OOM"


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return "resource_exhausted" in text or "out of memory" in text or "outofmemory" in text


def _maybe_inject(row: dict) -> None:
    wanted = {w.strip() for w in os.environ.get(INJECT_OOM, "").split(",") if w.strip()}
    if f"{row['workload']}:{row['devices']}:{row['layout']}" in wanted:
        raise MemoryError(f"RESOURCE_EXHAUSTED: out of memory (injected by {INJECT_OOM})")


# ------------------------------------------------------------------------------------------------ LoRA workloads
def host_base(s: dict, key_seed: int = 0) -> dict:
    """The frozen base of llama_real's spec ``s`` in host memory (numpy; NF4 projections with ``s["qlora"]``),
    each weight made on the first device and copied to the host at once, so no device ever holds the whole base."""
    import jax

    from jaxgrad.bench import llama_real as real

    return real.build_params(s, jax.random.key(key_seed), place=jax.device_get)


def lora_fit(s: dict, global_batch: int):
    """The :class:`~jaxgrad.lora.task_config.LoraFit` of spec ``s`` (random base; byte-level data that is never
    read by the timed steps: the batches are :func:`lora_batch`'s)."""
    from jaxgrad.lora.task_config import LoraFit

    return LoraFit(mode="qlora" if s["qlora"] else "lora", hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                   num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                   intermediate_size=s["intermediate"], rope_theta=s["rope_theta"], seq_len=s["seq"],
                   dtype="bfloat16", r=s["r"], lora_alpha=s["alpha"], nf4_blocksize=64,
                   double_quant=bool(s["qlora"]), gradient_checkpointing=s["checkpointing"],
                   loss_chunk_tokens=s["chunk_tokens"], n_bytes=max(65536, 16 * s["seq"]),
                   batch_size=max(2, global_batch))


def lora_batch(s: dict, global_batch: int) -> dict:
    """``{"input_ids", "labels", "n_items"}``: tokens uniform in the vocabulary, labels = inputs."""
    from jaxgrad.lora.model import count_items

    ids = np.random.default_rng(1).integers(0, s["vocab"], (global_batch, s["seq"])).astype(np.int32)
    return {"input_ids": ids, "labels": ids, "n_items": np.array([count_items(ids[b:b + 1])
                                                                   for b in range(global_batch)], np.int32)}


def build_lora(row: dict, devices):
    """``(task, cfg, mesh, plan, base_bytes, notes)`` of a LoRA row (module docstring)."""
    from jaxgrad.lora.sharding import make_sharded_task
    from jaxgrad.lora.task import make_task
    from jaxgrad.train import TrainConfig
    from jaxgrad.train.mesh import bytes_per_device, data_mesh, replicate, train_mesh

    s, n = row["spec"], len(devices)
    fit = lora_fit(s, s["batch"] * n)
    base = host_base(s)
    cfg = TrainConfig(steps=1000, optimizer="adam", lr=3e-3)
    _maybe_inject(row)
    if row["layout"] in ("fsdp", "fsdp-kept"):
        mesh = train_mesh("fsdp", devices)
        task, plan = make_sharded_task(fit, mesh, base_params=base, reshard_after_forward=row["layout"] == "fsdp")
        return task, cfg, mesh, plan, None, [plan.describe]
    if s["qlora"]:  # as jaxgrad train lora does (lora.sharding.plan_on_data_mesh): the NF4 projections are
        # arguments of the step, not constants of its program; an fsdp axis of 1 replicates the whole base
        mesh = train_mesh("data", devices)
        task, plan = make_sharded_task(fit, mesh, base_params=base)
        return task, cfg, mesh, plan, None, [f"data {n} (planned, fsdp 1): {plan.describe}"]
    mesh = data_mesh(devices)
    placed = replicate(base, mesh)  # every device holds the whole base, as the data layout does
    del base
    task = make_task(fit, base_params=placed)
    return task, cfg, mesh, None, bytes_per_device(placed), [f"data {n}: frozen base replicated, "
                                                             f"{bytes_per_device(placed) / 2**30:.3g} GiB per device"]


# -------------------------------------------------------------------------------------------- KAN / CNN workloads
class _Batches:
    """A one-batch stream (the CNN task's ``stream``): the timed steps use the batch given to them."""

    def __init__(self, batch):
        self.batch = batch

    def epoch(self, e):
        yield self.batch

    def __len__(self):
        return 1


def build_kan(row: dict, devices):
    from jaxgrad.kan.task import KANFit, make_task
    from jaxgrad.train import TrainConfig
    from jaxgrad.train.mesh import data_mesh

    s = row["spec"]
    task = make_task(KANFit(widths=tuple(s["widths"]), grids=(s["grid"],), spline_order=s["order"],
                            n_train=256, n_test=256), total_steps=1000)
    _maybe_inject(row)
    return task, TrainConfig(steps=1000, optimizer="adam", lr=1e-3), data_mesh(devices), None, None, []


def build_cnn(row: dict, devices):
    from jaxgrad.cnn.task import make_task
    from jaxgrad.train import TrainConfig
    from jaxgrad.train.mesh import data_mesh

    s = row["spec"]
    task = make_task(_Batches(None), channels=tuple(s["channels"]), backend="xla")
    _maybe_inject(row)
    return task, TrainConfig(steps=1000, optimizer="adam", lr=1e-3), data_mesh(devices), None, None, []


def host_batch(row: dict, n: int):
    """The global batch of a row (``n`` devices times the per-device micro-batch) and the items it counts."""
    s = row["spec"]
    if row["family"] == "lora":
        b = lora_batch(s, s["batch"] * n)
        return b, s["batch"] * n * s["seq"]
    rng = np.random.default_rng(1)
    if row["family"] == "kan":
        x = rng.uniform(-1, 1, (s["batch"] * n, s["widths"][0])).astype(np.float32)
        y = rng.standard_normal((s["batch"] * n, s["widths"][-1])).astype(np.float32)
        return (x, y), s["batch"] * n
    shape = (s["batch"] * n, s["size"], s["size"], s["channels"][0])
    return (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)), \
        s["batch"] * n


BUILDERS = {"lora": build_lora, "kan": build_kan, "cnn": build_cnn}


# ----------------------------------------------------------------------------------------------------- the row
def _stat(devices, key: str) -> list[int | None]:
    out = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without allocator statistics
            stats = {}
        out.append(None if key not in stats else int(stats[key]))
    return out


def peak_bytes(devices) -> list[int | None]:
    """Every device's ``peak_bytes_in_use`` (its high-water mark since this process started; None on the CPU)."""
    return _stat(devices, "peak_bytes_in_use")


def in_use_bytes(devices) -> list[int | None]:
    return _stat(devices, "bytes_in_use")


def global_bytes(tree) -> int:
    """The bytes of ``tree``'s arrays as whole arrays (what one device holds when nothing is split)."""
    import jax

    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def run_row(row: dict) -> dict:
    """Measure one row in this process (module docstring); returns its result dict."""
    import jax

    n = row["devices"]
    devices = jax.devices()[:n]  # with several processes: every process's devices (jax.distributed)
    local = [d for d in devices if d.process_index == jax.process_index()]
    out = dict(row, status="error", notes=[])
    if len(devices) < n:
        out.update(status="skipped", reason=f"skipped: {n} devices asked, {len(jax.devices())} available")
        return out
    t_start = time.perf_counter()
    try:
        out.update(measure(row, devices))
    except Exception as err:  # noqa: BLE001 - out of memory is a result (does not fit); anything else goes up
        if not is_oom(err):
            raise
        out.update(status="out of memory", reason=f"out of memory: {str(err).splitlines()[0][:240]}",
                   peak_bytes_per_device=peak_bytes(local))
    out["wall_s"] = time.perf_counter() - t_start
    return out


def measure(row: dict, devices) -> dict:
    """The row's figures on ``devices`` (all of the row's; memory and the profile are this process's own devices')."""
    import jax

    from jaxgrad.bench.scaling_profile import profile_steps
    from jaxgrad.lora.task import lora_mask
    from jaxgrad.train import build, init_state
    from jaxgrad.train.mesh import bytes_per_device, shard_batch
    from jaxgrad.train.step import split_trainable

    t0 = time.perf_counter()
    task, cfg, mesh, plan, base_bytes, notes = BUILDERS[row["family"]](row, devices)
    mesh, steps = build(task, cfg, mesh=mesh, plan=plan)
    state = init_state(task, cfg, steps, mesh)
    host, items = host_batch(row, len(devices))
    batch = shard_batch(host, mesh)
    jax.block_until_ready((state, batch))
    local = [d for d in devices if d.process_index == jax.process_index()]
    setup_peaks, setup_in_use = peak_bytes(local), in_use_bytes(local)
    base_whole = base_bytes
    if row["family"] == "lora" and plan is not None:
        _, frozen = split_trainable(state["params"], lora_mask(state["params"]))
        base_bytes = bytes_per_device(frozen) + bytes_per_device(plan.consts)
        base_whole = global_bytes(frozen) + global_bytes(plan.consts)
    setup_s = time.perf_counter() - t0
    holder, losses = [state], []

    def one_step():
        new, loss, _ = steps.train_step(holder[0], batch)
        jax.block_until_ready((new, loss))
        holder[0] = new
        if len(losses) < 3:
            losses.append(float(loss))

    t0 = time.perf_counter()
    one_step()
    first_s = time.perf_counter() - t0
    for _ in range(row["warmup"]):
        one_step()
    times = []
    for _ in range(row["repeats"]):
        t0 = time.perf_counter()
        one_step()
        times.append((time.perf_counter() - t0) * 1e3)
    times = np.asarray(times)
    peaks = peak_bytes(local)
    median = float(np.median(times))
    result = {"status": "measured", "median_ms": median, "p10_ms": float(np.percentile(times, 10)),
              "p90_ms": float(np.percentile(times, 90)), "min_ms": float(times.min()), "repeats_run": len(times),
              "setup_s": setup_s, "first_step_s": first_s, "items_per_step": items,
              "throughput": items / (median * 1e-3), "peak_bytes_per_device": peaks,
              "base_bytes_per_device": base_bytes, "base_bytes_whole": base_whole,
              "state_bytes_per_device": bytes_per_device(holder[0]),
              "setup_peak_bytes_per_device": setup_peaks, "setup_in_use_bytes_per_device": setup_in_use,
              "losses": losses, "notes": notes + [task.describe]}
    if row["profile_steps"]:
        try:
            with tempfile.TemporaryDirectory(prefix="jaxgrad-scaling-trace-") as log_dir:
                result["profile"] = profile_steps(one_step, row["profile_steps"], log_dir, len(local))
        except Exception as err:  # noqa: BLE001 - a profile that cannot be taken is said, never invented
            result["profile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:240] if str(err) else ''}"
    return result


def child_main(argv: list[str]) -> int:
    from jaxgrad.bench import harness as bm
    from jaxgrad.bench.fresh_process import ROW_TAG

    p = argparse.ArgumentParser(description="one row of python -m jaxgrad.bench scaling")
    p.add_argument("--row", required=True, help="the row's JSON (jaxgrad.bench.scaling.plan_rows)")
    a = p.parse_args(argv)
    from jaxgrad.train.distributed import initialize

    initialize()  # a row of one process per device (JAX_COORDINATOR_ADDRESS, ...: scaling.run_processes)
    print(ROW_TAG + json.dumps(bm._jsonable(run_row(json.loads(a.row)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
