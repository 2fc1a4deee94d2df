"""Every code path of the LoRA step runs sharded over ``fsdp`` 8 (fake CPU devices) as it runs on one device: two
Adam steps with gradient accumulation, gradient checkpointing (``full``, ``dots_saveable``: composed with the
policy that never saves a layer's gathered weights; ``full`` with them kept, ``reshard_after_forward`` false, which
also runs without checkpointing), ``block_recompute = "all"``, the Pallas block and flash attention (interpret mode), the
logits loss, ``grad_path = "reference"`` (``jax.grad`` of the plain block), float64 to 1e-12; and LoRA dropout
draws the same masks on ``fsdp`` 8 as on ``data`` 8 (each batch shard folds its index into the key).

The device count must be set before JAX starts, so the checks run in a subprocess of their own."""


import pytest
from fake_devices import run_report


_CHILD = r"""
import json
import chex
chex.set_n_cpu_devices(8)
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from jaxgrad.train import TrainConfig, data_mesh, train_in_memory
from jaxgrad.train.mesh import train_mesh
from jaxgrad.lora.task import make_task
from jaxgrad.lora.sharding import make_sharded_task
from jaxgrad.lora.task_config import LoraFit

def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

base = dict(mode="lora", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, seq_len=16, batch_size=8, n_bytes=4096, dtype="float64", init_lora_weights=False)
two = TrainConfig(steps=2, optimizer="adam", lr=1e-2, seed=3)
cases = {"accumulate 2": ({}, two.replace(accumulate=2)),
         "checkpointing full": ({"gradient_checkpointing": "full"}, two),
         "checkpointing dots_saveable": ({"gradient_checkpointing": "dots_saveable"}, two),
         "checkpointing full, gathers kept": ({"gradient_checkpointing": "full", "reshard_after_forward": False}, two),
         "gathers kept": ({"reshard_after_forward": False}, two),
         "block recompute all": ({"block_recompute": "all"}, two),
         "pallas block and attention": ({"backend": "pallas", "attention": "pallas"}, two.replace(steps=1)),
         "logits loss": ({"loss": "logits"}, two),
         "grad path reference": ({}, two.replace(grad_path="reference")),
         "dropout vs data 8": ({"lora_dropout": 0.1}, two)}
report = {}
for name, (extra, cfg) in cases.items():
    extra = dict(extra)
    reshard = extra.pop("reshard_after_forward", True)
    fit = LoraFit(**{**base, **extra})
    other = data_mesh(8) if "dropout" in name else data_mesh(1)
    one, losses_one = train_in_memory(make_task(fit, device=("cpu", None), grad_path=cfg.grad_path), cfg, mesh=other)
    mesh = train_mesh("fsdp", 8)
    task, plan = make_sharded_task(fit, mesh, device=("cpu", None), grad_path=cfg.grad_path,
                                   reshard_after_forward=reshard)
    sharded, losses = train_in_memory(task, cfg, mesh=mesh, plan=plan)
    report[name] = {"params": max(rel(a, b) for a, b in zip(jax.tree.leaves(sharded["params"]["lora"]),
                                                            jax.tree.leaves(one["params"]["lora"]))),
                    "losses": max(rel(a, b) for a, b in zip(losses, losses_one)),
                    "moved": rel(sharded["params"]["lora"]["layers"][0]["self_attn"]["q_proj"]["lora_A"],
                                 task.init(jax.random.key(3))["lora"]["layers"][0]["self_attn"]["q_proj"]["lora_A"])}
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow  # ~55 s on the 2-core CPU (Pallas interpret mode, XLA compiles)
def test_every_path_of_the_lora_step_trains_sharded_as_on_one_device():
    report = run_report(_CHILD)
    assert len(report) == 10
    for name, r in report.items():
        assert r["params"] <= 1e-12 and r["losses"] <= 1e-12, (name, r)
        assert r["moved"] > 1e-6, (name, r)


def test_a_layers_checkpoint_saves_its_gathered_weights_only_when_they_are_kept():
    import jax

    from jaxgrad.lora.sharding import gather_policy

    gather = jax.lax.all_gather_p
    dot = jax.lax.dot_general_p
    assert not gather_policy("none")(gather) and gather_policy("none", reshard_after_forward=False)(gather)
    assert gather_policy("full", reshard_after_forward=False)(gather)  # kept even where nothing else is saved
    assert not gather_policy("full")(dot) and not gather_policy("full", reshard_after_forward=False)(dot)
    assert gather_policy("none", reshard_after_forward=False)(dot)  # other primitives: the model's own policy
