"""Write tests/data/torch_denoiser_fixture.npz: the seed denoiser's loss and gradients computed by PyTorch.

The network is the cryo-EM group's: ``nn.Sequential(Conv2d(1,16,3,padding=1), ReLU, Conv2d(16,16,3,padding=1),
ReLU, Conv2d(16,1,3,padding=1))`` with PyTorch's default initialisation, MSE loss against a random target, on
white-noise images of 2 x 1 x 24 x 40 (H != W so a transposed layout cannot hide). Stored in PyTorch's own
layouts (NCHW data, OIHW weights and weight gradients) in float64 and float32 (CPU, so no TF32), plus the torch
version. ``tests/test_cnn_denoiser.py`` converts them with ``jaxgrad.cnn.layout`` and compares with
``jaxgrad.cnn.denoiser`` -- torch itself is not needed to run that test.

Run where torch is installed (e.g. the GPU machines): ``python3 scripts/make_torch_denoiser_fixture.py``.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np


def compute(dtype_name: str, seed: int = 0, shape=(2, 1, 24, 40)) -> dict[str, np.ndarray]:
    import torch
    from torch import nn

    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 1, 3, padding=1)).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    target = torch.randn(shape, generator=gen, dtype=dtype)
    y = net(x)
    loss = torch.mean((y - target) ** 2)
    loss.backward()
    out = {f"{dtype_name}/x_nchw": x.numpy(), f"{dtype_name}/target_nchw": target.numpy(),
           f"{dtype_name}/y_nchw": y.detach().numpy(), f"{dtype_name}/loss": np.asarray(loss.item())}
    for name, p in net.state_dict().items():
        out[f"{dtype_name}/param/{name}"] = p.numpy()
    for name, p in net.named_parameters():
        out[f"{dtype_name}/grad/{name}"] = p.grad.numpy()
    return out


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                             / "tests" / "data" / "torch_denoiser_fixture.npz"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    arrays = {}
    for dtype_name in ("float64", "float32"):
        arrays.update(compute(dtype_name, args.seed))
    arrays["torch_version"] = np.asarray(torch.__version__)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: torch {torch.__version__}, loss f64 {float(arrays['float64/loss']):.17g}")


if __name__ == "__main__":
    main()
