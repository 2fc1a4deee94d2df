"""`python -m jaxgrad.lora.stdlib_data`: the example's data written as JSONL from the standard library's source.

* ``docstrings``: prompt-completion records (signature -> docstring), a held-out file drawn by example: the two
  files split the records, nothing lost or shared, the counts printed;
* ``text``: one ``{"text"}`` record per source file, tests excluded.
"""

import json

import pytest

from jaxgrad.lora.stdlib_data import docstring_pairs, main, split_by_example, stdlib_files


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_docstrings_are_written_with_a_held_out_file_by_example(tmp_path, capsys):
    train, held = tmp_path / "d.jsonl", tmp_path / "e.jsonl"
    assert main(["docstrings", str(train), "--pattern", "json/*.py", "--held-out", "0.25", "--eval-out",
                 str(held)]) == 0
    printed = capsys.readouterr().out
    pairs = docstring_pairs("json/*.py")
    a, b = _jsonl(train), _jsonl(held)
    assert len(b) == round(0.25 * len(pairs)) and len(a) + len(b) == len(pairs)
    assert sorted(map(json.dumps, a + b)) == sorted(map(json.dumps, pairs))  # a split: nothing lost or repeated
    assert f"{pairs.counts['kept']} kept" in printed and f"{len(b)} held-out records" in printed
    assert all(r["prompt"].startswith(("def ", "async def ")) and r["completion"].endswith('"""') for r in a)


def test_the_held_out_draw_is_seeded():
    records = [{"i": i} for i in range(20)]
    assert split_by_example(records, 0.2, 1) == split_by_example(records, 0.2, 1)
    assert split_by_example(records, 0.2, 1)[1] != split_by_example(records, 0.2, 2)[1]
    with pytest.raises(ValueError, match="'held_out'"):
        split_by_example(records, 1.5)


def test_text_writes_one_record_per_source_file(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["text", str(out), "--pattern", "json/*.py"]) == 0
    records = _jsonl(out)
    files = stdlib_files("json/*.py", exclude_tests=True)
    assert len(records) == len(files) and records[0]["text"] == files[0].read_text()
    assert f"{len(files)} files" in capsys.readouterr().out


def test_bad_arguments_are_named(tmp_path, capsys):
    assert main(["docstrings", str(tmp_path / "x.jsonl"), "--pattern", "no_such_package/*.py"]) == 2
    assert "matches no file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["docstrings", str(tmp_path / "x.jsonl"), "--held-out", "0.1"])
    assert "--eval-out" in capsys.readouterr().err
