"""A tokenizer trained on local data files: ``jaxgrad tokenizer DATA --vocab-size N --out DIR``.

The files are read as the training data is (:func:`jaxgrad.lora.data.read_records`: a file, folder or glob of
JSONL / JSON / Parquet / CSV / text); every string of every record -- ``text``, ``prompt`` and ``completion``, each
message's ``content`` -- is a training text of :func:`jaxgrad.lora.tokenizer.train_bpe_tokenizer` (a byte-level
BPE built as Llama 3's tokenizer is, with its special tokens and chat template). The folder written is what
``model.tokenizer`` (and a model trained from scratch with it, saved with ``jaxgrad train lora``) reads.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping


def record_texts(record: Mapping) -> Iterator[str]:
    """Every non-empty string of a record: top-level string fields and the ``content`` / ``value`` of messages."""
    for value in record.values():
        if isinstance(value, str):
            if value:
                yield value
        elif isinstance(value, list):
            for m in value:
                if isinstance(m, Mapping):
                    text = m.get("content", m.get("value"))
                    if isinstance(text, str) and text:
                        yield text


def train_tokenizer_on_files(path, vocab_size: int, out, *, pattern: str | None = None,
                             file_format: str | None = None, sample_by: str = "document", overwrite: bool = False):
    """Train a byte-level BPE of ``vocab_size`` tokens on the records of ``path`` and save it to ``out``; returns
    ``(tokenizer, n_records, n_chars)``. ``out`` must not hold a ``tokenizer.json`` unless ``overwrite``."""
    from jaxgrad.lora.data import read_records
    from jaxgrad.lora.tokenizer import train_bpe_tokenizer

    out = pathlib.Path(out).expanduser()
    if (out / "tokenizer.json").exists() and not overwrite:
        raise FileExistsError(f"--out {out}: already holds a tokenizer.json (pass --overwrite to replace it)")
    records = read_records(path, file_format=file_format, pattern=pattern, sample_by=sample_by)
    texts = [t for r in records for t in record_texts(r)]
    if not texts:
        raise ValueError(f"DATA {path}: its {len(records)} records hold no text")
    tok = train_bpe_tokenizer(texts, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    return tok, len(records), sum(map(len, texts))
