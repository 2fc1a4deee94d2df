"""Write ``tests/data/efficient_kan_fixture.npz``: a [3, 4, 2] efficient-kan network (weights in efficient-kan's
``state_dict`` layout, float64), inputs and outputs of efficient-kan's forward formula as transliterated below, for
``tests/test_kan_convert.py``.

**The outputs do not come from efficient-kan.** efficient-kan itself was never installed or run to make this
fixture (it is not on PyPI, and torch is not installed in this project's environment). They come from a
transliteration of efficient-kan's ``KANLinear.forward`` written in this file (``b_splines`` by Cox-de Boor, then
``F.linear(silu(x), base_weight) + F.linear(bases.view(B, -1), (spline_weight * spline_scaler[..., None])
.view(out, -1))``), independently of ``jaxgrad``. So the fixture checks ``jaxgrad`` against this repo's reading of
efficient-kan's formula, not against efficient-kan's code:

* ``--backend numpy`` (the default, and how the committed fixture was made): the transliteration in NumPy;
* ``--backend torch``: the same transliteration in torch (float64), when torch is importable. This is still not
  efficient-kan's package.

The weights are random (NumPy, fixed seed) and not efficient-kan's init: non-unit ``spline_scaler``, a uniform grid
on layer 0 and a non-uniform, sample-adapted-looking grid on layer 1, and inputs that partly fall outside the grids
(where the spline part is zero). Usage: ``python scripts/make_efficient_kan_fixture.py [--backend torch] [--out P]``.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

WIDTHS = [3, 4, 2]
GRID_SIZE = 5
SPLINE_ORDER = 3
SEED = 20240703
N = 64


def uniform_grid(in_features, grid_size, k, lo, hi):
    h = (hi - lo) / grid_size
    row = np.arange(-k, grid_size + k + 1, dtype=np.float64) * h + lo
    return np.broadcast_to(row, (in_features, row.size)).copy()


def make_weights(rng):
    sd = {}
    G, k = GRID_SIZE, SPLINE_ORDER
    for li, (fin, fout) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        if li == 0:
            grid = uniform_grid(fin, G, k, -1.0, 1.0)
        else:  # strictly increasing, non-uniform interior knots, extended with the end step like efficient-kan
            grid = np.empty((fin, G + 2 * k + 1))
            for i in range(fin):
                core = np.sort(rng.uniform(-1.5, 1.5, G + 1))
                core[0], core[-1] = -1.5 - 0.1 * i, 1.5 + 0.1 * i
                h = (core[-1] - core[0]) / G
                grid[i] = np.concatenate([core[0] - h * np.arange(k, 0, -1), core, core[-1] + h * np.arange(1, k + 1)])
        sd[f"layers.{li}.base_weight"] = rng.uniform(-1, 1, (fout, fin)) / np.sqrt(fin)
        sd[f"layers.{li}.spline_weight"] = rng.normal(0.0, 0.5, (fout, fin, G + k))
        sd[f"layers.{li}.spline_scaler"] = rng.uniform(-1.5, 1.5, (fout, fin))
        sd[f"layers.{li}.grid"] = grid
    return sd


# ---- efficient-kan's forward in NumPy ----------------------------------------------------------------------------

def b_splines_np(x, grid, k):
    """efficient-kan ``KANLinear.b_splines``: x[B, in], grid[in, G+2k+1] -> [B, in, G+k]."""
    x = x[:, :, None]
    bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).astype(x.dtype)
    for p in range(1, k + 1):
        left = (x - grid[:, : -(p + 1)]) / (grid[:, p:-1] - grid[:, : -(p + 1)])
        right = (grid[:, p + 1:] - x) / (grid[:, p + 1:] - grid[:, 1:(-p)])
        bases = left * bases[:, :, :-1] + right * bases[:, :, 1:]
    return bases


def kan_linear_np(x, base_weight, spline_weight, spline_scaler, grid):
    k = grid.shape[1] - spline_weight.shape[2] - 1
    silu = x / (1.0 + np.exp(-x))
    base_output = silu @ base_weight.T  # F.linear(silu(x), base_weight)
    scaled = spline_weight * spline_scaler[..., None]
    spline_output = b_splines_np(x, grid, k).reshape(x.shape[0], -1) @ scaled.reshape(scaled.shape[0], -1).T
    return base_output + spline_output


def forward_np(sd, x):
    for li in range(len(WIDTHS) - 1):
        g = lambda n: sd[f"layers.{li}.{n}"]  # noqa: E731
        x = kan_linear_np(x, g("base_weight"), g("spline_weight"), g("spline_scaler"), g("grid"))
    return x


# ---- the same in torch (efficient-kan's own code path: b_splines + F.linear) ---------------------------------------

def forward_torch(sd, x):  # pragma: no cover - needs torch
    import torch
    import torch.nn.functional as F

    def b_splines(x, grid, k):
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for p in range(1, k + 1):
            bases = ((x - grid[:, : -(p + 1)]) / (grid[:, p:-1] - grid[:, : -(p + 1)]) * bases[:, :, :-1]) + (
                (grid[:, p + 1:] - x) / (grid[:, p + 1:] - grid[:, 1:(-p)]) * bases[:, :, 1:])
        return bases.contiguous()

    t = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in sd.items()}
    h = torch.from_numpy(x)
    for li in range(len(WIDTHS) - 1):
        bw, sw, sc, grid = (t[f"layers.{li}.{n}"] for n in ("base_weight", "spline_weight", "spline_scaler", "grid"))
        k = grid.shape[1] - sw.shape[2] - 1
        base_output = F.linear(F.silu(h), bw)
        spline_output = F.linear(b_splines(h, grid, k).view(h.size(0), -1),
                                 (sw * sc.unsqueeze(-1)).view(sw.size(0), -1))
        h = base_output + spline_output
    return h.numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    default_out = pathlib.Path(__file__).resolve().parents[1] / "tests/data/efficient_kan_fixture.npz"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(SEED)
    sd = make_weights(rng)
    x = rng.uniform(-1.3, 1.3, (N, WIDTHS[0]))
    x[:4] = [[-1.0, 0.0, 1.0], [0.999, -0.999, 0.5], [2.5, -2.5, 0.0], [-1.6, 1.6, 1.99]]  # edges and outside
    y = forward_torch(sd, x) if args.backend == "torch" else forward_np(sd, x)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, x=x, y=y, backend=np.array(args.backend), **{f"sd/{k}": v for k, v in sd.items()})
    print(f"wrote {out}: widths {WIDTHS}, G={GRID_SIZE}, k={SPLINE_ORDER}, backend {args.backend}, y[:2]={y[:2]}")


if __name__ == "__main__":
    main()
