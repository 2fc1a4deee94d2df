r'''Training data made on the machine from the Python standard library's own source: no download.

* :func:`stdlib_files`: the files a glob matches, sorted (relative globs under
  ``sysconfig.get_paths()["stdlib"]``; ``site-packages`` never, test folders optionally excluded).
* :func:`stdlib_text`: their text concatenated, for pretraining a tokenizer or a small model.
* :func:`docstring_pairs`: for every function and method with a docstring, a prompt-completion record (TRL's
  ``{"prompt", "completion"}`` shape) that asks for the docstring given the signature; :func:`write_jsonl` writes
  them as JSON lines.

Everything is deterministic: files in sorted order, functions in source order, no shuffling and no split (a
consumer splits and shuffles with its own seed). Nothing is dropped silently: :func:`docstring_pairs` counts every
function it skips and why, and every file it cannot read (``.counts`` of its result).

A record, for ``def loads(s, *, cls=None):`` with a docstring (the ``def`` dedented to column 0, decorators
omitted, the signature as written, over several lines if it is; the docstring cleaned as ``inspect.cleandoc``
does, its continuation lines indented by 4 spaces, a multi-line one closed on a line of its own as PEP 257 lays
it out)::

    {"prompt": 'def loads(s, *, cls=None):\n    """',
     "completion": 'Deserialize ``s`` to a Python object.\n\n    More text.\n    """'}

Only docstrings written as ``"""..."""`` (or ``r"""..."""``, whose prompt then ends in ``r"""``) are kept, so
that prompt + completion is the source as a reader would write it.
'''

from __future__ import annotations

import ast
import glob
import inspect
import io
import json
import os
import pathlib
import re
import sys
import sysconfig
import tokenize
import warnings

from jaxgrad.train.errors import DataError

__all__ = ["TEST_DIRS", "DocstringPairs", "docstring_pairs", "file_records", "main", "split_by_example",
           "stdlib_files", "stdlib_root", "stdlib_text", "write_jsonl"]

#: folders of tests inside the standard library (``test``, ``tests``, ``idle_test``): left out where asked
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
INDENT = "    "


def stdlib_root() -> pathlib.Path:
    """The standard library of the running Python: ``sysconfig.get_paths()["stdlib"]``."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(pattern: str, *, root: str | os.PathLike | None = None, exclude_tests: bool = False,
                 where: str = "stdlib_files", name: str = "pattern") -> list[pathlib.Path]:
    """The files matching ``pattern``, sorted.

    ``pattern``: a glob relative to ``root`` (default :func:`stdlib_root`; ``site-packages`` below it never
    matches, nor, with ``exclude_tests``, any folder of :data:`TEST_DIRS`), or an absolute path or glob (``~``
    expanded; taken as it is). ``**`` matches folders recursively. No match: a
    :class:`~jaxgrad.train.errors.DataError` ``"{where}: '{name}' ... matches no file"`` (a training task passes
    its own ``where`` and key ``name``)."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise DataError(f"{where}: '{name}' must be a glob pattern or a path, got {pattern!r}")
    expanded = os.path.expanduser(pattern)
    if os.path.isabs(expanded):
        files = sorted(pathlib.Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"{where}: '{name}' {pattern!r} matches no file")
        return files
    base = stdlib_root() if root is None else pathlib.Path(root)
    skip = {"site-packages"} | (TEST_DIRS if exclude_tests else set())
    files = sorted(p for p in base.glob(pattern)
                   if p.is_file() and not skip.intersection(p.relative_to(base).parts[:-1]))
    if not files:
        raise DataError(f"{where}: '{name}' pattern {pattern!r} matches no file under {base} (a relative pattern "
                        f"is a glob in {'the standard library' if root is None else 'that folder'}"
                        f"{', test folders excluded' if exclude_tests else ''}; give an absolute path for other "
                        f"files)")
    return files


def _read_source(path: pathlib.Path) -> str:
    """The file's text, decoded as Python decodes source (PEP 263 coding line, else UTF-8)."""
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    return raw.decode(encoding)


def stdlib_text(pattern: str = "*.py", n_chars: int | None = None, *, root: str | os.PathLike | None = None) -> str:
    """The first ``n_chars`` characters (``None``: all) of the matching files' text (:func:`stdlib_files`, test
    folders excluded), concatenated in sorted order as they are (each file ends with its own newline).

    A file that cannot be decoded is left out with a ``UserWarning`` naming it; fewer than ``n_chars``
    characters in all is a :class:`~jaxgrad.train.errors.DataError` naming ``n_chars``."""
    if n_chars is not None and (not isinstance(n_chars, int) or isinstance(n_chars, bool) or n_chars < 1):
        raise ValueError(f"stdlib_text: 'n_chars' must be None or an int >= 1, got {n_chars!r}")
    chunks, have, unreadable = [], 0, []
    for path in stdlib_files(pattern, root=root, exclude_tests=True, where="stdlib_text"):
        try:
            chunks.append(_read_source(path))
        except (UnicodeDecodeError, SyntaxError, LookupError):  # SyntaxError: a malformed coding line
            unreadable.append(str(path))
            continue
        have += len(chunks[-1])
        if n_chars is not None and have >= n_chars:
            break
    if unreadable:
        warnings.warn(f"stdlib_text: {len(unreadable)} file(s) matching {pattern!r} could not be decoded and "
                      f"were left out: {', '.join(unreadable[:5])}{' ...' if len(unreadable) > 5 else ''}",
                      stacklevel=2)
    if n_chars is not None and have < n_chars:
        raise DataError(f"stdlib_text: 'n_chars' = {n_chars} but the files {pattern!r} hold only {have} characters")
    return "".join(chunks)[:n_chars]


# ------------------------------------------------------------------------------------------------ docstring pairs


class DocstringPairs(list):
    """The records (a plain list of dicts) with ``counts``: ``files`` read, ``unparsable_files`` (their paths:
    not decodable or not valid Python for this interpreter), ``functions`` seen, and how many were left out
    because they have ``no_docstring``, a docstring not written as ``\"\"\"`` (``other_quotes``), ``short`` (fewer
    than ``min_doc_chars``), ``long`` (prompt + completion over ``max_chars``) or an unreadable signature
    (``no_signature``); ``kept``; ``stopped_at_max_examples`` (True: files after the last record were not read)."""

    counts: dict


def _functions(tree: ast.AST):
    """Function and method definitions (nested ones included), in source order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _char_col(line: str, byte_col: int) -> int:
    """``ast`` columns count UTF-8 bytes; ``str`` indices count characters."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _signature(lines: list[str], node) -> str | None:
    """The ``def`` (or ``async def``) through the ``:`` that ends its signature, as written, dedented to column 0;
    ``None`` if tokenizing it fails."""
    first = node.lineno - 1
    col = _char_col(lines[first], node.col_offset)
    fragment = io.StringIO("".join(lines[first:node.body[0].end_lineno])).readline
    depth = 0
    try:
        for tok in tokenize.generate_tokens(fragment):
            if tok.start < (1, col) or tok.type != tokenize.OP:
                continue
            if tok.string in "([{":
                depth += 1
            elif tok.string in ")]}":
                depth -= 1
            elif tok.string == ":" and depth == 0:
                end_row, end_col = tok.end
                break
        else:
            return None
    except (tokenize.TokenError, SyntaxError):
        return None
    sig = [lines[first + i].rstrip("\r\n") for i in range(end_row)]
    sig[-1] = sig[-1][:end_col]
    sig[0] = sig[0][col:]
    for i in range(1, len(sig)):
        lead = len(sig[i]) - len(sig[i].lstrip(" \t"))
        sig[i] = sig[i][min(col, lead):]
    return "\n".join(sig)


_OPENING = re.compile(r'([rR]?)"""')


def _docstring_literal(lines: list[str], node) -> tuple[str, str] | None:
    """``(prefix, raw text between the quotes)`` of the docstring as written, if it is one ``\"\"\"`` (or
    ``r\"\"\"``) literal; else ``None``."""
    expr = node.body[0]
    if not (isinstance(expr, ast.Expr) and isinstance(expr.value, ast.Constant) and isinstance(expr.value.value, str)):
        return None
    c = expr.value
    rows = lines[c.lineno - 1:c.end_lineno]
    if len(rows) == 1:
        seg = rows[0][_char_col(rows[0], c.col_offset):_char_col(rows[0], c.end_col_offset)]
    else:
        seg = rows[0][_char_col(rows[0], c.col_offset):] + "".join(rows[1:-1]) + \
            rows[-1][:_char_col(rows[-1], c.end_col_offset)]
    m = _OPENING.match(seg)
    if m is None or not seg.endswith('"""') or len(seg) < m.end() + 3 or '"""' in seg[m.end():-3]:
        return None
    return m.group(1), seg[m.end():-3]


def _completion(doc: str) -> str:
    """The cleaned docstring laid out as the body of a function: continuation lines indented by :data:`INDENT`,
    a multi-line docstring closed on a line of its own."""
    rows = doc.split("\n")
    body = rows[0] + "".join("\n" + (INDENT + r if r.strip() else "") for r in rows[1:])
    return body + ("\n" + INDENT if len(rows) > 1 else "") + '"""'


def docstring_pairs(pattern: str = "*.py", *, root: str | os.PathLike | None = None, max_examples: int | None = None,
                    min_doc_chars: int = 20, max_chars: int = 2000) -> DocstringPairs:
    """Prompt-completion records (module docstring) for the functions and methods of the files matching
    ``pattern`` (:func:`stdlib_files` with test folders excluded; ``root`` as there), in sorted-file, source order.

    ``min_doc_chars``: shortest cleaned docstring kept; ``max_chars``: longest prompt + completion kept (a longer
    one is left out, never cut); ``max_examples``: stop after this many records (``None``: all). What was left out
    and why: ``result.counts`` (:class:`DocstringPairs`)."""
    for key, value, low in (("min_doc_chars", min_doc_chars, 1), ("max_chars", max_chars, 1),
                            ("max_examples", max_examples, 1)):
        if value is None and key == "max_examples":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"docstring_pairs: '{key}' must be an int >= {low}"
                             f"{' or None' if key == 'max_examples' else ''}, got {value!r}")
    out = DocstringPairs()
    counts = {"files": 0, "unparsable_files": [], "functions": 0, "no_docstring": 0, "other_quotes": 0, "short": 0,
              "long": 0, "no_signature": 0, "kept": 0, "stopped_at_max_examples": False}
    out.counts = counts
    for path in stdlib_files(pattern, root=root, exclude_tests=True, where="docstring_pairs"):
        counts["files"] += 1
        try:
            text = _read_source(path)
            tree = ast.parse(text, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError, LookupError):  # ValueError: null bytes
            counts["unparsable_files"].append(str(path))
            continue
        lines = text.splitlines(keepends=True)
        for node in _functions(tree):
            counts["functions"] += 1
            if ast.get_docstring(node, clean=False) is None:
                counts["no_docstring"] += 1
                continue
            literal = _docstring_literal(lines, node)
            if literal is None:
                counts["other_quotes"] += 1
                continue
            prefix, raw = literal
            doc = inspect.cleandoc(raw)
            if len(doc) < min_doc_chars:
                counts["short"] += 1
                continue
            sig = _signature(lines, node)
            if sig is None:
                counts["no_signature"] += 1
                continue
            record = {"prompt": f'{sig}\n{INDENT}{prefix}"""', "completion": _completion(doc)}
            if len(record["prompt"]) + len(record["completion"]) > max_chars:
                counts["long"] += 1
                continue
            out.append(record)
            counts["kept"] += 1
            if max_examples is not None and counts["kept"] >= max_examples:
                counts["stopped_at_max_examples"] = True
                return out
    return out


def write_jsonl(records, path: str | os.PathLike) -> pathlib.Path:
    """Write ``records`` (dicts) to ``path`` as JSON lines (UTF-8, one object per line, in order); parent folders
    are created. Returns the path."""
    path = pathlib.Path(path)
    lines = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise TypeError(f"write_jsonl: 'records' must hold dicts, but records[{i}] is a {type(rec).__name__}")
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ the command line


def split_by_example(records, held_out: float, seed: int = 0) -> tuple[list, list]:
    """``(train, held_out)``: ``round(held_out * n)`` records (at least 1) drawn by ``numpy.random.default_rng(seed)``
    are held out, the rest train; both keep the records' order."""
    import numpy as np

    if not isinstance(held_out, (int, float)) or isinstance(held_out, bool) or not 0.0 < held_out < 1.0:
        raise ValueError(f"split_by_example: 'held_out' must be a fraction in (0, 1), got {held_out!r}")
    n = len(records)
    k = max(1, int(round(held_out * n)))
    if n < 2:
        raise ValueError(f"split_by_example: {n} record(s) cannot be split into a train and a held-out part")
    chosen = set(np.random.default_rng(seed).choice(n, size=min(k, n - 1), replace=False).tolist())
    return ([r for i, r in enumerate(records) if i not in chosen], [r for i, r in enumerate(records) if i in chosen])


def file_records(pattern: str = "*.py", *, root: str | os.PathLike | None = None) -> tuple[list[dict], list[str]]:
    """``(records, unreadable)``: one ``{"text": source}`` record per matching file (:func:`stdlib_files`, test
    folders excluded, sorted), and the files that could not be decoded (left out)."""
    records, unreadable = [], []
    for path in stdlib_files(pattern, root=root, exclude_tests=True, where="file_records"):
        try:
            records.append({"text": _read_source(path)})
        except (UnicodeDecodeError, SyntaxError, LookupError):
            unreadable.append(str(path))
    return records, unreadable


def main(argv=None) -> int:
    """``python -m jaxgrad.lora.stdlib_data docstrings OUT.jsonl [--pattern P] [--max-examples N]
    [--held-out F --eval-out EVAL.jsonl] [--seed S]`` (prompt-completion records, :func:`docstring_pairs`) or
    ``... text OUT.jsonl [--pattern P]`` (one ``{"text"}`` record per file); prints what was written and what was
    left out."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxgrad.lora.stdlib_data",
                                     description="JSONL training data made from the standard library's source")
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("docstrings", help="prompt = a function's signature, completion = its docstring")
    d.add_argument("out", help="the JSONL file to write (the training records)")
    d.add_argument("--pattern", default="**/*.py", help="a glob in the standard library, or an absolute path/glob "
                                                         "(default **/*.py; test folders excluded)")
    d.add_argument("--max-examples", type=int, default=None, help="stop after this many records")
    d.add_argument("--held-out", type=float, default=None, metavar="F",
                   help="hold out this fraction of the records, drawn with --seed, into --eval-out")
    d.add_argument("--eval-out", default=None, metavar="EVAL.jsonl", help="the held-out records' file")
    d.add_argument("--seed", type=int, default=0, help="seed of the held-out draw (default 0)")
    t = sub.add_parser("text", help="one {\"text\": source} record per file")
    t.add_argument("out", help="the JSONL file to write")
    t.add_argument("--pattern", default="**/*.py", help="as for docstrings (default **/*.py)")
    args = parser.parse_args(argv)
    try:
        if args.what == "text":
            records, unreadable = file_records(args.pattern)
            write_jsonl(records, args.out)
            print(f"text: {len(records)} files ({sum(len(r['text']) for r in records):,} characters) -> {args.out}"
                  f"; {len(unreadable)} undecodable file(s) left out")
            return 0
        if (args.held_out is None) != (args.eval_out is None):
            parser.error("--held-out and --eval-out go together (the fraction and the file it is written to)")
        pairs = docstring_pairs(args.pattern, max_examples=args.max_examples)
        c = pairs.counts
        train, held = (list(pairs), []) if args.held_out is None else split_by_example(pairs, args.held_out,
                                                                                        args.seed)
    except (DataError, ValueError) as err:
        print(f"python -m jaxgrad.lora.stdlib_data: error: {err}", file=sys.stderr)
        return 2
    write_jsonl(train, args.out)
    left = ", ".join(f"{c[k]} {k.replace('_', ' ')}" for k in ("no_docstring", "other_quotes", "short", "long",
                                                                 "no_signature"))
    print(f"docstrings: {c['functions']} functions in {c['files']} files, {c['kept']} kept (left out: {left}; "
          f"{len(c['unparsable_files'])} unparsable file(s){'; stopped at --max-examples' if c['stopped_at_max_examples'] else ''})")
    print(f"  {len(train)} records -> {args.out}")
    if held:
        write_jsonl(held, args.eval_out)
        print(f"  {len(held)} held-out records (seed {args.seed}) -> {args.eval_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
