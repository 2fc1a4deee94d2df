r"""Datasets for a KAN fit: pykan's ``create_dataset``, and tables read from CSV / NPY / NPZ files.

A dataset is pykan's dict, ``{"train_input", "train_label", "test_input", "test_label"}`` (numpy arrays
``[N, n_in]`` and ``[N, n_out]``), with optional extra keys: ``input_names`` / ``target_names`` (column names) and
``stats`` (a :class:`Standardizer` when the data was standardised).

Files (:func:`read_table`): a CSV with or without a header row (a first row with any field that is not a number is
the header), an ``.npy`` holding one 2-D array (rows are samples), or an ``.npz`` whose arrays are 1-D (one column
each, named by the array) or 2-D (columns ``name[0]``, ``name[1]``, ...; the array's name selects them all). Columns
are chosen by name or by 0-based position; by default the last column is the target and the others the inputs.

Standardisation (:class:`Standardizer`): :math:`\tilde x = (x - \mu) / \sigma` per column with :math:`\mu,
\sigma` of the **training split only** (a column with :math:`\sigma = 0` keeps :math:`\sigma = 1`), so that the
test split is what an unseen sample would be; predictions map back with ``invert_targets``.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxgrad.train.errors import DataError

__all__ = ["Standardizer", "Table", "create_dataset", "dataset_from_file", "read_table", "split_indices"]

FORMATS = {".csv": "csv", ".npy": "npy", ".npz": "npz"}
STANDARDIZE = ("none", "inputs", "targets", "both")


def _float_dtype(dtype):
    import jax

    if dtype is not None:
        return np.dtype(dtype)
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)


def create_dataset(f: Callable, n_var: int = 2, f_mode: str = "col", ranges=(-1.0, 1.0), train_num: int = 1000,
                   test_num: int = 1000, normalize_input: bool = False, normalize_label: bool = False,
                   seed: int = 0, dtype=None) -> dict:
    r"""pykan's ``kan.utils.create_dataset``: inputs uniform on ``ranges``, labels ``f(inputs)``.

    Args:
      f: ``x[N, n_var] -> y[N, n_out]`` (or ``[N]``) in ``jax.numpy`` (``f_mode="col"``, pykan's default), or
        ``f(x.T)`` of rows (``f_mode="row"``).
      n_var: the number of inputs.
      ranges: ``(lo, hi)`` for every input, or one ``(lo, hi)`` per input (``[n_var, 2]``).
      train_num, test_num: samples in each split.
      normalize_input, normalize_label: standardise with the training split's mean and standard deviation (both
        splits; the statistics are kept as ``dataset["stats"]``).
      seed: numpy ``default_rng`` seed (pykan seeds torch: the same seed draws other points).
      dtype: float dtype of the arrays (default float64 under ``jax_enable_x64``, else float32).

    Returns:
      ``{"train_input", "train_label", "test_input", "test_label"}`` (numpy arrays), ``"stats"`` when normalised.
    """
    if isinstance(n_var, bool) or not isinstance(n_var, (int, np.integer)) or n_var < 1:
        raise ValueError(f"create_dataset: 'n_var' must be an int >= 1, got {n_var!r}")
    for name, v in (("train_num", train_num), ("test_num", test_num)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"create_dataset: {name!r} must be an int >= 1, got {v!r}")
    if f_mode not in ("col", "row"):
        raise ValueError(f"create_dataset: 'f_mode' must be 'col' or 'row', got {f_mode!r}")
    if not callable(f):
        raise TypeError(f"create_dataset: 'f' must be a function of the inputs, got {type(f).__name__}")
    r = np.asarray(ranges, dtype=np.float64)
    if r.shape == (2,):
        r = np.broadcast_to(r, (n_var, 2))
    if r.shape != (n_var, 2) or not np.all(np.isfinite(r)) or not np.all(r[:, 0] < r[:, 1]):
        raise ValueError(f"create_dataset: 'ranges' must be (lo, hi) or one (lo, hi) per input ([{n_var}, 2]) with "
                         f"lo < hi, got {ranges!r}")
    dt = _float_dtype(dtype)
    rng = np.random.default_rng(seed)

    def draw(n):
        x = (rng.uniform(0.0, 1.0, (n, n_var)) * (r[:, 1] - r[:, 0]) + r[:, 0]).astype(dt)
        y = np.asarray(f(jnp.asarray(x)) if f_mode == "col" else f(jnp.asarray(x).T))
        y = y.reshape(n, 1) if y.ndim == 1 else y
        if y.ndim != 2 or y.shape[0] != n:
            raise ValueError(f"create_dataset: f must return [N] or [N, n_out] for N = {n} inputs, got shape "
                             f"{y.shape}" + (" (f_mode='row' expects f(x.T))" if f_mode == "col" else ""))
        return x, y.astype(dt)

    xtr, ytr = draw(train_num)
    xte, yte = draw(test_num)
    ds = {"train_input": xtr, "train_label": ytr, "test_input": xte, "test_label": yte}
    if normalize_input or normalize_label:
        st = Standardizer.fit(xtr, ytr, inputs=normalize_input, targets=normalize_label)
        ds = st.apply(ds)
    return ds


# ----------------------------------------------------------------------------------------------------------------
# Standardisation
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Standardizer:
    """Per-column ``(x - mean) / std`` of the inputs and / or the targets (``None``: that side unchanged)."""

    input_mean: np.ndarray | None = None
    input_std: np.ndarray | None = None
    target_mean: np.ndarray | None = None
    target_std: np.ndarray | None = None

    @classmethod
    def fit(cls, x, y, *, inputs: bool = True, targets: bool = True) -> Standardizer:
        """Statistics of ``x`` / ``y`` (the training split); a constant column keeps ``std = 1``."""
        def stats(a):
            a = np.asarray(a, np.float64)
            sd = a.std(axis=0)
            return a.mean(axis=0), np.where(sd > 0, sd, 1.0)

        im, isd = stats(x) if inputs else (None, None)
        tm, tsd = stats(y) if targets else (None, None)
        return cls(im, isd, tm, tsd)

    def apply_inputs(self, x):
        if self.input_mean is None:
            return x
        return ((np.asarray(x) - self.input_mean) / self.input_std).astype(np.asarray(x).dtype)

    def apply_targets(self, y):
        if self.target_mean is None:
            return y
        return ((np.asarray(y) - self.target_mean) / self.target_std).astype(np.asarray(y).dtype)

    def invert_targets(self, y):
        """Model outputs back in the targets' units: ``y * std + mean``."""
        if self.target_mean is None:
            return y
        return y * self.target_std.astype(y.dtype) + self.target_mean.astype(y.dtype)

    def apply(self, ds: dict) -> dict:
        """A copy of dataset ``ds`` with both splits standardised and ``ds["stats"] = self``."""
        return dict(ds, train_input=self.apply_inputs(ds["train_input"]),
                    test_input=self.apply_inputs(ds["test_input"]),
                    train_label=self.apply_targets(ds["train_label"]),
                    test_label=self.apply_targets(ds["test_label"]), stats=self)

    def to_dict(self) -> dict:
        return {k: None if v is None else np.asarray(v).tolist() for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> Standardizer:
        return cls(**{k: None if d.get(k) is None else np.asarray(d[k], np.float64)
                      for k in ("input_mean", "input_std", "target_mean", "target_std")})


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Table:
    """Samples read from a file: ``x[N, n_in]``, ``y[N, n_out]`` and the chosen columns' names."""

    x: np.ndarray
    y: np.ndarray
    input_names: tuple[str, ...]
    target_names: tuple[str, ...]
    path: str


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _read_csv(p: pathlib.Path) -> tuple[np.ndarray, list[str] | None]:
    with open(p, newline="", encoding="utf-8-sig") as fh:
        first = next(csv.reader(fh), None)
    if first is None:
        raise DataError(f"{p}: the file is empty")
    header = None if all(_is_number(s) for s in first if s.strip()) else [s.strip() for s in first]
    try:
        table = np.loadtxt(p, delimiter=",", skiprows=0 if header is None else 1, ndmin=2, dtype=np.float64,
                           encoding="utf-8-sig")
    except ValueError as e:
        raise DataError(f"{p}: every field below the header must be a number ({e})") from None
    if header is not None and len(header) != table.shape[1]:
        raise DataError(f"{p}: the header names {len(header)} columns but the rows have {table.shape[1]}")
    return table, header


def _read_npz(p: pathlib.Path) -> tuple[np.ndarray, list[str], dict[str, list[int]]]:
    with np.load(p, allow_pickle=False) as z:
        arrays = {k: np.asarray(z[k]) for k in z.files}
    if not arrays:
        raise DataError(f"{p}: the archive holds no arrays")
    n = {a.shape[0] if a.ndim else None for a in arrays.values()}
    bad = [k for k, a in arrays.items() if a.ndim not in (1, 2)]
    if bad or len(n) != 1:
        shapes = {k: a.shape for k, a in arrays.items()}
        raise DataError(f"{p}: every array must be 1-D or 2-D with the same number of rows (samples), got {shapes}")
    cols, names, groups = [], [], {}
    for k, a in arrays.items():
        a2 = a.reshape(a.shape[0], -1)
        groups[k] = list(range(len(names), len(names) + a2.shape[1]))
        names += [k] if a.ndim == 1 else [f"{k}[{j}]" for j in range(a2.shape[1])]
        cols.append(a2)
    try:
        table = np.concatenate(cols, axis=1).astype(np.float64)
    except (TypeError, ValueError) as e:
        raise DataError(f"{p}: the arrays must hold numbers ({e})") from None
    return table, names, groups


def _select(where: str, spec, names: list[str] | None, groups: dict[str, list[int]], ncols: int) -> list[int]:
    if isinstance(spec, (str, int)):
        spec = [spec]
    out = []
    for s in spec:
        if isinstance(s, bool) or not isinstance(s, (str, int, np.integer)):
            raise DataError(f"{where}: columns are names or 0-based positions, got {s!r}")
        if isinstance(s, str):
            if s in groups:
                out += groups[s]
            elif names is not None and s in names:
                out.append(names.index(s))
            else:
                have = list(groups) if groups else names
                raise DataError(f"{where}: no column {s!r}" + (f"; the file has {have}" if have else
                                                             " (the file has no column names: use positions)"))
        else:
            if not -ncols <= s < ncols:
                raise DataError(f"{where}: column {s} is out of range for {ncols} columns")
            out.append(int(s) % ncols)
    if not out:
        raise DataError(f"{where}: no columns selected")
    if len(set(out)) != len(out):
        raise DataError(f"{where}: a column is selected twice ({spec!r})")
    return out


def read_table(path, inputs=None, targets=None) -> Table:
    """Read ``path`` (``.csv``, ``.npy``, ``.npz``) and pick the input and target columns.

    ``inputs`` / ``targets``: a column name or 0-based position, or a list of them (an ``.npz`` array's name picks
    all its columns). Defaults: ``targets`` the last column (an ``.npz`` of several arrays: the last array's
    columns); ``inputs`` every column that is not a target. A column
    may not be both; a value that is not finite is refused (its row and column named), never dropped.
    """
    p = pathlib.Path(path).expanduser()
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise DataError(f"data.path: {p}: the format follows the extension, one of {sorted(FORMATS)}; got "
                        f"{p.suffix or 'none'!r}")
    if not p.is_file():
        raise DataError(f"data.path: {p}: no such file")
    groups: dict[str, list[int]] = {}
    if fmt == "csv":
        table, names = _read_csv(p)
    elif fmt == "npy":
        try:
            table = np.load(p, allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{p}: not a plain numeric .npy array ({e})") from None
        if table.ndim != 2:
            raise DataError(f"{p}: an .npy must hold one 2-D array [samples, columns], got shape {table.shape}")
        table, names = table.astype(np.float64), None
    else:
        table, names, groups = _read_npz(p)
    n, c = table.shape
    if n < 2 or c < 2:
        raise DataError(f"{p}: need at least 2 rows and 2 columns (inputs and a target), got {n} x {c}")
    t_idx = _select(f"{p}: data.targets", targets, names, groups, c) if targets is not None else \
        (groups[list(groups)[-1]] if groups and len(groups) > 1 else [c - 1])
    if inputs is not None:
        i_idx = _select(f"{p}: data.inputs", inputs, names, groups, c)
    else:
        i_idx = [j for j in range(c) if j not in t_idx]
    both = sorted(set(i_idx) & set(t_idx))
    if both:
        raise DataError(f"{p}: column(s) {[names[j] if names else j for j in both]} are both inputs and targets")
    if not i_idx:
        raise DataError(f"{p}: no input columns left (data.inputs)")
    x, y = table[:, i_idx], table[:, t_idx]
    bad = ~np.isfinite(np.concatenate([x, y], axis=1))
    if bad.any():
        r, j = np.argwhere(bad)[0]
        col = (i_idx + t_idx)[j]
        raise DataError(f"{p}: {int(bad.any(axis=1).sum())} of {n} rows hold a value that is not finite (first: row "
                        f"{r}, column {names[col] if names else col}); clean the file or choose other columns")

    def label(j):
        return names[j] if names else str(j)

    return Table(x, y, tuple(label(j) for j in i_idx), tuple(label(j) for j in t_idx), str(p))


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` row indices: a ``default_rng(seed)`` permutation, the first ``round(test_fraction * n)``
    rows (at least 1) for the test split, both splits kept in file order."""
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"data.test_fraction must be in (0, 1), got {test_fraction!r}")
    n_test = min(max(int(round(test_fraction * n)), 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def dataset_from_file(path, inputs=None, targets=None, *, test_fraction: float = 0.2, seed: int = 0,
                      standardize: str = "none", dtype=None) -> dict:
    """:func:`read_table`, :func:`split_indices`, then (``standardize`` in ``inputs | targets | both``) a
    :class:`Standardizer` fitted on the training split: a dataset dict with ``input_names``, ``target_names``,
    ``path``, ``n_rows`` and, when standardised, ``stats``."""
    if standardize not in STANDARDIZE:
        raise DataError(f"data.standardize must be one of {STANDARDIZE}, got {standardize!r}")
    t = read_table(path, inputs, targets)
    tr, te = split_indices(len(t.x), test_fraction, seed)
    dt = _float_dtype(dtype)
    ds = {"train_input": t.x[tr].astype(dt), "train_label": t.y[tr].astype(dt), "test_input": t.x[te].astype(dt),
          "test_label": t.y[te].astype(dt), "input_names": t.input_names, "target_names": t.target_names,
          "path": t.path, "n_rows": len(t.x)}
    if standardize != "none":
        st = Standardizer.fit(t.x[tr], t.y[tr], inputs=standardize in ("inputs", "both"),
                              targets=standardize in ("targets", "both"))
        ds = st.apply(ds)
    return ds


def check_dataset(ds, where: str = "dataset") -> tuple[np.ndarray, ...]:
    """The four arrays of a dataset dict, 2-D with matching rows and columns (ValueError naming the key)."""
    if not isinstance(ds, dict):
        raise TypeError(f"{where}: must be a dict with 'train_input', 'train_label', 'test_input', 'test_label' "
                        f"(create_dataset, dataset_from_file), got {type(ds).__name__}")
    arrays = []
    for k in ("train_input", "train_label", "test_input", "test_label"):
        if k not in ds:
            raise ValueError(f"{where}: missing {k!r} (it has {sorted(ds)})")
        a = np.asarray(ds[k])
        if a.ndim == 1 and k.endswith("label"):
            a = a[:, None]
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"{where}: {k!r} must be a 2-D float array [samples, columns], got {a.dtype} "
                             f"{a.shape}")
        arrays.append(a)
    xtr, ytr, xte, yte = arrays
    if xtr.shape[0] != ytr.shape[0] or xte.shape[0] != yte.shape[0]:
        raise ValueError(f"{where}: inputs and labels must have the same rows: train {xtr.shape[0]} / "
                         f"{ytr.shape[0]}, test {xte.shape[0]} / {yte.shape[0]}")
    if xtr.shape[1] != xte.shape[1] or ytr.shape[1] != yte.shape[1]:
        raise ValueError(f"{where}: train and test must have the same columns: inputs {xtr.shape[1]} / "
                         f"{xte.shape[1]}, labels {ytr.shape[1]} / {yte.shape[1]}")
    return xtr, ytr, xte, yte


def target_names(ds: dict, n_out: int) -> tuple[str, ...]:
    names = ds.get("target_names") if isinstance(ds, dict) else None
    return tuple(names) if names is not None and len(names) == n_out else tuple(f"y{o}" for o in range(n_out))

