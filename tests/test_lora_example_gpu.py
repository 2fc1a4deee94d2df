"""The fine-tuning example (``scripts/finetune_example.sh``, SIZE=small) run on a GPU, and what it exports read by
transformers and PEFT.

The script trains a tokenizer and a small Llama from scratch on the standard library, fine-tunes it with LoRA and
QLoRA on docstring completion and merges both adapters. Then, on the held-out examples (prompt + completion ids):

* ``LlamaForCausalLM.from_pretrained(base/model)`` (float32, eager attention, CPU) gives our base's logits;
* ``peft.PeftModel.from_pretrained`` of the LoRA adapter over it gives our base + adapter's logits;
* the merged LoRA folder in transformers gives the same logits again (the merge is the adapter);
* the merged QLoRA folder in transformers gives our QLoRA model's logits (NF4 base + adapter): the merge is onto
  the dequantised NF4 weights;
* ``AutoTokenizer.from_pretrained`` of the base and merged folders gives our tokenizer's ids.

Each comparison: ``max |ours - theirs| / max |theirs| <= 1e-5`` in float32 (ours at ``highest`` matmul precision),
as in ``tests/test_lora_peft_gpu.py``; the adapter must change the logits for the comparison to mean anything.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5


def _rel(ours, theirs):
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def test_the_example_exports_load_in_transformers_and_peft_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from jaxgrad.lora.hf import load_hf_checkpoint
    from jaxgrad.lora.model import apply
    from jaxgrad.lora.peft import load_adapter
    from jaxgrad.lora.tokenizer import load_tokenizer

    out = tmp_path / "example"
    env = {**os.environ, "SIZE": "small", "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "finetune_example.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=270)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for mode in ("lora", "qlora"):
        loss = report["heldout_loss"][mode]
        assert loss["after"] < loss["before"], loss
        # the runs evaluate at the GPU's default float32 matmul precision (TF32): W + sBA in one product against
        # W and the adapter apart rounds differently, by more than on the CPU; the logits are compared below
        assert loss["merged"] == pytest.approx(loss["after"], abs=2e-3)

    base_dir = out / "base" / "model"
    tok = load_tokenizer(base_dir)
    held = [json.loads(line) for line in (out / "data" / "docstrings_eval.jsonl").read_text().splitlines()]
    held = [r for r in held if len(tok.encode(r["prompt"] + r["completion"])) >= 64][:4]
    assert len(held) == 4
    ids = np.array([tok.encode(r["prompt"] + r["completion"])[:64] for r in held], np.int32)  # 64 of 128 positions

    cfg, base = load_hf_checkpoint(base_dir, dtype=jnp.float32)
    lora, lcfg = load_adapter(out / "lora" / "adapter", base)
    _, nf4_base = load_hf_checkpoint(base_dir, dtype=jnp.float32, quantize="nf4")
    qlora, qlcfg = load_adapter(out / "qlora" / "adapter", nf4_base)
    with jax.default_matmul_precision("highest"):
        ours = {"base": apply(base, None, ids, cfg, None), "lora": apply(base, lora, ids, cfg, lcfg),
                "qlora": apply(nf4_base, qlora, ids, cfg, qlcfg)}
    ours = {k: np.asarray(v, np.float64) for k, v in ours.items()}
    assert _rel(ours["lora"], ours["base"]) > 1e-4, "the adapter barely changes the logits"

    def hf_model(folder):
        return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()

    x = torch.from_numpy(ids.astype(np.int64))
    with torch.no_grad():
        hf = hf_model(base_dir)
        theirs = {"base": hf(input_ids=x).logits.double().numpy()}
        theirs["lora"] = peft.PeftModel.from_pretrained(hf, str(out / "lora" / "adapter")).eval()(
            input_ids=x).logits.double().numpy()
        theirs["merged lora"] = hf_model(out / "merged-lora")(input_ids=x).logits.double().numpy()
        theirs["merged qlora"] = hf_model(out / "merged-qlora")(input_ids=x).logits.double().numpy()
    for name, o in (("base", ours["base"]), ("lora", ours["lora"]), ("merged lora", ours["lora"]),
                    ("merged qlora", ours["qlora"])):
        rel = _rel(o, theirs[name])
        assert rel <= TOL, f"{name}: max |ours - transformers/PEFT| / max |theirs| = {rel:.3g}"

    texts = [r["prompt"] + r["completion"] for r in held]
    for folder in (base_dir, out / "merged-qlora"):
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        assert [hf_tok(t)["input_ids"] for t in texts] == [tok.encode(t) for t in texts], folder.name
        assert hf_tok.eos_token == tok.eos_token
