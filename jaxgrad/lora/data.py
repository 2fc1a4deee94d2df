r"""Fine-tuning data: local files of records -> tokenized examples with a loss mask -> packed rows -> batches.

Files: a file, a folder (every file in it and below, hidden ones skipped; ``pattern`` selects by glob) or a glob,
absolute, relative or ``~``; one format per read, from the extension: ``.jsonl`` / ``.json`` / ``.ndjson`` (JSON
lines or one JSON list of objects), ``.parquet``, ``.csv``, ``.txt`` (one record per line by default,
``sample_by="paragraph" | "document"``). They are read by the ``datasets`` library (its ``json`` / ``parquet`` /
``csv`` / ``text`` builders over the local files: no network, its cache in a temporary folder).

Record shapes (TRL's dataset types), found from the columns or forced with ``format``:

* ``"text"`` (column ``text``): ``tokenizer.encode(text)`` (BOS as the tokenizer adds it) plus EOS, as TRL does for
  language modelling; loss on every token;
* ``"prompt_completion"`` (``prompt`` + ``completion``, two strings or two lists of messages):
  ``tokenizer.tokenize_prompt_completion`` (strings: the completion ends with EOS; messages: the chat template);
  loss on the completion only (TRL's ``completion_only_loss``; ``completion_only=False``: every token);
* ``"messages"`` (``messages``: a list of ``{"role", "content"}``; ShareGPT's ``conversations`` of
  ``{"from", "value"}`` with roles ``human`` / ``gpt`` is read as such): the chat template, loss on the assistant
  turns only (TRL's ``assistant_only_loss``; ``assistant_only=False``: every token).

Other columns are not used (listed in :class:`DataStats`). A record with an empty field is dropped, an example with
no counted label (no completion / assistant token, or none left after truncation) too; both are counted. Examples
longer than ``seq_len`` are truncated (or split into chunks, ``overlong="split"``), counted.

The held-out split is by example: a fraction ``held_out`` of the examples drawn by ``default_rng(seed)``, or the
records of a separate ``eval_path``. Rows, labels and batches: :mod:`jaxgrad.lora.packing`. In use::

    data = build_sft_data("chat.jsonl", load_tokenizer("model/"), seq_len=1024, batch_size=8, held_out=0.05)
    print(data.describe())            # records, drops, truncation, rows, segments per row, fill, loss tokens
    for batch in data.batches(epoch):  # input_ids, labels, positions, segment_ids, attention_mask [8, 1024], n_items
        ...
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from jaxgrad.lora.packing import OVERLONG, Example, PackedRows, fit_to_length, loss_tokens, pack
from jaxgrad.train.errors import ConfigError, DataError

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv",
                ".txt": "text"}
SHAPES = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",)}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
SAMPLE_BY = ("line", "paragraph", "document")
#: the configuration key each argument of :func:`build_sft_data` is named by in errors (``keys=`` overrides)
KEYS = {"path": "data.path", "eval_path": "data.eval_path", "format": "data.format", "held_out": "data.held_out",
        "batch_size": "data.batch_size", "seed": "data.seed", "seq_len": "model.seq_len",
        "overlong": "data.overlong", "pattern": "data.pattern", "sample_by": "data.sample_by",
        "file_format": "data.file_format"}


# ------------------------------------------------------------------------------------------------------------ files


def find_data_files(path, *, pattern: str | None = None, file_format: str | None = None, key: str = "data.path"
                    ) -> tuple[list[pathlib.Path], str, list[pathlib.Path]]:
    """``(files, file_format, ignored)``: the data files ``path`` names (sorted), their ``datasets`` builder
    (``"json" | "parquet" | "csv" | "text"``) and, in a folder, the files skipped for an unknown extension."""
    if file_format is not None and file_format not in set(FILE_FORMATS.values()):
        raise ConfigError(f"{key}: file format must be one of {sorted(set(FILE_FORMATS.values()))}, "
                          f"got {file_format!r}")
    text = os.path.expanduser(str(path))
    p = pathlib.Path(text)
    if p.is_file():
        if pattern is not None:
            raise ConfigError(f"{key} = {str(path)!r} is a file; a pattern ({pattern!r}) selects files in a folder")
        candidates = [p]
    elif p.is_dir():
        found = p.glob(pattern) if pattern is not None else p.rglob("*")
        candidates = sorted(f for f in found
                            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
    elif glob.has_magic(text):
        candidates = sorted(pathlib.Path(f) for f in glob.glob(text, recursive=True) if os.path.isfile(f))
    else:
        raise DataError(f"{key} = {str(path)!r}: no such file or folder (resolved to {p.resolve()})")
    if not candidates:
        raise DataError(f"{key} = {str(path)!r}: no file found" + (f" matching {pattern!r}" if pattern else ""))
    if file_format is not None:
        return candidates, file_format, []
    kinds = {f: FILE_FORMATS.get(f.suffix.lower()) for f in candidates}
    files = [f for f in candidates if kinds[f] is not None]
    ignored = [f for f in candidates if kinds[f] is None]
    supported = ", ".join(FILE_FORMATS)
    if not files:
        names = ", ".join(sorted({f.suffix or f.name for f in ignored}))
        raise DataError(f"{key} = {str(path)!r}: no file with a supported extension ({supported}); found {names}")
    formats = sorted({kinds[f] for f in files})
    if len(formats) > 1:
        by = {fmt: sorted({f.suffix.lower() for f in files if kinds[f] == fmt}) for fmt in formats}
        raise DataError(f"{key} = {str(path)!r}: files of several formats {by}; point it at one format (a folder "
                        f"of one kind, a glob, or a pattern)")
    return files, formats[0], ignored


def _load_with_datasets(files: Sequence[pathlib.Path], file_format: str, key: str, sample_by: str
                        ) -> tuple[list[str], list[dict]]:
    """``(columns, records)`` of ``files`` through ``datasets.load_dataset``: the packaged builder of the format
    over local files (no Hub look-up, so no network), its cache in a temporary folder removed after reading (not
    ``~/.cache/huggingface``), progress bars off while it runs."""
    import datasets

    kwargs = {"sample_by": sample_by} if file_format == "text" else {}
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="jaxgrad-datasets-") as cache:
            try:
                ds = datasets.load_dataset(file_format, data_files=[str(f) for f in files], split="train",
                                           cache_dir=cache, keep_in_memory=True, **kwargs)
            except Exception as err:  # any parse or schema error of the user's files
                names = ", ".join(str(f) for f in files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
                raise DataError(f"{key}: cannot read {names} as {file_format}: {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}") from err
            return list(ds.column_names), ds.to_list()
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def read_records(path, *, file_format: str | None = None, pattern: str | None = None, sample_by: str = "line",
                 key: str = "data.path") -> list[dict]:
    """The records (dicts, one per JSON line / object, table row or text unit) of the data file(s) ``path``
    (:func:`find_data_files`)."""
    return _read(path, file_format=file_format, pattern=pattern, sample_by=sample_by, key=key)[1]


def _read(path, *, file_format, pattern, sample_by, key):
    if sample_by not in SAMPLE_BY:
        raise ConfigError(f"{KEYS['sample_by']}: must be one of {SAMPLE_BY}, got {sample_by!r}")
    files, fmt, ignored = find_data_files(path, pattern=pattern, file_format=file_format, key=key)
    columns, records = _load_with_datasets(files, fmt, key, sample_by)
    if not records:
        raise DataError(f"{key} = {str(path)!r}: {len(files)} file(s) hold no record")
    return files, records, columns, ignored


# ------------------------------------------------------------------------------------------------------------ shapes


def detect_shape(columns: Sequence[str], format: str | None = None, *, key: str = "data.path",
                 format_key: str = "data.format") -> str:
    """The record shape (a key of :data:`SHAPES`) of records with ``columns``: ``format`` if given (its columns
    must be there), else the first present of ``messages``, ``conversations`` (ShareGPT), ``prompt`` +
    ``completion``, ``text``."""
    cols = set(columns)
    expected = "'text', 'prompt' + 'completion', or 'messages' (or ShareGPT's 'conversations')"
    if format is not None:
        if format not in SHAPES:
            raise ConfigError(f"{format_key}: must be one of {tuple(SHAPES)}, got {format!r}")
        missing = [c for c in shape_columns(format, columns) if c not in cols]
        if missing:
            raise DataError(f"{key}: {format_key} = {format!r} needs the column(s) {list(SHAPES[format])}; the "
                            f"records have {sorted(cols)}")
        return format
    if "messages" in cols or "conversations" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    hint = " ('prompt' without 'completion': prompt-only data cannot be trained on)" if "prompt" in cols else ""
    raise DataError(f"{key}: the records' columns {sorted(cols)} match no record shape; expected {expected}{hint}")


def shape_columns(shape: str, columns: Sequence[str]) -> tuple[str, ...]:
    """The columns a record of ``shape`` is read from (``conversations`` when a chat has no ``messages``)."""
    if shape == "messages" and "messages" not in columns:
        return ("conversations",)
    return SHAPES[shape]


def _messages(value, where: str) -> list[dict]:
    """A chat as ``[{"role", "content"}, ...]``: ShareGPT's ``from`` / ``value`` renamed (``human`` -> ``user``,
    ``gpt`` -> ``assistant``); keys a columnar file filled with None for messages that lack them are dropped."""
    if not isinstance(value, list) or not value or not all(isinstance(m, Mapping) for m in value):
        raise DataError(f"{where}: expected a non-empty list of messages {{'role', 'content'}}, got "
                        f"{type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        m = {k: v for k, v in m.items() if v is not None}
        if "role" not in m and "from" in m:
            role = SHAREGPT_ROLES.get(m.pop("from"))
            if role is None:
                raise DataError(f"{where}[{i}]: ShareGPT role {value[i]['from']!r} is not one of "
                                f"{sorted(SHAREGPT_ROLES)}")
            m = {"role": role, "content": m.pop("value", None), **m}
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}[{i}]: a message needs a string 'role' and a string 'content', got keys "
                            f"{sorted(m)}")
        out.append(m)
    return out


def _empty(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value)


def _through_template(fn, where: str, *args):
    """``fn(*args)``, a chat template's refusal of this record (a ``ValueError``) as a :class:`DataError`."""
    try:
        return fn(*args)
    except ValueError as err:
        raise DataError(f"{where}: {err}") from err


def tokenize_record(record: Mapping, shape: str, tokenizer, *, completion_only: bool = True,
                    assistant_only: bool = True, columns: Sequence[str] | None = None, where: str = "record"
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ids int32 [L], loss_mask bool [L])`` of one record of ``shape`` (module docstring), or None if a field
    it needs is empty."""
    cols = shape_columns(shape, list(record) if columns is None else columns)
    values = [record.get(c) for c in cols]
    if any(_empty(v) for v in values):
        return None
    eos = tokenizer.eos_token_id
    if shape == "text":
        (text,) = values
        if not isinstance(text, str):
            raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        ids = list(tokenizer.encode(text))
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        mask = [True] * len(ids)
    elif shape == "prompt_completion":
        prompt, completion = values
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt = _messages(prompt, f"{where}: 'prompt'")
            completion = _messages(completion, f"{where}: 'completion'")
        elif not (isinstance(prompt, str) and isinstance(completion, str)):
            raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages, "
                            f"got {type(prompt).__name__} and {type(completion).__name__}")
        ids, mask = _through_template(tokenizer.tokenize_prompt_completion, where, prompt, completion)
        if not completion_only:
            mask = [True] * len(ids)
    else:
        ids, mask = _through_template(tokenizer.tokenize_chat, where, _messages(values[0], f"{where}: {cols[0]!r}"))
        if not assistant_only:
            mask = [True] * len(ids)
    if len(ids) != len(mask):
        raise ValueError(f"tokenize_record: the tokenizer gave {len(ids)} ids but {len(mask)} mask entries")
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def tokenize_records(records: Sequence[Mapping], shape: str, tokenizer, *, completion_only: bool = True,
                     assistant_only: bool = True, key: str = "data.path") -> tuple[list[Example], Counter]:
    """The records' examples (``source`` = the record's index) and a count of the dropped ones by reason
    (``"empty field"``, ``"no loss token"``)."""
    columns = list(records[0]) if records else []
    examples, dropped = [], Counter()
    for i, rec in enumerate(records):
        out = tokenize_record(rec, shape, tokenizer, completion_only=completion_only, assistant_only=assistant_only,
                              columns=columns, where=f"{key}: record {i}")
        if out is None:
            dropped["empty field"] += 1
            continue
        ex = Example(out[0], out[1], i)
        if loss_tokens(ex) == 0:
            dropped["no loss token"] += 1
            continue
        examples.append(ex)
    return examples, dropped


# ------------------------------------------------------------------------------------------------------------ split


def split_held_out(examples: Sequence[Example], held_out: float, seed: int
                   ) -> tuple[list[Example], list[Example]]:
    """``(train, held-out)`` by example: ``default_rng(seed).permutation(n)``; its first ``round(held_out * n)``
    examples, at least one and at most ``n - 1``, are held out (in record order), the rest train in the
    permutation's order."""
    n = len(examples)
    if n < 2:
        raise ValueError(f"split_held_out: needs at least 2 examples, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_eval = min(n - 1, max(1, int(round(held_out * n))))
    held = sorted(order[:n_eval].tolist())
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in held]


def shuffled(examples: Sequence[Example], seed: int) -> list[Example]:
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order]


# ------------------------------------------------------------------------------------------------------------ stats


@dataclasses.dataclass(frozen=True)
class SplitStats:
    """One split after fitting to ``seq_len`` and packing: ``examples`` packed, ``overlong`` (longer than
    ``seq_len``), ``tokens_cut`` (by truncation), ``chunks`` (by splitting), ``dropped_no_loss`` (no counted label
    left), ``rows``, ``segments``, ``max_segments_per_row``, ``tokens`` (real), ``row_tokens`` (rows x seq_len),
    ``loss_tokens`` (sum of ``n_items``), ``unused_rows_per_epoch`` (training: ``rows % batch_size``)."""
    examples: int
    overlong: int
    tokens_cut: int
    chunks: int
    dropped_no_loss: int
    rows: int
    segments: int
    max_segments_per_row: int
    tokens: int
    row_tokens: int
    loss_tokens: int
    unused_rows_per_epoch: int = 0

    @property
    def fill(self) -> float:
        """Real tokens / row tokens."""
        return self.tokens / self.row_tokens if self.row_tokens else 0.0

    @property
    def segments_per_row(self) -> float:
        return self.segments / self.rows if self.rows else 0.0

    def describe(self, overlong: str = "truncate") -> str:
        parts = [f"{self.examples} examples -> {self.rows} rows ({self.segments_per_row:.2f} segments per row, max "
                 f"{self.max_segments_per_row}; fill {self.fill:.1%}), {self.loss_tokens} loss tokens"]
        if self.overlong:
            parts.append(f"{self.overlong} longer than seq_len "
                         + (f"truncated ({self.tokens_cut} tokens cut)" if overlong == "truncate"
                            else f"split into {self.chunks} chunks"))
        if self.dropped_no_loss:
            parts.append(f"{self.dropped_no_loss} dropped with no loss token left")
        if self.unused_rows_per_epoch:
            parts.append(f"{self.unused_rows_per_epoch} rows unused each epoch")
        return ", ".join(parts)


def split_stats(rows: PackedRows, examples: int, report, unused: int = 0) -> SplitStats:
    """The :class:`SplitStats` of ``examples`` examples fitted to length (``report``) and packed into ``rows``."""
    per_row = [len(s) for s in rows.sources]
    return SplitStats(examples=examples, overlong=report.overlong, tokens_cut=report.tokens_cut, chunks=report.chunks,
                      dropped_no_loss=report.dropped_no_loss, rows=rows.n_rows, segments=sum(per_row),
                      max_segments_per_row=max(per_row, default=0), tokens=rows.real_tokens(),
                      row_tokens=int(rows.input_ids.size), loss_tokens=int(rows.n_items.sum()),
                      unused_rows_per_epoch=unused)


@dataclasses.dataclass(frozen=True)
class DataStats:
    """What reading, tokenizing, splitting and packing did: the files read (and, in a folder, skipped), the record
    shape and the columns not used, records read, records dropped by reason, and each split's :class:`SplitStats`
    (``eval`` None without a held-out set)."""
    shape: str
    files: tuple[str, ...]
    files_ignored: tuple[str, ...]
    columns_unused: tuple[str, ...]
    records: int
    dropped: Mapping[str, int]
    seq_len: int
    packing: bool
    overlong: str
    train: SplitStats
    eval: SplitStats | None
    eval_files: tuple[str, ...] = ()
    eval_records: int = 0

    def describe(self) -> str:
        """One line."""
        src = f"{self.records} {self.shape} records from {len(self.files)} file(s)"
        if self.files_ignored:
            src += f" ({len(self.files_ignored)} other files skipped)"
        if self.columns_unused:
            src += f", columns not used {list(self.columns_unused)}"
        if self.eval_files:
            src += f"; {self.eval_records} held-out records from {len(self.eval_files)} file(s)"
        if self.dropped:
            src += "; dropped " + ", ".join(f"{n} ({why})" for why, n in sorted(self.dropped.items()))
        how = f"{'packed' if self.packing else 'padded'} to {self.seq_len} tokens"
        out = f"data: {src}; {how}; train: {self.train.describe(self.overlong)}"
        if self.eval is not None:
            out += f"; held out: {self.eval.describe(self.overlong)}"
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dropped"] = dict(self.dropped)
        for split in ("train", "eval"):
            if d[split] is not None:
                s = getattr(self, split)
                d[split].update(fill=s.fill, segments_per_row=s.segments_per_row)
        return d


# ------------------------------------------------------------------------------------------------------------ build


@dataclasses.dataclass(frozen=True, eq=False)
class SFTData:
    """Packed training rows (``train``), held-out rows (``eval``, or None), the statistics, and the batching:
    :meth:`batches` (``epoch``), :attr:`batches_per_epoch`, :meth:`eval_batches`."""
    train: PackedRows
    eval: PackedRows | None
    stats: DataStats
    batch_size: int
    seed: int

    @property
    def batches_per_epoch(self) -> int:
        return self.train.batches_per_epoch(self.batch_size)

    def batches(self, epoch: int):
        """Epoch ``epoch``'s training batches (:meth:`PackedRows.batches`)."""
        return self.train.batches(epoch, self.batch_size, self.seed)

    def eval_batches(self):
        """Every held-out row once (:meth:`PackedRows.eval_batches`); nothing without a held-out set."""
        return iter(()) if self.eval is None else self.eval.eval_batches(self.batch_size)

    def describe(self) -> str:
        return self.stats.describe()


def _check_int(name: str, value, low: int, keys: Mapping[str, str]) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{keys[name]}: must be an integer >= {low}, got {value!r}")


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def build_sft_data(path, tokenizer, *, seq_len: int, batch_size: int, held_out: float = 0.0, seed: int = 0,
                   packing: bool = True, completion_only: bool = True, assistant_only: bool = True,
                   format: str | None = None, eval_path=None, overlong: str = "truncate",
                   pattern: str | None = None, file_format: str | None = None, sample_by: str = "line",
                   keys: Mapping[str, str] | None = None) -> SFTData:
    """Read, tokenize, split, fit and pack the records of ``path`` (module docstring) for batches of
    ``batch_size`` rows of ``seq_len`` tokens.

    ``held_out`` in ``[0, 1)``: the fraction of examples held out (0: none), exclusive with ``eval_path``, a
    separate held-out file / folder / glob read like ``path``. ``seed`` draws the held-out examples, the order the
    packer sees the training examples in (ties of length), and each epoch's row order. ``packing=False``: one
    example per row. ``overlong``: ``"truncate"`` (TRL's default) or ``"split"``. ``keys``: the configuration
    names errors use for each argument (default :data:`KEYS`)."""
    keys = {**KEYS, **(keys or {})}
    _check_int("seq_len", seq_len, 2, keys)
    _check_int("batch_size", batch_size, 1, keys)
    _check_int("seed", seed, 0, keys)
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0.0 <= held_out < 1.0:
        raise ConfigError(f"{keys['held_out']}: must be a fraction in [0, 1), got {held_out!r}")
    if eval_path is not None and held_out > 0:
        raise ConfigError(f"{keys['held_out']} = {held_out} and {keys['eval_path']} = {str(eval_path)!r}: the "
                          f"held-out set is either a fraction of {keys['path']} or a separate path, not both")
    if overlong not in OVERLONG:
        raise ConfigError(f"{keys['overlong']}: must be one of {OVERLONG}, got {overlong!r}")

    def read(p, key):
        files, records, columns, ignored = _read(p, file_format=file_format, pattern=pattern, sample_by=sample_by,
                                                 key=key)
        shape = detect_shape(columns, format, key=key, format_key=keys["format"])
        examples, dropped = tokenize_records(records, shape, tokenizer, completion_only=completion_only,
                                             assistant_only=assistant_only, key=key)
        unused = tuple(c for c in columns if c not in shape_columns(shape, columns))
        return files, records, shape, examples, dropped, unused, ignored

    files, records, shape, examples, dropped, unused, ignored = read(path, keys["path"])
    eval_files, eval_records, eval_examples = (), [], None
    if eval_path is not None:
        eval_files, eval_records, _, eval_examples, eval_dropped, _, _ = read(eval_path, keys["eval_path"])
        dropped = dropped + Counter({f"{why}, held-out": n for why, n in eval_dropped.items()})
    if not examples:
        raise DataError(f"{keys['path']} = {str(path)!r}: none of its {len(records)} records gives an example "
                        f"with a loss token (dropped: {dict(dropped)})")
    if held_out > 0:
        if len(examples) < 2:
            raise DataError(f"{keys['held_out']} = {held_out}: {keys['path']} gives {len(examples)} example, too few "
                            f"to hold any out")
        train_ex, eval_examples = split_held_out(examples, held_out, seed)
    else:
        train_ex = shuffled(examples, seed)
    if eval_examples is not None and not eval_examples:
        raise DataError(f"{keys['eval_path']} = {str(eval_path)!r}: no record gives an example with a loss token")

    pad = _pad_id(tokenizer)
    train_fit, train_report = fit_to_length(train_ex, seq_len, overlong)
    if not train_fit:
        raise DataError(f"{keys['path']}: no training example keeps a loss token within {keys['seq_len']} = "
                        f"{seq_len}")
    train_rows = pack(train_fit, seq_len, pad, packing=packing)
    if train_rows.n_rows < batch_size:
        raise DataError(f"{keys['path']}: the training examples fill {train_rows.n_rows} rows of {seq_len} tokens, "
                        f"fewer than {keys['batch_size']} = {batch_size}")
    eval_rows = eval_stats = None
    if eval_examples is not None:
        eval_fit, eval_report = fit_to_length(eval_examples, seq_len, overlong)
        if not eval_fit:
            raise DataError(f"{keys['eval_path'] if eval_path is not None else keys['held_out']}: no held-out "
                            f"example keeps a loss token within {keys['seq_len']} = {seq_len}")
        eval_rows = pack(eval_fit, seq_len, pad, packing=packing)
        eval_stats = split_stats(eval_rows, len(eval_examples), eval_report)
    stats = DataStats(shape=shape, files=tuple(map(str, files)), files_ignored=tuple(map(str, ignored)),
                      columns_unused=unused, records=len(records), dropped=dict(dropped), seq_len=seq_len,
                      packing=packing, overlong=overlong,
                      train=split_stats(train_rows, len(train_ex), train_report, train_rows.n_rows % batch_size),
                      eval=eval_stats, eval_files=tuple(map(str, eval_files)), eval_records=len(eval_records))
    return SFTData(train=train_rows, eval=eval_rows, stats=stats, batch_size=batch_size, seed=seed)
