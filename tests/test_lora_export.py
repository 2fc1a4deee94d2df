"""`jaxgrad merge`: an adapter merged into its base and exported as a Hugging Face folder with the base's tokenizer.

* LoRA: the merged model's logits are the base + adapter's logits (float32, to rounding);
* QLoRA: the merge is onto dequant(quant_NF4(W)), the weights the adapter was trained against (read from the run's
  run.json): the merged model's logits are the QLoRA model's; merging onto the dense originals gives a measurably
  different model;
* the example's report (jaxgrad.lora.example_report) reads the runs back: its held-out loss after fine-tuning is the
  run's own, and the merged folders' loss is the same;
* what cannot be merged as asked is refused, naming the argument.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cli import main as cli_main
from jaxgrad.lora.config import LlamaConfig
from jaxgrad.lora.export import merge_adapter_folder
from jaxgrad.lora.hf import load_hf_checkpoint, save_hf_checkpoint
from jaxgrad.lora.model import apply, init
from jaxgrad.lora.peft import AdapterError, load_adapter
from jaxgrad.lora.tokenizer import load_tokenizer, train_bpe_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def _records(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(1, 5)))]
        out.append({"prompt": "def f(" + ", ".join(a) + "):\n", "completion": " ".join(reversed(a)) + " done"})
    return out


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example's layout at toy size: base/model (random, with a tokenizer), lora/ and qlora/ runs of a few
    steps on a JSONL file with a held-out file."""
    d = tmp_path_factory.mktemp("example")
    train, held = _records(120, 0), _records(12, 1)
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in train], 300)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=tok.vocab_size, num_hidden_layers=2, max_position_embeddings=64)
    save_hf_checkpoint(d / "base" / "model", cfg, init(jax.random.key(0), cfg, std=0.1), overwrite=True)
    tok.save(d / "base" / "model")
    for name, recs in (("train", train), ("eval", held)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for mode in ("lora", "qlora"):
        assert cli_main(["train", "lora", "--out", str(d / mode), "--no-progress", "--set", f"model.mode={mode}",
                         "--set", f"model.base={d / 'base' / 'model'}", "--set", f"data.path={d / 'train.jsonl'}",
                         "--set", f"data.eval_path={d / 'eval.jsonl'}", "--set", "model.seq_len=48",
                         "--set", "data.batch_size=4", "--set", "train.steps=4", "--set", "train.lr=5e-2"]) == 0
    return d


def _ids(example):
    tok = load_tokenizer(example / "base" / "model")
    rows = [tok.encode(r["prompt"] + r["completion"])[:16] for r in _records(3, 2)]
    n = min(map(len, rows))
    return np.array([r[:n] for r in rows], np.int32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _logits_of_folder(folder, ids):
    cfg, params = load_hf_checkpoint(folder, dtype=jnp.float32)
    return apply(params, None, ids, cfg, None)


def test_a_merged_lora_model_gives_the_logits_of_the_base_with_the_adapter(example, tmp_path):
    out = tmp_path / "merged"
    done = merge_adapter_folder(example / "base" / "model", example / "lora" / "adapter", out)
    assert done["nf4"] is False and done["merged_modules"] == 14 and "tokenizer.json" in done["tokenizer_files"]
    ids = _ids(example)
    cfg, base = load_hf_checkpoint(example / "base" / "model", dtype=jnp.float32)
    lora, lcfg = load_adapter(example / "lora" / "adapter", base)
    with_adapter = apply(base, lora, ids, cfg, lcfg)
    assert _rel(apply(base, None, ids, cfg, None), with_adapter) > 1e-4  # the adapter does change the model
    assert _rel(_logits_of_folder(out, ids), with_adapter) <= 1e-5
    # the tokenizer came along
    assert load_tokenizer(out).encode("def f(alpha):") == load_tokenizer(example / "base" / "model").encode(
        "def f(alpha):")


def test_a_qlora_adapter_is_merged_onto_the_dequantised_nf4_weights_it_was_trained_against(example, tmp_path):
    from jaxgrad.lora.hf import dequantize_projections

    done = merge_adapter_folder(example / "base" / "model", example / "qlora" / "adapter", tmp_path / "nf4")
    assert done["nf4"] is True and done["blocksize"] == 64 and done["source"].endswith("run.json")
    ids = _ids(example)
    cfg, nf4_base = load_hf_checkpoint(example / "base" / "model", dtype=jnp.float32, quantize="nf4")
    lora, lcfg = load_adapter(example / "qlora" / "adapter", nf4_base)
    qlora_logits = apply(nf4_base, lora, ids, cfg, lcfg)
    assert _rel(_logits_of_folder(tmp_path / "nf4", ids), qlora_logits) <= 1e-5
    # the merged weights are dequant(NF4) + s B A, not W + s B A
    merged = load_hf_checkpoint(tmp_path / "nf4", dtype=jnp.float32)[1]
    dequant = dequantize_projections(nf4_base)
    q = merged["layers"][0]["self_attn"]["q_proj"]["weight"]
    a, b = lora["layers"][0]["self_attn"]["q_proj"]["lora_A"], lora["layers"][0]["self_attn"]["q_proj"]["lora_B"]
    np.testing.assert_allclose(q, dequant["layers"][0]["self_attn"]["q_proj"]["weight"] + lcfg.scale * (b @ a),
                               rtol=0, atol=1e-6)
    # the same adapter away from its run: without --nf4 it is merged onto the dense weights, a different model
    elsewhere = tmp_path / "adapter-copy"
    shutil.copytree(example / "qlora" / "adapter", elsewhere)
    assert merge_adapter_folder(example / "base" / "model", elsewhere, tmp_path / "dense")["nf4"] is False
    dense_err = _rel(_logits_of_folder(tmp_path / "dense", ids), qlora_logits)
    print(f"merged onto the dense weights: logits off the QLoRA model's by {dense_err:.3g} of their max")
    assert dense_err > 1e-2, dense_err  # measured 9e-2: the whole NF4 error of every projection, vs <= 1e-5
    # and with --nf4 it is the run's merge again, bit for bit
    assert merge_adapter_folder(example / "base" / "model", elsewhere, tmp_path / "flag", nf4=True)["nf4"]
    assert (tmp_path / "flag" / "model.safetensors").read_bytes() == (tmp_path / "nf4" / "model.safetensors"
                                                                        ).read_bytes()


def test_the_example_report_reads_the_runs_and_the_merged_folders_back(example, capsys):
    from jaxgrad.lora.example_report import example_report

    for mode in ("lora", "qlora"):
        assert cli_main(["merge", "--base", str(example / "base" / "model"), "--adapter",
                         str(example / mode / "adapter"), "--out", str(example / f"merged-{mode}"),
                         "--overwrite"]) == 0
    assert "onto the dequantised NF4 weights" in capsys.readouterr().out
    report = example_report(example, n_generations=2, max_new_tokens=4)
    for mode in ("lora", "qlora"):
        loss = report["heldout_loss"][mode]
        assert loss["after"] == pytest.approx(loss["run_summary"], abs=1e-6)  # the run's own evaluation
        assert loss["merged"] == pytest.approx(loss["after"], abs=1e-5)
        assert loss["after"] != loss["before"]
    assert len(report["generations"]) == 2
    assert {"prompt", "reference", "lora", "qlora"} <= set(report["generations"][0])
    assert json.loads((example / "report.json").read_text())["heldout_loss"] == report["heldout_loss"]


def test_what_cannot_be_merged_as_asked_is_refused_by_name(example, tmp_path, capsys):
    base, adapter = example / "base" / "model", example / "qlora" / "adapter"
    with pytest.raises(ValueError, match=r"nf4\) = False, but the run .* has nf4 = True"):
        merge_adapter_folder(base, adapter, tmp_path / "a", nf4=False)
    with pytest.raises(ValueError, match="blocksize.* = 32, but the run"):
        merge_adapter_folder(base, adapter, tmp_path / "a", blocksize=32)
    with pytest.raises(ValueError, match="is the base folder"):
        merge_adapter_folder(base, adapter, base, overwrite=True)
    with pytest.raises(FileNotFoundError, match="'adapter'"):
        merge_adapter_folder(base, tmp_path / "nowhere", tmp_path / "a")
    merge_adapter_folder(base, adapter, tmp_path / "b")
    with pytest.raises(FileExistsError, match="--overwrite"):
        merge_adapter_folder(base, adapter, tmp_path / "b")
    other = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=300, num_hidden_layers=2, max_position_embeddings=64)
    save_hf_checkpoint(tmp_path / "other", other, init(jax.random.key(1), other))
    with pytest.raises(AdapterError, match="shape"):
        merge_adapter_folder(tmp_path / "other", adapter, tmp_path / "c")
    elsewhere = tmp_path / "adapter-copy"  # no run.json above it: the flags say how the base was held
    shutil.copytree(adapter, elsewhere)
    with pytest.raises(ValueError, match="give --nf4"):
        merge_adapter_folder(base, elsewhere, tmp_path / "e", blocksize=32)
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "d"),
                     "--dense"]) == 2
    assert "jaxgrad merge: error: --nf4/--dense" in capsys.readouterr().err
