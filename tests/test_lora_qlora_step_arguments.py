"""QLoRA's NF4 projections reach the training step as arguments, never as constants compiled into its program:
``jaxgrad train lora`` on ``mesh.axes = "data"`` takes the planned path (an ``fsdp`` axis of 1) in mode qlora,
whose plan passes them to every call; the plain data path closes over them, and JAX compiles a closed-over array
into the program (at Llama-3.1-8B, 3.5 GB of constants)."""

import dataclasses
import re

import jax
import pytest

from jaxgrad.lora.sharding import make_sharded_task
from jaxgrad.lora.task import make_task
from jaxgrad.lora.task_config import LoraFit
from jaxgrad.train import TrainConfig, build, data_mesh, init_state, shard_batch
from jaxgrad.train.cli_train import layout_of
from jaxgrad.train.mesh import fsdp_size, train_mesh

FIT = LoraFit(mode="qlora", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, seq_len=32, batch_size=4, n_bytes=1 << 14, dtype="float32",
              init_lora_weights=False)
CFG = TrainConfig(steps=1, optimizer="adam", lr=1e-3, seed=0)


def _u8_constants(text: str) -> list[int]:
    """Sizes of the uint8 arrays written into a lowered program as literals."""
    return [int(n) for n in re.findall(r'stablehlo.constant dense<"0x[0-9A-F]+"> : tensor<(\d+)xui8>', text)]


def _lowered_step(task, mesh, plan=None):
    _, steps = build(task, CFG, mesh=mesh, plan=plan)
    state = init_state(task, CFG, steps, mesh)
    batch = shard_batch(next(iter(task.batches(0))), mesh)
    step = steps.train_step
    fn, kwargs = (step.func, step.keywords) if hasattr(step, "func") else (step, {})
    return fn.lower(state, batch, **kwargs).as_text()


def test_the_planned_path_passes_the_nf4_bytes_as_arguments_where_the_plain_path_compiles_them_in():
    packed = 64 * 128 // 2  # one MLP projection's 4-bit codes
    plain = _u8_constants(_lowered_step(make_task(FIT), data_mesh(1)))
    assert plain.count(packed) == 3 * FIT.num_hidden_layers  # gate, up, down of each layer: the failure mode
    mesh = train_mesh("data", 1)
    task, plan = make_sharded_task(FIT, mesh)
    assert not [n for n in _u8_constants(_lowered_step(task, mesh, plan)) if n >= 1024]


@pytest.mark.parametrize("mode, planned", [("qlora", True), ("lora", False)])
def test_the_cli_takes_the_planned_path_on_the_data_mesh_for_qlora_only(mode, planned):
    cfg = {"mesh": {"axes": "data", "fsdp": None, "shard_trainable": False, "reshard_after_forward": True},
           "model": {"mode": mode}}
    mesh, cli_task = layout_of("lora", cfg, None, print)
    assert (mesh is not None and cli_task is not None) == planned
    if planned:
        assert fsdp_size(mesh) == 1 and mesh.devices.size == jax.device_count()


def test_a_given_from_scratch_base_sets_the_models_vocabulary():
    # the real-size benchmarks hand the task a base with Llama 3's 128,256-row head; the task's configuration (and
    # the run's description of it) is that base's, not the 256 bytes the fit would draw without one
    from jaxgrad.lora.model import init
    from jaxgrad.lora.task import model_config

    fit = dataclasses.replace(FIT, mode="lora")
    assert model_config(fit).vocab_size == 256
    base = init(jax.random.key(0), dataclasses.replace(model_config(fit), vocab_size=300))
    assert model_config(fit, None, base).vocab_size == 300
    assert "vocab 300" in make_task(fit, base_params=base).describe
