"""Fine-tuning data (`jaxgrad.lora.data`, `jaxgrad.lora.packing`): files -> records -> (ids, loss mask) -> rows.

* every file format (JSONL, JSON, CSV, Parquet, TXT) is read through `datasets`, from an absolute path, a relative
  one, `~`, a folder or a glob; a folder of several formats, an unknown extension, a missing path are refused by key;
* the record shapes are found from the columns (`text`, `prompt` + `completion`, `messages`, ShareGPT's
  `conversations`), or forced; columns of no shape are refused naming the columns found and the shapes expected;
* the loss mask covers exactly the completion (completion-only) or the assistant turns (assistant-only);
* packing: best-fit decreasing, every example once per epoch, no segment across rows, positions restart, the label
  at every segment start ignored, `n_items` = `count_items` of the row = the segments' counts alone;
* batches are a function of (seed, epoch, index): resume skips batches and continues on the same rows;
* the held-out split is by example and disjoint; dropped and truncated examples are counted.
"""

import json
import os
import pathlib

import numpy as np
import pytest

from jaxgrad.lora.data import build_sft_data, detect_shape, find_data_files, read_records, tokenize_record
from jaxgrad.lora.model import IGNORE_INDEX, count_items
from jaxgrad.lora.packing import Example, fit_to_length, pack, pack_bfd
from jaxgrad.lora.tokenizer import train_bpe_tokenizer
from jaxgrad.train.errors import ConfigError, DataError

WORDS = "the a fox dog jumps over lazy quick brown red cat sat on mat why how what is are answer question".split()


def sentence(rng, lo=3, hi=12):
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))


@pytest.fixture(scope="module")
def tok():
    rng = np.random.default_rng(0)
    return train_bpe_tokenizer([sentence(rng) for _ in range(300)], 400)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text_records(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"text": sentence(rng)} for _ in range(n)]


def chat(rng, turns=2, system=True):
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
    return msgs


def masked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


# ------------------------------------------------------------------------------------------------------------ files


def _write(fmt, path, records):
    if fmt == "jsonl":
        write_jsonl(path, records)
    elif fmt == "json":
        path.write_text(json.dumps(records))
    elif fmt == "csv":
        cols = list(records[0])
        path.write_text(",".join(cols) + "\n" + "".join(",".join(f'"{r[c]}"' for c in cols) + "\n"
                                                        for r in records))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif fmt == "txt":
        path.write_text("".join(r["text"] + "\n" for r in records))


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "txt"])
def test_every_file_format_is_read_record_for_record(tmp_path, fmt):
    records = [{"text": f"line {i}, said the fox"} for i in range(5)] if fmt == "txt" else \
        [{"prompt": f"question {i}?", "completion": f"answer {i}"} for i in range(5)]
    path = tmp_path / f"data.{fmt}"
    _write(fmt, path, records)
    assert read_records(path) == records


def test_chat_records_keep_their_messages_in_jsonl_and_parquet(tmp_path):
    rng = np.random.default_rng(1)
    records = [{"messages": chat(rng)} for _ in range(3)]
    _write("jsonl", tmp_path / "a.jsonl", records)
    _write("parquet", tmp_path / "a.parquet", records)
    assert read_records(tmp_path / "a.jsonl") == records == read_records(tmp_path / "a.parquet")


def test_absolute_relative_and_home_paths_name_the_same_file(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", text_records(4))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    absolute = read_records(str(tmp_path / "d.jsonl"))
    assert read_records("d.jsonl") == absolute
    assert read_records("~/d.jsonl") == absolute
    assert read_records(pathlib.Path("~") / "d.jsonl") == absolute


def test_a_folder_is_read_in_sorted_order_and_other_files_are_listed_as_skipped(tmp_path, tok):
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "b.jsonl", text_records(3, seed=2))
    write_jsonl(tmp_path / "sub" / "a.jsonl", text_records(2, seed=1))
    (tmp_path / "README.md").write_text("about this data")
    (tmp_path / ".hidden.jsonl").write_text("not json")
    files, fmt, ignored = find_data_files(tmp_path)
    assert files == [tmp_path / "b.jsonl", tmp_path / "sub" / "a.jsonl"] and fmt == "json"
    assert ignored == [tmp_path / "README.md"]
    assert read_records(tmp_path) == text_records(3, seed=2) + text_records(2, seed=1)
    assert read_records(str(tmp_path / "*.jsonl")) == text_records(3, seed=2)  # a glob
    data = build_sft_data(tmp_path, tok, seq_len=64, batch_size=1)
    assert data.stats.files_ignored == (str(tmp_path / "README.md"),) and data.stats.records == 5
    assert "1 other files skipped" in data.describe()


def test_bad_paths_are_refused_naming_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.path = .*nowhere.*no such file"):
        read_records(tmp_path / "nowhere.jsonl")
    write_jsonl(tmp_path / "a.jsonl", text_records(2))
    (tmp_path / "b.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"data\.path = .*several formats.*csv.*json"):
        read_records(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("# notes")
    with pytest.raises(DataError, match=r"data\.path = .*no file with a supported extension.*found \.md"):
        read_records(other)
    (other / "x.yaml").write_text("a: 1")
    with pytest.raises(DataError, match=r"data\.path = .*x\.yaml.*no file with a supported extension"):
        read_records(other / "x.yaml")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"data\.path: cannot read .*broken\.jsonl as json"):
        read_records(tmp_path / "broken.jsonl")


# ------------------------------------------------------------------------------------------------------------ shapes


def test_shapes_are_found_from_the_columns_or_forced():
    assert detect_shape(["text"]) == "text"
    assert detect_shape(["prompt", "completion", "id"]) == "prompt_completion"
    assert detect_shape(["messages", "text"]) == "messages"
    assert detect_shape(["conversations"]) == "messages"
    assert detect_shape(["text", "prompt", "completion"], "text") == "text"
    with pytest.raises(DataError, match=r"data\.path: the records' columns \['body', 'title'\] match no record "
                                         r"shape; expected 'text', 'prompt' \+ 'completion', or 'messages'"):
        detect_shape(["title", "body"])
    with pytest.raises(DataError, match="prompt-only"):
        detect_shape(["prompt"])
    with pytest.raises(DataError, match=r"data\.format = 'messages' needs the column\(s\) \['messages'\]; the "
                                         r"records have \['text'\]"):
        detect_shape(["text"], "messages")
    with pytest.raises(ConfigError, match=r"data\.format: must be one of \('text', 'prompt_completion', "
                                          r"'messages'\), got 'chat'"):
        detect_shape(["messages"], "chat")


def test_text_is_bos_text_eos_with_loss_on_every_token(tok):
    ids, mask = tokenize_record({"text": "the quick fox"}, "text", tok)
    assert ids.tolist() == tok.encode("the quick fox") + [tok.eos_token_id]
    assert ids[0] == tok.bos_token_id and mask.all()


def test_completion_only_masks_exactly_the_completion_and_its_eos(tok):
    rec = {"prompt": "why is the fox red?", "completion": " the fox sat on a mat"}
    ids, mask = tokenize_record(rec, "prompt_completion", tok)
    n_prompt = len(tok.encode(rec["prompt"]))
    assert ids.tolist() == (tok.encode(rec["prompt"]) + tok.encode(rec["completion"], add_special_tokens=False)
                            + [tok.eos_token_id])
    assert not mask[:n_prompt].any() and mask[n_prompt:].all()
    assert masked_text(tok, ids, mask) == rec["completion"] + tok.eos_token
    ids_all, mask_all = tokenize_record(rec, "prompt_completion", tok, completion_only=False)
    assert ids_all.tolist() == ids.tolist() and mask_all.all()


def mask_runs(tok, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return [tok.decode(ids[s:e].tolist()) for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def test_assistant_only_masks_exactly_the_assistant_turns(tok):
    msgs = chat(np.random.default_rng(3), turns=3)
    ids, mask = tokenize_record({"messages": msgs}, "messages", tok)
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(msgs)
    assert mask_runs(tok, ids, mask) == [m["content"] + "<|eot_id|>" for m in msgs if m["role"] == "assistant"]
    _, every = tokenize_record({"messages": msgs}, "messages", tok, assistant_only=False)
    assert every.all()


def test_conversational_prompt_completion_masks_the_completion_messages(tok):
    rng = np.random.default_rng(4)
    prompt = [{"role": "user", "content": sentence(rng)}]
    completion = [{"role": "assistant", "content": sentence(rng)}]
    ids, mask = tokenize_record({"prompt": prompt, "completion": completion}, "prompt_completion", tok)
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(prompt + completion)
    assert mask_runs(tok, ids, mask) == [completion[0]["content"] + "<|eot_id|>"] and mask[-1]


def test_sharegpt_conversations_read_as_messages(tok):
    msgs = chat(np.random.default_rng(5), system=False)
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in msgs]
    a = tokenize_record({"messages": msgs}, "messages", tok)
    b = tokenize_record({"conversations": sharegpt}, "messages", tok)
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    with pytest.raises(DataError, match=r"record: 'conversations'\[0\]: ShareGPT role 'bot'"):
        tokenize_record({"conversations": [{"from": "bot", "value": "x"}]}, "messages", tok)


def test_bad_records_are_refused_naming_the_record(tok):
    with pytest.raises(DataError, match=r"record 7: 'prompt' and 'completion' must both be strings or both lists"):
        tokenize_record({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
                        "prompt_completion", tok, where="record 7")
    with pytest.raises(DataError, match=r"'messages'\[0\]: a message needs a string 'role' and a string 'content'"):
        tokenize_record({"messages": [{"role": "user", "content": 3}]}, "messages", tok)


# ------------------------------------------------------------------------------------------------------------ packing


def _examples(lengths, seed=0, random_masks=False):
    """Examples of random ids; loss on every token, or on a random subset (the first token included half the time)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = rng.random(n) < 0.6 if random_masks else np.ones(n, bool)
        out.append(Example(rng.integers(1, 100, n).astype(np.int32), mask, i))
    return out


def test_best_fit_decreasing_puts_each_example_into_the_fullest_row_that_holds_it():
    assert pack_bfd([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 400).tolist()
    rows = pack_bfd(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(400))
    fills = [sum(lengths[i] for i in r) for r in rows]
    assert max(fills) <= 64
    assert sum(f <= 32 for f in fills) <= 1  # any-fit packing leaves at most one row half empty or less
    with pytest.raises(ValueError, match=r"pack_bfd: every length must be in \[1, seq_len = 8\]; index 1 has 9"):
        pack_bfd([3, 9], 8)


def test_packed_rows_keep_each_segment_as_if_alone():
    examples = _examples([7, 3, 5, 2, 6, 4, 2, 9, 3, 5], seed=3, random_masks=True)
    rows = pack(examples, 10, pad_id=0)
    assert sorted(i for segs in rows.sources for i in segs) == list(range(len(examples)))
    alone = 0
    for r, segs in enumerate(rows.sources):  # _examples: source = position
        t = 0
        for s, i in enumerate(segs, start=1):
            ex = examples[i]
            n = len(ex.ids)
            np.testing.assert_array_equal(rows.input_ids[r, t:t + n], ex.ids)
            np.testing.assert_array_equal(rows.positions[r, t:t + n], np.arange(n))
            assert (rows.segment_ids[r, t:t + n] == s).all() and rows.attention_mask[r, t:t + n].all()
            assert rows.labels[r, t] == IGNORE_INDEX  # no loss from the previous segment's last token
            want = np.where(ex.loss_mask, ex.ids, IGNORE_INDEX)[1:]
            np.testing.assert_array_equal(rows.labels[r, t + 1:t + n], want)
            alone += count_items(np.where(ex.loss_mask, ex.ids, IGNORE_INDEX)[None])
            t += n
        assert (rows.segment_ids[r, t:] == 0).all() and not rows.attention_mask[r, t:].any()
        assert (rows.labels[r, t:] == IGNORE_INDEX).all() and (rows.input_ids[r, t:] == 0).all()
        assert rows.n_items[r] == count_items(rows.labels[r:r + 1])
    assert rows.n_items.sum() == alone


def test_the_packed_loss_is_the_sum_of_each_segment_alone_under_the_models_shift():
    """``token_losses`` (logits at t predict labels[t + 1]) over a packed row, against each example alone with the
    same logits: the same loss terms, none across a boundary."""
    from jaxgrad.lora.model import token_losses

    examples = _examples([6, 3, 5, 4], seed=5, random_masks=True)
    rows = pack(examples, 9, pad_id=0)
    logits = np.random.default_rng(1).normal(size=(rows.n_rows, 9, 100))
    packed = np.asarray(token_losses(logits, rows.labels)[0]).sum(axis=1)
    for r, segs in enumerate(rows.sources):
        t, alone = 0, 0.0
        for i in segs:
            ex = examples[i]
            n = len(ex.ids)
            labels = np.where(ex.loss_mask, ex.ids, IGNORE_INDEX)[None]
            alone += float(np.asarray(token_losses(logits[r:r + 1, t:t + n], labels)[0]).sum())
            t += n
        np.testing.assert_allclose(packed[r], alone, rtol=1e-6)


def test_without_packing_each_example_has_its_own_right_padded_row():
    examples = _examples([4, 2, 3])
    rows = pack(examples, 5, pad_id=9, packing=False)
    assert rows.sources == ((0,), (1,), (2,))
    assert rows.input_ids[1].tolist() == examples[1].ids.tolist() + [9, 9, 9]
    assert rows.attention_mask.sum(1).tolist() == [4, 2, 3]
    assert rows.n_items.tolist() == [3, 1, 2]


def test_overlong_examples_are_truncated_or_split_and_counted():
    ex = _examples([10, 3])
    fitted, report = fit_to_length(ex, 4)
    assert [len(e.ids) for e in fitted] == [4, 3] and (report.overlong, report.tokens_cut) == (1, 6)
    chunks, report = fit_to_length(ex, 4, "split")
    assert [len(e.ids) for e in chunks] == [4, 4, 2, 3] and report.chunks == 3
    np.testing.assert_array_equal(np.concatenate([c.ids for c in chunks[:3]]), ex[0].ids)
    late = Example(np.arange(1, 9, dtype=np.int32), np.arange(8) >= 6, 0)  # loss only after position 6
    kept, report = fit_to_length([late], 5)
    assert kept == [] and report.dropped_no_loss == 1


# ------------------------------------------------------------------------------------------------------------ batches


@pytest.fixture(scope="module")
def chat_data(tok, tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    write_jsonl(path, [{"messages": chat(rng, turns=int(rng.integers(1, 3))), "id": i} for i in range(60)])
    return path, build_sft_data(path, tok, seq_len=256, batch_size=3, held_out=0.2, seed=11)


def test_every_training_example_is_in_one_row_of_each_epoch(chat_data):
    _, data = chat_data
    rows, bs = data.train, data.batch_size
    assert data.batches_per_epoch == rows.n_rows // bs >= 2
    assert data.stats.train.unused_rows_per_epoch == rows.n_rows % bs
    train_sources = sorted(i for row in rows.sources for i in row)
    held_sources = sorted(i for row in data.eval.sources for i in row)
    assert sorted(train_sources + held_sources) == list(range(data.stats.records))  # each example in one row
    for epoch in (0, 1):
        order = rows.epoch_order(epoch, data.seed)
        assert sorted(order) == list(range(rows.n_rows))
        seen = [b["input_ids"] for b in data.batches(epoch)]
        assert len(seen) == data.batches_per_epoch
        np.testing.assert_array_equal(np.concatenate(seen), rows.input_ids[order[:len(seen) * bs]])
    assert not np.array_equal(rows.epoch_order(0, data.seed), rows.epoch_order(1, data.seed))


def test_batches_carry_every_row_field_and_n_items_as_count_items(chat_data):
    _, data = chat_data
    total = 0
    for batch in data.batches(0):
        assert set(batch) == {"input_ids", "labels", "positions", "segment_ids", "attention_mask", "n_items"}
        assert all(v.shape == (3, 256) for k, v in batch.items() if k != "n_items") and batch["n_items"].shape == (3,)
        assert all(v.dtype == np.int32 for v in batch.values())
        assert batch["n_items"].sum() == count_items(batch["labels"])
        total += int(batch["n_items"].sum())
    used = data.train.epoch_order(0, data.seed)[:data.batches_per_epoch * 3]
    assert total == data.train.n_items[used].sum()
    assert data.stats.train.loss_tokens == data.train.n_items.sum() == count_items(data.train.labels)


def test_batches_are_a_function_of_the_epoch_and_a_resumed_epoch_continues_on_the_same_rows(chat_data):
    _, data = chat_data
    first = list(data.batches(1))
    again = list(data.batches(1))
    for a, b in zip(first, again, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    k = 1
    resumed = data.batches(1)
    for _ in range(k):
        next(resumed)
    for a, b in zip(first[k:], resumed, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])


def test_the_held_out_split_is_by_example_and_disjoint(chat_data, tok):
    path, data = chat_data
    n = data.stats.records
    assert data.stats.eval.examples == round(0.2 * n) and data.stats.train.examples == n - round(0.2 * n)
    train = {i for row in data.train.sources for i in row}
    held = {i for row in data.eval.sources for i in row}
    assert not train & held and len(train) + len(held) == n
    held_ids = read_records(path)  # the rows hold the held-out records' own tokens
    some = data.eval.sources[0][0]
    ids, _ = tokenize_record(held_ids[some], "messages", tok)
    np.testing.assert_array_equal(data.eval.input_ids[0][data.eval.segment_ids[0] == 1], ids)
    batches = list(data.eval_batches())
    assert sum(int(b["n_items"].sum()) for b in batches) == data.eval.n_items.sum()
    assert all(b["input_ids"].shape == (3, 256) for b in batches)
    assert "held out:" in data.describe() and "columns not used ['id']" in data.describe()
    other = build_sft_data(path, tok, seq_len=256, batch_size=3, held_out=0.2, seed=12)
    assert not np.array_equal(other.eval.input_ids, data.eval.input_ids)  # the seed draws the held-out examples


def test_a_separate_held_out_path(tmp_path, tok):
    write_jsonl(tmp_path / "train.jsonl", text_records(20, seed=1))
    write_jsonl(tmp_path / "eval.jsonl", text_records(5, seed=2))
    data = build_sft_data(tmp_path / "train.jsonl", tok, seq_len=32, batch_size=2,
                          eval_path=tmp_path / "eval.jsonl")
    assert data.stats.train.examples == 20 and data.stats.eval.examples == 5 and data.stats.eval_records == 5
    tiny = build_sft_data(tmp_path / "eval.jsonl", tok, seq_len=32, batch_size=1, held_out=0.95)
    assert (tiny.stats.train.examples, tiny.stats.eval.examples) == (1, 4)  # at least one example trains
    with pytest.raises(ConfigError, match=r"data\.held_out = 0\.1 and data\.eval_path = .*not both"):
        build_sft_data(tmp_path / "train.jsonl", tok, seq_len=32, batch_size=2, held_out=0.1,
                       eval_path=tmp_path / "eval.jsonl")
    with pytest.raises(DataError, match=r"data\.eval_path = .*missing.*no such file"):
        build_sft_data(tmp_path / "train.jsonl", tok, seq_len=32, batch_size=2, eval_path=tmp_path / "missing")


def test_dropped_and_truncated_examples_are_counted(tmp_path, tok):
    long_prompt = " ".join(["fox"] * 80)
    records = ([{"prompt": "why?", "completion": " the dog"}] * 6 + [{"prompt": "", "completion": " x"}]
               + [{"prompt": long_prompt, "completion": " the cat"}])
    write_jsonl(tmp_path / "pc.jsonl", records)
    data = build_sft_data(tmp_path / "pc.jsonl", tok, seq_len=24, batch_size=1)
    assert data.stats.dropped == {"empty field": 1}
    assert data.stats.train.overlong == 1 and data.stats.train.dropped_no_loss == 1  # its completion was cut off
    assert data.stats.train.segments == 6
    line = data.describe()
    assert "dropped 1 (empty field)" in line and "1 longer than seq_len truncated" in line
    assert "1 dropped with no loss token left" in line
    no_assistant = [{"messages": [{"role": "user", "content": "hi"}]}] + [{"messages": chat(np.random.default_rng(0))}]
    write_jsonl(tmp_path / "m.jsonl", no_assistant)
    assert build_sft_data(tmp_path / "m.jsonl", tok, seq_len=256, batch_size=1).stats.dropped == {"no loss token": 1}


def test_packing_fills_rows_and_padding_does_not(tmp_path, tok):
    write_jsonl(tmp_path / "t.jsonl", text_records(40))
    packed = build_sft_data(tmp_path / "t.jsonl", tok, seq_len=64, batch_size=2, packing=True)
    padded = build_sft_data(tmp_path / "t.jsonl", tok, seq_len=64, batch_size=2, packing=False)
    assert padded.train.n_rows == 40 and packed.train.n_rows < 40
    assert packed.stats.train.fill > 2 * padded.stats.train.fill
    assert packed.stats.train.loss_tokens == padded.stats.train.loss_tokens  # the same labels, differently placed
    assert packed.stats.train.tokens == padded.stats.train.tokens


def test_bad_settings_are_refused_naming_the_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", text_records(4))
    for kwargs, err, pattern in [
        (dict(seq_len=1, batch_size=1), ConfigError, r"model\.seq_len: must be an integer >= 2, got 1"),
        (dict(seq_len=32, batch_size=0), ConfigError, r"data\.batch_size: must be an integer >= 1, got 0"),
        (dict(seq_len=32, batch_size=1, held_out=1.0), ConfigError, r"data\.held_out: must be a fraction in"),
        (dict(seq_len=32, batch_size=1, overlong="wrap"), ConfigError, r"data\.overlong: must be one of"),
        (dict(seq_len=32, batch_size=1, sample_by="word"), ConfigError, r"data\.sample_by: must be one of"),
        (dict(seq_len=256, batch_size=8), DataError, r"data\.path: the training examples fill 1 rows of 256 "
                                                     r"tokens, fewer than data\.batch_size = 8"),
    ]:
        with pytest.raises(err, match=pattern):
            build_sft_data(path, tok, **kwargs)
    write_jsonl(tmp_path / "odd.jsonl", [{"title": "a", "body": "b"}])
    with pytest.raises(DataError, match=r"data\.path: the records' columns \['body', 'title'\] match no record"):
        build_sft_data(tmp_path / "odd.jsonl", tok, seq_len=32, batch_size=1)


def test_reading_writes_nothing_under_home(tmp_path):
    """``datasets`` caches under ``~/.cache/huggingface`` by default; reading keeps its cache in a temporary folder."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    write_jsonl(tmp_path / "t.jsonl", text_records(3))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_CACHE"))} | {"HOME": str(home)}
    code = f"from jaxgrad.lora.data import read_records; assert len(read_records({str(tmp_path / 't.jsonl')!r})) == 3"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path)
    assert list(home.rglob("*")) == []


def test_a_text_file_is_read_by_line_paragraph_or_document(tmp_path):
    (tmp_path / "t.txt").write_text("one fox\ntwo dogs\n\nthree cats\n")
    assert [r["text"] for r in read_records(tmp_path / "t.txt")] == ["one fox", "two dogs", "", "three cats"]
    assert [r["text"] for r in read_records(tmp_path / "t.txt", sample_by="paragraph")] == \
        ["one fox\ntwo dogs", "three cats\n"]
    assert [r["text"] for r in read_records(tmp_path / "t.txt", sample_by="document")] == \
        ["one fox\ntwo dogs\n\nthree cats\n"]


def test_the_held_out_batches_hold_every_row_once_and_empty_rows_fill_the_last(tmp_path, tok):
    write_jsonl(tmp_path / "t.jsonl", text_records(7))
    data = build_sft_data(tmp_path / "t.jsonl", tok, seq_len=32, batch_size=3, packing=False,
                          eval_path=tmp_path / "t.jsonl")
    batches = list(data.eval_batches())
    assert len(batches) == 3 and all(b["input_ids"].shape == (3, 32) for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["labels"] for b in batches])[:7], data.eval.labels)
    last = batches[-1]
    assert last["n_items"][1:].tolist() == [0, 0] and not last["attention_mask"][1:].any()
    assert (last["labels"][1:] == IGNORE_INDEX).all() and (last["input_ids"][1:] == tok.pad_token_id).all()
    stats = json.loads(json.dumps(data.stats.as_dict()))
    assert stats["eval"]["rows"] == 7 and stats["train"]["loss_tokens"] == int(data.train.n_items.sum())
    assert 0 < stats["train"]["fill"] < 1 and stats["shape"] == "text"
