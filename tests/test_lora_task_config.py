"""`jaxgrad train lora`'s settings: the path a run takes on each device, the model a checkpoint folder defines, and
settings that would be ignored refused by name.

* ``backend = "auto"`` takes the Mosaic GPU projections on a Hopper GPU with bfloat16, XLA elsewhere; ``attention =
  "auto"`` takes cuDNN on a GPU with bfloat16, XLA elsewhere; a choice the device cannot run is refused;
* mode ``full`` and ``grad_path = "reference"`` differentiate the plain block (a ``backend`` set there is refused);
* with ``base``, the architecture is the checkpoint's: unset keys take it, a set key that differs is refused;
* adapters are float32 over a bfloat16 base unless ``adapter_dtype`` says otherwise, and train in that dtype;
* gradient checkpointing leaves every LoRA gradient as it is without it (no layer silently untrained).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.config import LlamaConfig, LoraConfig
from jaxgrad.lora.hf import save_hf_checkpoint
from jaxgrad.lora.model import count_items, init, init_lora, loss_fn
from jaxgrad.lora.task import make_task
from jaxgrad.lora.task_config import SCRATCH, LoraFit, resolve_path
from jaxgrad.train.errors import ConfigError, DataError

H100 = ("gpu", "9.0")
A100 = ("gpu", "8.0")
CPU = ("cpu", None)


@pytest.mark.parametrize("device, dtype, backend, attention", [
    (H100, "bfloat16", "mosaic", "cudnn"),
    (H100, "float32", "xla", "xla"),
    (A100, "bfloat16", "xla", "cudnn"),
    (CPU, "bfloat16", "xla", "xla"),
    (CPU, "float32", "xla", "xla"),
])
def test_auto_picks_the_fastest_verified_path_for_the_device(device, dtype, backend, attention):
    path = resolve_path(LoraFit(mode="lora", dtype=dtype), "custom_vjp", device)
    assert (path.backend, path.attention) == (backend, attention)
    assert "auto" in path.reason


def test_explicit_choices_are_kept_and_impossible_ones_refused_by_name():
    assert resolve_path(LoraFit(mode="lora", backend="pallas", attention="pallas"), "custom_vjp", CPU).pair == \
        ("pallas", "pallas")
    with pytest.raises(ConfigError, match="'attention' = 'cudnn' needs a GPU"):
        resolve_path(LoraFit(mode="lora", attention="cudnn"), "custom_vjp", CPU)
    with pytest.raises(ConfigError, match="'attention' = 'cudnn' needs a GPU and dtype 'bfloat16'"):
        resolve_path(LoraFit(mode="lora", attention="cudnn", dtype="float32"), "custom_vjp", H100)
    with pytest.raises(ConfigError, match="'backend' = 'mosaic' needs a Hopper GPU"):
        resolve_path(LoraFit(mode="lora", backend="mosaic"), "custom_vjp", CPU)


def test_full_mode_and_the_reference_grad_path_use_jax_grad_of_the_plain_block():
    assert resolve_path(LoraFit(mode="full", dtype="bfloat16"), "custom_vjp", H100).pair == ("reference", "cudnn")
    assert resolve_path(LoraFit(mode="lora"), "reference", CPU).pair == ("reference", "xla")
    with pytest.raises(ConfigError, match="'backend' = 'xla' would be ignored"):
        resolve_path(LoraFit(mode="full", backend="xla"), "custom_vjp", CPU)


def test_settings_the_data_would_ignore_are_refused():
    with pytest.raises(ConfigError, match="'packing' = False would be silently ignored"):
        LoraFit(packing=False)
    with pytest.raises(ConfigError, match="'n_bytes' = 100 would be silently ignored"):
        LoraFit(data_path="x.jsonl", tokenizer="tok", n_bytes=100)
    with pytest.raises(ConfigError, match="'data_path' needs a tokenizer"):
        LoraFit(data_path="x.jsonl")
    with pytest.raises(ConfigError, match="'adapter_dtype' = 'float32'"):
        LoraFit(mode="full", adapter_dtype="float32")
    with pytest.raises(ConfigError, match="'gradient_checkpointing' must be one of"):
        LoraFit(gradient_checkpointing="sometimes")
    with pytest.raises(ConfigError, match=r"'block_recompute' must be one of \('shared', 'mlp', 'all'\)"):
        LoraFit(block_recompute="most")


def test_block_recompute_reaches_the_model_config():
    assert LoraFit(block_recompute="all").llama_config().block_recompute == "all"
    assert LoraFit().llama_config().block_recompute == "shared"


def test_a_scratch_model_takes_the_small_defaults():
    fit = LoraFit()
    assert {k: getattr(fit, k) for k in SCRATCH} == SCRATCH
    assert fit.llama_config().vocab_size == 256
    assert fit.llama_config(vocab_size=300).vocab_size == 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
                      vocab_size=256, num_hidden_layers=3, max_position_embeddings=64, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(d, cfg, init(jax.random.key(0), cfg), overwrite=True)
    return d, cfg


def test_a_checkpoint_folder_defines_the_architecture(checkpoint):
    d, cfg = checkpoint
    fit = LoraFit(mode="lora", base=str(d), seq_len=16, n_bytes=4096, batch_size=2)
    got = fit.llama_config()
    assert (got.hidden_size, got.num_hidden_layers, got.num_key_value_heads, got.tie_word_embeddings) == \
        (48, 3, 2, True)
    with pytest.raises(DataError, match="'hidden_size': checkpoint 48, configured 32"):
        LoraFit(mode="lora", base=str(d), hidden_size=32).llama_config()
    with pytest.raises(DataError, match="'seq_len' = 128 exceeds the checkpoint's max_position_embeddings 64"):
        LoraFit(mode="lora", base=str(d), seq_len=128).llama_config()
    task = make_task(fit, device=CPU)
    params = task.init(jax.random.key(1))
    assert params["base"]["embed_tokens"]["weight"].shape == (256, 48) and "lm_head" not in params["base"]
    assert "block xla, attention xla" in task.describe


def test_qlora_reads_the_checkpoint_straight_into_nf4(checkpoint):
    from jaxgrad.ops.nf4 import NF4Weight

    d, _ = checkpoint
    fit = LoraFit(mode="qlora", base=str(d), seq_len=16, n_bytes=4096, batch_size=2, double_quant=True)
    task = make_task(fit, device=CPU)
    params = task.init(jax.random.key(1))
    assert "self_attn" not in params["base"]["layers"][0]  # held by the task: integer codes are not trained
    s, n = task.loss(params, next(iter(task.batches(0))))
    assert np.isfinite(float(s)) and int(n) > 0
    from jaxgrad.lora.task import load_base

    base = load_base(fit, fit.llama_config())
    assert isinstance(base["layers"][0]["mlp"]["down_proj"]["weight"], NF4Weight)


def test_adapters_default_to_float32_over_a_bfloat16_base_and_get_float32_gradients():
    fit = LoraFit(mode="lora", dtype="bfloat16", seq_len=16, n_bytes=4096, batch_size=2, init_lora_weights=False)
    assert fit.adapter_dtype_name() == "float32"
    assert LoraFit(mode="lora", dtype="bfloat16", adapter_dtype="bfloat16").adapter_dtype_name() == "bfloat16"
    task = make_task(fit, device=CPU)
    params = task.init(jax.random.key(0))
    assert {a.dtype for a in jax.tree.leaves(params["lora"])} == {jnp.dtype("float32")}
    assert params["base"]["embed_tokens"]["weight"].dtype == jnp.bfloat16
    grads = jax.grad(lambda lora: task.loss({**params, "lora": lora}, next(iter(task.batches(0))))[0])(params["lora"])
    leaves = jax.tree.leaves(grads)
    assert {g.dtype for g in leaves} == {jnp.dtype("float32")}
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_gradient_checkpointing_leaves_every_lora_gradient_unchanged(policy):
    with jax.enable_x64(True):
        base_cfg = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=64, num_hidden_layers=2, max_position_embeddings=16)
        lcfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)
        cfg0 = LlamaConfig(**base_cfg)
        params = init(jax.random.key(0), cfg0, jnp.float64)
        lora = init_lora(jax.random.key(1), cfg0, lcfg, jnp.float64)
        ids = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
        grads = {}
        for p in ("none", policy):
            cfg = LlamaConfig(**base_cfg, gradient_checkpointing=p)
            grads[p] = jax.grad(loss_fn)(lora, params, ids, ids, count_items(ids), cfg, lcfg, backend="xla")
        for g0, g1 in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy]), strict=True):
            assert float(jnp.abs(g0).max()) > 0
            np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-12, atol=1e-14)


def test_the_fused_lm_head_loss_is_the_logits_loss_without_the_logits():
    with jax.enable_x64(True):
        fits = {loss: LoraFit(mode="lora", dtype="float64", loss=loss, loss_chunk_tokens=7, seq_len=16, n_bytes=4096,
                              batch_size=2, init_lora_weights=False) for loss in ("fused", "logits")}
        tasks = {k: make_task(f, device=CPU) for k, f in fits.items()}
        assert "fused LM head (7-token chunks)" in tasks["fused"].describe
        params = tasks["fused"].init(jax.random.key(0))
        batch = next(iter(tasks["fused"].batches(0)))
        out = {}
        for k, task in tasks.items():
            out[k] = jax.value_and_grad(lambda lora: task.loss({**params, "lora": lora}, batch)[0])(params["lora"])
        np.testing.assert_allclose(float(out["fused"][0]), float(out["logits"][0]), rtol=1e-13)
        for a, b in zip(jax.tree.leaves(out["fused"][1]), jax.tree.leaves(out["logits"][1]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-14)
    with pytest.raises(ConfigError, match="'loss_chunk_tokens' must be an int >= 1"):
        LoraFit(loss_chunk_tokens=0)


def test_offload_is_refused_with_its_measured_reason():
    with pytest.raises(ValueError, match="'gradient_checkpointing' = 'offload' .* is not offered: .* use 'full'"):
        LlamaConfig(gradient_checkpointing="offload")
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        LoraFit(mode="lora", gradient_checkpointing="offload")



@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_the_task_keeps_its_frozen_base_in_host_memory(mode):
    # the engine's state holds the one device copy of the base; a device-resident copy in the task's closure would
    # sit beside it for the whole run
    task = make_task(LoraFit(mode=mode, seq_len=16, n_bytes=4096, batch_size=2), device=CPU)
    params = task.init(jax.random.key(0))
    leaves = jax.tree.leaves(params["base"])
    assert leaves and not [x for x in leaves if isinstance(x, jax.Array)]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params["lora"]))
