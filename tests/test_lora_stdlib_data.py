'''Data made from Python source (jaxgrad.lora.stdlib_data): a prompt-completion record per documented function
(signature as written, decorators left out, docstring cleaned and re-indented), in sorted-file and source order,
with every left-out function and unreadable file counted; test folders and site-packages excluded; the text of the
files for pretraining; JSON lines; bad input named.'''

import ast
import inspect
import json
import pathlib
import time

import pytest

from jaxgrad.lora.stdlib_data import docstring_pairs, stdlib_files, stdlib_root, stdlib_text, write_jsonl
from jaxgrad.train.errors import DataError

A = '''\
import functools


def add(x, y):
    """Return the sum of x and y, as numbers add."""
    return x + y


def undocumented(x):
    return x


def terse():
    """Tiny."""


def quoted():
    \'\'\'Written with single quotes, so left out.\'\'\'


class Table:
    @functools.lru_cache(maxsize=None)
    def lookup(self, key: str,
               default: int | None = None) -> int:
        """Find ``key`` in the table.

            An indented example line.

        Returns ``default`` when the key is absent.
        """
        def inner(k):
            r"""A nested def with a raw \\docstring."""
            return k
        return inner(key)


async def fetch(url, *, timeout=1.0):
    """Fetch ``url`` and return its body."""
'''
B = '''\
def zeta(s):
    """The Riemann zeta function at ``s``."""
'''
EXPECTED_A = [
    {"prompt": 'def add(x, y):\n    """', "completion": 'Return the sum of x and y, as numbers add."""'},
    {"prompt": 'def lookup(self, key: str,\n           default: int | None = None) -> int:\n    """',
     "completion": 'Find ``key`` in the table.\n\n        An indented example line.\n\n    Returns ``default`` '
                   'when the key is absent.\n    """'},
    {"prompt": 'def inner(k):\n    r"""', "completion": 'A nested def with a raw \\docstring."""'},
    {"prompt": 'async def fetch(url, *, timeout=1.0):\n    """', "completion": 'Fetch ``url`` and return its body."""'},
]


@pytest.fixture
def source_tree(tmp_path):
    (tmp_path / "a.py").write_text(A)
    (tmp_path / "broken.py").write_text("def f(:\n    '''never parsed'''\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_text(B)
    for skipped in ("test", "tests", "site-packages"):
        (tmp_path / "pkg" / skipped).mkdir()
        (tmp_path / "pkg" / skipped / "c.py").write_text('def f():\n    """Must never be read at all."""\n')
    return tmp_path


def test_records_of_the_documented_functions_in_source_order(source_tree):
    pairs = docstring_pairs("a.py", root=source_tree, min_doc_chars=10)
    assert list(pairs) == EXPECTED_A
    assert pairs.counts == {"files": 1, "unparsable_files": [], "functions": 7, "no_docstring": 1,
                            "other_quotes": 1, "short": 1, "long": 0, "no_signature": 0, "kept": 4,
                            "stopped_at_max_examples": False}


def test_prompt_plus_completion_is_valid_python_and_states_the_docstring(source_tree):
    for rec in docstring_pairs("a.py", root=source_tree, min_doc_chars=10):
        assert set(rec) == {"prompt", "completion"}
        assert rec["prompt"].endswith('"""') and rec["completion"].endswith('"""')
        assert rec["prompt"].startswith(("def ", "async def "))
        fn = ast.parse(rec["prompt"] + rec["completion"]).body[0]
        assert ast.get_docstring(fn) == inspect.cleandoc(ast.get_docstring(fn, clean=False))


def test_files_are_walked_sorted_skipping_tests_site_packages_and_counting_unparsable(source_tree):
    pairs = docstring_pairs("**/*.py", root=source_tree, min_doc_chars=10)
    assert [r["prompt"].split("(")[0] for r in pairs] == ["def add", "def lookup", "def inner", "async def fetch",
                                                          "def zeta"]
    assert pairs.counts["files"] == 3
    assert pairs.counts["unparsable_files"] == [str(source_tree / "broken.py")]
    assert list(docstring_pairs("**/*.py", root=source_tree, min_doc_chars=10)) == list(pairs)  # deterministic


def test_limits_leave_records_out_whole_and_count_them(source_tree):
    long_cut = docstring_pairs("a.py", root=source_tree, min_doc_chars=10, max_chars=90)
    assert all(len(r["prompt"]) + len(r["completion"]) <= 90 for r in long_cut)
    assert long_cut.counts["long"] == 1 and len(long_cut) == 3
    short_cut = docstring_pairs("a.py", root=source_tree, min_doc_chars=40)
    assert short_cut.counts["short"] == 3 and [r["prompt"][:10] for r in short_cut] == ["def add(x,", "def lookup"]
    first = docstring_pairs("**/*.py", root=source_tree, min_doc_chars=10, max_examples=2)
    assert list(first) == EXPECTED_A[:2] and first.counts["stopped_at_max_examples"] is True


def test_jsonl_round_trip(source_tree, tmp_path):
    pairs = docstring_pairs("a.py", root=source_tree, min_doc_chars=10)
    path = write_jsonl(pairs, tmp_path / "out" / "pairs.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == EXPECTED_A
    with pytest.raises(TypeError, match=r"records\[1\]"):
        write_jsonl([{"prompt": "p", "completion": "c"}, "text"], tmp_path / "bad.jsonl")


def test_text_is_the_files_concatenated_in_sorted_order(source_tree):
    assert stdlib_text("*.py", root=source_tree) == A + "def f(:\n    '''never parsed'''\n"
    assert stdlib_text("**/b.py", 12, root=source_tree) == B[:12]
    with pytest.raises(DataError, match="'n_chars' = 100000 but"):
        stdlib_text("pkg/*.py", 100000, root=source_tree)
    with pytest.raises(ValueError, match="n_chars"):
        stdlib_text("*.py", 0, root=source_tree)


def test_patterns_relative_to_the_root_or_absolute(source_tree):
    assert stdlib_files("**/c.py", root=source_tree) == [source_tree / "pkg" / "test" / "c.py",
                                                         source_tree / "pkg" / "tests" / "c.py"]
    assert stdlib_files(str(source_tree / "pkg" / "*.py")) == [source_tree / "pkg" / "b.py"]
    with pytest.raises(DataError, match="'pattern' pattern '\\*\\*/c.py' matches no file.*test folders excluded"):
        stdlib_files("**/c.py", root=source_tree, exclude_tests=True)
    with pytest.raises(DataError, match="'files' .* matches no file"):
        stdlib_files(str(source_tree / "nothing*.py"), where="LoRA fit", name="files")


@pytest.mark.parametrize(("kwargs", "names"), [({"max_examples": 0}, "max_examples"), ({"min_doc_chars": 0},
                                                                                       "min_doc_chars"),
                                               ({"max_chars": "2000"}, "max_chars")])
def test_bad_limits_are_named(source_tree, kwargs, names):
    with pytest.raises(ValueError, match=names):
        docstring_pairs("a.py", root=source_tree, **kwargs)


def test_the_real_standard_library_gives_hundreds_of_pairs_quickly():
    t0 = time.perf_counter()
    pairs = docstring_pairs("email/**/*.py")
    assert time.perf_counter() - t0 < 10
    assert len(pairs) >= 200 and pairs.counts["unparsable_files"] == []
    assert pathlib.Path(stdlib_root(), "email").is_dir()
    assert any(r["prompt"].startswith("def message_from_string(") for r in pairs)
    assert len(stdlib_text("*.py", 50_000)) == 50_000
