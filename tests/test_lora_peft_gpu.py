"""A model and an adapter trained by ``jaxgrad train lora`` on a GPU load in transformers and PEFT and give the
same logits.

``jaxgrad train lora`` trains a small base model from scratch (mode ``full``) and writes it as a transformers
checkpoint, then fine-tunes LoRA adapters on it (mode ``lora``, all 7 projections, ``lora_dropout`` 0.1, r 8) and
writes them with ``save_adapter``. transformers builds ``LlamaForCausalLM`` from the exported base
(``from_pretrained``, float32, eager attention, on the CPU) and PEFT loads the adapter; their logits on held-out
tokens are compared with :func:`jaxgrad.lora.model.apply` (float32, ``highest`` matmul precision, both backends),
without and with the adapter: ``max |ours - theirs| / max |theirs| <= 1e-5``, and the adapter must change the
logits (by more than 1e-4 of their maximum) for the comparison to mean anything. ``tests/test_lora_io.py`` checks
the same formats against committed PEFT fixtures on the CPU; this is the round trip through a GPU-trained run.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cli import main

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=172", "--set",
         "model.num_attention_heads=4", "--set", "model.num_key_value_heads=2", "--set", "model.seq_len=64"]
COMMON = ["--no-progress", "--set", "train.log_every=1000", "--set", "data.batch_size=8", *MODEL]


def test_gpu_trained_base_and_adapter_load_in_transformers_and_peft(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from jaxgrad.lora.hf import load_hf_checkpoint
    from jaxgrad.lora.model import apply
    from jaxgrad.lora.peft import load_adapter
    from jaxgrad.lora.task import split_text, stdlib_bytes

    config = str(ROOT / "configs" / "lora.toml")
    assert main(["train", "lora", config, "--out", str(tmp_path / "base"), *COMMON, "--set", "train.steps=60",
                 "--set", "train.checkpoint_every=60", "--set", "data.n_bytes=262144"]) == 0
    assert main(["train", "lora", config, "--out", str(tmp_path / "ft"), *COMMON, "--set", "model.mode=lora",
                 "--set", f"model.base={tmp_path / 'base' / 'model'}", "--set", "model.r=8",
                 "--set", "model.lora_alpha=16", "--set", "model.lora_dropout=0.1", "--set", "data.files=email/*.py",
                 "--set", "data.n_bytes=131072", "--set", "train.steps=40", "--set", "train.checkpoint_every=40",
                 "--set", "train.lr=1e-2"]) == 0
    base_dir, adapter_dir = tmp_path / "base" / "model", tmp_path / "ft" / "adapter"
    cfg, params = load_hf_checkpoint(base_dir, dtype=jnp.float32)
    lora, lcfg = load_adapter(adapter_dir, params)
    text = split_text(stdlib_bytes("email/*.py", 0, 131072), 0.1)[1]  # held-out bytes of the fine-tuning text
    seq = cfg.max_position_embeddings
    tokens = np.stack([text[i * seq:(i + 1) * seq] for i in range(2)]).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        ours = {"base": np.asarray(apply(params, None, tokens, cfg, None), np.float64)}
        for backend in ("xla", "reference"):
            ours[backend] = np.asarray(apply(params, lora, tokens, cfg, lcfg, backend=backend), np.float64)
    effect = float(np.max(np.abs(ours["xla"] - ours["base"])) / np.max(np.abs(ours["base"])))
    assert effect > 1e-4, f"the adapter changes the logits by only {effect:.3g} of their max"

    ids = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        hf = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
        theirs_base = hf(input_ids=ids).logits.double().numpy()
        with_adapter = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
        theirs_lora = with_adapter(input_ids=ids).logits.double().numpy()
    assert float(with_adapter.peft_config["default"].lora_dropout) == pytest.approx(0.1)
    for name, o, t in (("base", ours["base"], theirs_base), ("lora xla", ours["xla"], theirs_lora),
                       ("lora reference", ours["reference"], theirs_lora)):
        rel = float(np.max(np.abs(o - t)) / np.max(np.abs(t)))
        assert rel <= 1e-5, f"{name}: max |ours - transformers/PEFT| / max |theirs| = {rel:.3g}"
