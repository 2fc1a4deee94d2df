r"""Padding-free packing of tokenized examples into fixed-length rows, and the rows' batches.

An example is ``(ids, loss_mask)``: token ids and, per token, whether it is a loss target (predicted from the token
before it). Packing places whole examples ("segments") into rows of ``seq_len`` tokens by best-fit decreasing
(TRL's ``padding_free`` packing with its ``"bfd"`` strategy): examples in decreasing length, each into the open row
with the least room that still holds it, else into a new row. No example is ever split across rows.

Each row carries, over its ``T = seq_len`` positions:

* ``input_ids``: the segments' tokens back to back, then ``pad_id``;
* ``labels``: the token where its loss mask is set, ``-100`` elsewhere, and ``-100`` at the first token of every
  segment. The loss shifts (HF's convention, :func:`jaxgrad.lora.model.token_losses`: logits at ``t`` predict
  ``labels[t + 1]``), so the label at a segment's first token would be predicted from the last token of the
  segment before it: ignoring it keeps every loss term inside one example, as if each example ran alone (where
  the shift drops the first label anyway);
* ``positions``: ``0, 1, ...`` restarting at every segment (RoPE sees each example from position 0); 0 on padding;
* ``segment_ids``: ``1, 2, ...`` per segment in the row, ``0`` on padding (attention is block-diagonal by segment);
* ``attention_mask``: 1 on tokens, 0 on padding;
* ``n_items``: :math:`\#\{t \ge 1 : \mathrm{labels}[t] \ne -100\}`, the row's counted labels, equal to
  :func:`jaxgrad.lora.model.count_items` of that row, so the engine's sum / count over an accumulation window is
  the exact token mean.

``packing=False`` is the same layout with one example per row (right-padded).

Batches: epoch ``e`` visits the rows in the order ``numpy.random.default_rng([seed, e]).permutation(n_rows)``, cut
into ``n_rows // batch_size`` batches; the last ``n_rows % batch_size`` rows of that order sit out the epoch (a
different set each epoch). A batch is a pure function of ``(seed, epoch, index)``: re-creating an epoch and skipping
its first ``k`` batches continues exactly where a run stopped.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxgrad.lora.model import IGNORE_INDEX

ROW_FIELDS = ("input_ids", "labels", "positions", "segment_ids", "attention_mask")
OVERLONG = ("truncate", "split")


class Example(NamedTuple):
    """One tokenized example: ``ids [L]`` int32, ``loss_mask [L]`` bool, and ``source``, the index of the record
    it came from (chunks of a split record share it)."""
    ids: np.ndarray
    loss_mask: np.ndarray
    source: int


def loss_tokens(example: Example) -> int:
    """The example's counted labels: masked tokens after its first (the first is never predicted)."""
    return int(np.count_nonzero(example.loss_mask[1:]))


@dataclasses.dataclass(frozen=True)
class FitReport:
    """What :func:`fit_to_length` did: examples longer than ``seq_len`` (``overlong``), tokens they lost
    (``tokens_cut``, truncation only), chunks made by splitting (``chunks``, split only), and examples / chunks
    dropped because no counted label was left (``dropped_no_loss``)."""
    overlong: int = 0
    tokens_cut: int = 0
    chunks: int = 0
    dropped_no_loss: int = 0


def fit_to_length(examples: Sequence[Example], seq_len: int, overlong: str = "truncate"
                  ) -> tuple[list[Example], FitReport]:
    """Examples of at most ``seq_len`` tokens. Longer ones are cut to their first ``seq_len`` tokens
    (``"truncate"``, TRL's default) or cut into consecutive chunks of ``seq_len`` tokens, each its own example
    (``"split"``; a chunk's first label is not counted, as for any segment). Anything left with no counted label
    is dropped and counted."""
    if overlong not in OVERLONG:
        raise ValueError(f"fit_to_length: 'overlong' must be one of {OVERLONG}, got {overlong!r}")
    if seq_len < 2:
        raise ValueError(f"fit_to_length: 'seq_len' must be >= 2 (one label after the first token), got {seq_len}")
    out: list[Example] = []
    n_over = cut = chunks = dropped = 0
    for ex in examples:
        pieces = [ex]
        if len(ex.ids) > seq_len:
            n_over += 1
            if overlong == "truncate":
                cut += len(ex.ids) - seq_len
                pieces = [Example(ex.ids[:seq_len], ex.loss_mask[:seq_len], ex.source)]
            else:
                pieces = [Example(ex.ids[s:s + seq_len], ex.loss_mask[s:s + seq_len], ex.source)
                          for s in range(0, len(ex.ids), seq_len)]
                chunks += len(pieces)
        for piece in pieces:
            if loss_tokens(piece) > 0:
                out.append(piece)
            else:
                dropped += 1
    return out, FitReport(overlong=n_over, tokens_cut=cut, chunks=chunks, dropped_no_loss=dropped)


def pack_bfd(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: the indices of ``lengths`` grouped into rows of total length
    ``<= seq_len``. Examples go in decreasing length (ties in the given order), each into the open row with the
    least room that holds it (ties: the earliest row), else a new row. Within a row, segments keep their order of
    placement."""
    bad = [i for i, n in enumerate(lengths) if not 1 <= n <= seq_len]
    if bad:
        raise ValueError(f"pack_bfd: every length must be in [1, seq_len = {seq_len}]; index {bad[0]} has "
                         f"{lengths[bad[0]]}")
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row index) of the rows with room, sorted
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        k = bisect.bisect_left(rooms, (n, -1))
        if k < len(rooms):
            room, r = rooms.pop(k)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, r))
    return rows


@dataclasses.dataclass(frozen=True, eq=False)
class PackedRows:
    """Rows of ``seq_len`` tokens (module docstring). Held: ``input_ids`` and ``labels`` ``[n_rows, seq_len]``
    int32, ``n_items [n_rows]`` int32, and per row the ``lengths`` of its segments and their ``sources`` (the record
    index of each), in row order. ``positions``, ``segment_ids`` and ``attention_mask`` follow from the lengths:
    :meth:`rows` builds them for the rows of a batch (the properties, for all rows)."""
    input_ids: np.ndarray
    labels: np.ndarray
    n_items: np.ndarray
    lengths: tuple[tuple[int, ...], ...]
    sources: tuple[tuple[int, ...], ...]
    pad_id: int

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def layout(self, index) -> dict:
        """``positions``, ``segment_ids`` and ``attention_mask`` ``[len(index), seq_len]`` of rows ``index``."""
        index = np.asarray(index)
        out = {f: np.zeros((len(index), self.seq_len), np.int32) for f in ROW_FIELDS[2:]}
        for b, r in enumerate(index.tolist()):
            t = 0
            for s, n in enumerate(self.lengths[r], start=1):
                out["positions"][b, t:t + n] = np.arange(n)
                out["segment_ids"][b, t:t + n] = s
                t += n
            out["attention_mask"][b, :t] = 1
        return out

    @property
    def positions(self) -> np.ndarray:
        return self.layout(np.arange(self.n_rows))["positions"]

    @property
    def segment_ids(self) -> np.ndarray:
        return self.layout(np.arange(self.n_rows))["segment_ids"]

    @property
    def attention_mask(self) -> np.ndarray:
        return self.layout(np.arange(self.n_rows))["attention_mask"]

    def rows(self, index) -> dict:
        """The batch of rows ``index`` (an int array): the :data:`ROW_FIELDS` and ``n_items``."""
        return {"input_ids": self.input_ids[index], "labels": self.labels[index], **self.layout(index),
                "n_items": self.n_items[index]}

    def epoch_order(self, epoch: int, seed: int) -> np.ndarray:
        """The row order of ``epoch``: ``default_rng([seed, epoch]).permutation(n_rows)``."""
        return np.random.default_rng([seed, epoch]).permutation(self.n_rows)

    def batches_per_epoch(self, batch_size: int) -> int:
        """``n_rows // batch_size`` (the rest of each epoch's order is not used that epoch)."""
        _check_batch_size(batch_size)
        return self.n_rows // batch_size

    def batches(self, epoch: int, batch_size: int, seed: int) -> Iterator[dict]:
        """The training batches of ``epoch``: dicts of ``[batch_size, seq_len]`` arrays plus ``n_items
        [batch_size]``, rows in :meth:`epoch_order`."""
        order = self.epoch_order(epoch, seed)
        for i in range(self.batches_per_epoch(batch_size)):
            yield self.rows(order[i * batch_size:(i + 1) * batch_size])

    def eval_batches(self, batch_size: int) -> Iterator[dict]:
        """Every row once, in order, ``batch_size`` at a time; the last batch is filled up with empty rows
        (all padding, ``n_items = 0``) so every batch has one shape."""
        _check_batch_size(batch_size)
        for start in range(0, self.n_rows, batch_size):
            batch = self.rows(np.arange(start, min(start + batch_size, self.n_rows)))
            short = batch_size - len(batch["n_items"])
            if short:
                empty = empty_rows(short, self.seq_len, self.pad_id)
                batch = {k: np.concatenate([v, empty[k]]) for k, v in batch.items()}
            yield batch

    def real_tokens(self) -> int:
        return int(sum(sum(row) for row in self.lengths))

    def describe(self) -> str:
        """One line: rows, segments per row, fill, counted labels."""
        per_row = np.array([len(s) for s in self.lengths])
        fill = self.real_tokens() / max(1, self.input_ids.size)
        return (f"{self.n_rows} rows x {self.seq_len} tokens, {per_row.sum()} segments "
                f"({per_row.mean() if len(per_row) else 0:.2f} per row, max {per_row.max(initial=0)}), "
                f"fill {fill:.1%}, {int(self.n_items.sum())} loss tokens")


def _check_batch_size(batch_size) -> None:
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"PackedRows: 'batch_size' must be an int >= 1, got {batch_size!r}")


def empty_rows(n: int, seq_len: int, pad_id: int) -> dict:
    """``n`` rows of padding only: ``pad_id`` tokens, labels ``-100``, zeros elsewhere, ``n_items = 0``."""
    rows = {f: np.zeros((n, seq_len), np.int32) for f in ROW_FIELDS}
    rows["input_ids"][:] = pad_id
    rows["labels"][:] = IGNORE_INDEX
    return {**rows, "n_items": np.zeros(n, np.int32)}


def assemble_rows(examples: Sequence[Example], row_segments: Sequence[Sequence[int]], seq_len: int,
                  pad_id: int) -> PackedRows:
    """The rows whose segments are ``examples[i]`` for ``i`` in each entry of ``row_segments``."""
    n = len(row_segments)
    input_ids = np.full((n, seq_len), pad_id, np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int32)
    for r, segs in enumerate(row_segments):
        t = 0
        for i in segs:
            ids, mask = examples[i].ids, examples[i].loss_mask
            end = t + len(ids)
            if end > seq_len:
                raise ValueError(f"assemble_rows: row {r} holds {end} > seq_len = {seq_len} tokens")
            input_ids[r, t:end] = ids
            labels[r, t + 1:end] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            # labels[r, t] stays -100: a segment's first token is not predicted from the segment before it
            t = end
    n_items = np.count_nonzero(labels[:, 1:] != IGNORE_INDEX, axis=1).astype(np.int32)
    lengths = tuple(tuple(len(examples[i].ids) for i in segs) for segs in row_segments)
    sources = tuple(tuple(int(examples[i].source) for i in segs) for segs in row_segments)
    return PackedRows(input_ids=input_ids, labels=labels, n_items=n_items, lengths=lengths, sources=sources,
                      pad_id=pad_id)


def pack(examples: Sequence[Example], seq_len: int, pad_id: int, *, packing: bool = True) -> PackedRows:
    """``examples`` (each at most ``seq_len`` tokens: :func:`fit_to_length`) as rows: best-fit decreasing
    (``packing=True``) or one example per row in the given order (``packing=False``)."""
    if packing:
        segments = pack_bfd([len(ex.ids) for ex in examples], seq_len)
    else:
        segments = [[i] for i in range(len(examples))]
    return assemble_rows(examples, segments, seq_len, pad_id)
