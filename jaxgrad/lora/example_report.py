r"""The numbers of the fine-tuning example (``scripts/finetune_example.sh``, ``docs/lora.md``): held-out loss and
greedy generations of the base model before and after LoRA / QLoRA, and of the merged exports.

    python -m jaxgrad.lora.example_report runs/finetune-example [--runs lora qlora] [--generations 3]

The folder holds the example's runs: ``base/model`` (the model pretrained with ``jaxgrad train lora``, mode full),
``lora/`` and ``qlora/`` (the fine-tuning runs: ``run.json``, ``summary.json``, ``adapter/``) and, where
``jaxgrad merge`` wrote them, ``merged-lora/`` and ``merged-qlora/``. Each fine-tuning run is rebuilt from its own
``run.json`` (the same base, the same NF4 settings, the same held-out records ``data.eval_path``), so that

* **held-out loss** is the run's own evaluation (:func:`jaxgrad.lora.task.make_task`'s ``evaluate``): the mean
  cross-entropy, in nats per token, of the held-out completions' tokens given their prompts (the docstring given the
  signature; prompt tokens are not counted), ``before`` = the base alone (the adapter at PEFT's initialisation,
  :math:`B = 0`, is exactly the base; for QLoRA the NF4 base), ``after`` = the base with the trained adapter, which
  equals the ``heldout_loss`` of the run's ``summary.json`` (``run_summary``);
* **merged**: the exported folder loaded as a plain model (no adapter) and evaluated on the same records: the merge
  is right when this equals ``after`` (up to float32 rounding of :math:`W + sBA`);
* **generations**: greedy continuations (:func:`jaxgrad.lora.generate.generate`, up to ``max_new_tokens``, EOS
  stops) of the first held-out prompts, decoded with the model's tokenizer, before and after.

Everything is written to ``report.json`` in the folder and printed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

__all__ = ["load_run", "run_losses", "merged_loss", "greedy_texts", "heldout_prompts", "example_report", "main"]

RUN_OWNER = "jaxgrad train lora"


def load_run(run_dir: str | pathlib.Path):
    """``(fit, summary)`` of a ``jaxgrad train lora`` run folder: its :class:`~jaxgrad.lora.task_config.LoraFit`
    rebuilt from ``run.json`` and its ``summary.json`` (``{}`` if the run has none)."""
    from jaxgrad.lora.task import fit_from_config

    run_dir = pathlib.Path(run_dir)
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise FileNotFoundError(f"example_report: {run_dir} holds no run.json (not a `jaxgrad train lora` run)")
    run = json.loads(run_file.read_text())
    if run.get("script") != RUN_OWNER:
        raise ValueError(f"example_report: {run_file} was written by {run.get('script')!r}, not `{RUN_OWNER}`")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return fit_from_config(run["config"]), summary


def _adapter_params(fit, run_dir: pathlib.Path):
    """``(task, before, after)``: the run's task, its params at initialisation (the base with a zero ``B``) and
    with the trained adapter of ``run_dir/adapter``."""
    from jaxgrad.lora.peft import load_adapter
    from jaxgrad.lora.task import make_task

    task = make_task(fit)
    before = jax.device_get(task.init(jax.random.key(0)))
    lora, _ = load_adapter(run_dir / "adapter", n_layers=len(before["base"]["layers"]))
    lora = jax.tree.map(lambda new, old: np.asarray(new, old.dtype), lora, before["lora"])
    return task, before, {"base": before["base"], "lora": lora}


def run_losses(run_dir: str | pathlib.Path) -> dict:
    """Held-out loss of a fine-tuning run's base before and after its adapter (module docstring)."""
    run_dir = pathlib.Path(run_dir)
    fit, summary = load_run(run_dir)
    task, before, after = _adapter_params(fit, run_dir)
    b, a = task.evaluate(before), task.evaluate(after)
    return {"before": b["heldout_loss"], "after": a["heldout_loss"], "tokens": a["heldout_tokens"],
            "run_summary": summary.get("eval", {}).get("heldout_loss")}


def merged_loss(merged_dir: str | pathlib.Path, run_dir: str | pathlib.Path) -> float:
    """Held-out loss of an exported merged folder (a plain model: an adapter with ``B = 0`` adds nothing) on the
    run's held-out records, with the run's data settings."""
    import dataclasses

    from jaxgrad.lora.task import make_task

    fit, _ = load_run(run_dir)
    plain = dataclasses.replace(fit, mode="lora", base=str(merged_dir), nf4_blocksize=64, double_quant=False)
    task = make_task(plain)
    return task.evaluate(jax.device_get(task.init(jax.random.key(0))))["heldout_loss"]


def heldout_prompts(fit, n: int) -> list[dict]:
    """The first ``n`` held-out records (``data.eval_path``) as ``{"prompt", "reference"}``."""
    from jaxgrad.lora.data import read_records

    if fit.eval_path is None:
        raise ValueError("example_report: the run has no data.eval_path; the generations are made on its held-out "
                         "records")
    records = read_records(fit.eval_path, key="data.eval_path")[:n]
    return [{"prompt": r["prompt"], "reference": r["completion"]} for r in records]


def greedy_texts(params, lora, lcfg, cfg, tokenizer, prompts, max_new_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` (strings, tokenized as in training: the BOS, then the prompt), decoded
    without special tokens."""
    from jaxgrad.lora.generate import generate

    ids = [tokenizer.encode(p) for p in prompts]
    room = cfg.max_position_embeddings - max(map(len, ids))
    if room < 1:
        raise ValueError(f"example_report: a prompt of {max(map(len, ids))} tokens leaves no room to generate in "
                         f"{cfg.max_position_embeddings} positions")
    out = generate(params, lora, ids, cfg, lcfg, max_new_tokens=min(max_new_tokens, room),
                   eos_token_id=tokenizer.eos_token_id)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


def run_generations(run_dir: str | pathlib.Path, prompts: list[str], max_new_tokens: int) -> dict:
    """``{"before": [...], "after": [...]}``: the run's base (NF4 for QLoRA) without and with its adapter."""
    from jaxgrad.lora.peft import load_adapter
    from jaxgrad.lora.task import load_base, load_tokenizer_of

    run_dir = pathlib.Path(run_dir)
    fit, _ = load_run(run_dir)
    tokenizer = load_tokenizer_of(fit)
    cfg = fit.llama_config(tokenizer.vocab_size)
    base = load_base(fit, cfg)
    lora, lcfg = load_adapter(run_dir / "adapter", n_layers=cfg.num_hidden_layers)
    return {"before": greedy_texts(base, None, None, cfg, tokenizer, prompts, max_new_tokens),
            "after": greedy_texts(base, lora, lcfg, cfg, tokenizer, prompts, max_new_tokens)}


def example_report(folder: str | pathlib.Path, *, runs=("lora", "qlora"), n_generations: int = 3,
                   max_new_tokens: int = 48, write: bool = True) -> dict:
    """The report of the example folder (module docstring); written to ``folder/report.json`` when ``write``."""
    folder = pathlib.Path(folder)
    report: dict = {"folder": str(folder), "heldout_loss": {}, "generations": []}
    prompts = None
    for name in runs:
        run_dir = folder / name
        losses = run_losses(run_dir)
        merged = folder / f"merged-{name}"
        if (merged / "config.json").is_file():
            losses["merged"] = merged_loss(merged, run_dir)
        report["heldout_loss"][name] = losses
        if prompts is None:
            prompts = heldout_prompts(load_run(run_dir)[0], n_generations)
            report["generations"] = [dict(p) for p in prompts]
        texts = run_generations(run_dir, [p["prompt"] for p in prompts], max_new_tokens)
        for i, g in enumerate(report["generations"]):
            g[name] = {"before": texts["before"][i], "after": texts["after"][i]}
    if write:
        (folder / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


def format_report(report: dict) -> str:
    """The report as text: a loss table, then each prompt with its reference and the generations."""
    lines = ["held-out loss (nats per completion token; lower is better)",
             f"  {'run':<7} {'before':>8} {'after':>8} {'merged':>8} {'run summary':>12} {'tokens':>7}"]
    for name, v in report["heldout_loss"].items():
        merged = f"{v['merged']:8.4f}" if "merged" in v else f"{'-':>8}"
        summary = f"{v['run_summary']:12.4f}" if v.get("run_summary") is not None else f"{'-':>12}"
        lines.append(f"  {name:<7} {v['before']:8.4f} {v['after']:8.4f} {merged} {summary} {v['tokens']:>7}")
    for g in report["generations"]:
        lines += ["", "-" * 100, g["prompt"] + "  [prompt]", f"reference: {g['reference']!r}"]
        for name in report["heldout_loss"]:
            lines += [f"{name} before: {g[name]['before']!r}", f"{name} after:  {g[name]['after']!r}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxgrad.lora.example_report", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the example's output folder (base/, lora/, qlora/, merged-*/)")
    parser.add_argument("--runs", nargs="+", default=["lora", "qlora"], help="the fine-tuning runs to report")
    parser.add_argument("--generations", type=int, default=3, help="held-out prompts to generate from")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt at most")
    args = parser.parse_args(argv)
    try:
        report = example_report(args.folder, runs=tuple(args.runs), n_generations=args.generations,
                                max_new_tokens=args.max_new_tokens)
    except (FileNotFoundError, ValueError) as err:
        print(f"example_report: error: {str(err).removeprefix('example_report: ')}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(f"\nwrote {pathlib.Path(args.folder) / 'report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
