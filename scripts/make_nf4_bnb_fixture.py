"""Write ``nf4_bnb_fixture.npz``: bitsandbytes' own NF4 bytes for seeded weights, to test ``jaxgrad.lora.nf4``.

Run where torch and bitsandbytes are installed (the GPU machine, with the wheel carried in ``.whl/``):

    pip install -q --no-deps .whl/bitsandbytes-*.whl && PYTHONPATH=$PWD python3 scripts/make_nf4_bnb_fixture.py OUT_DIR

For every case below, on the CPU (bitsandbytes' pure-torch ``default`` backend for ``quantize_4bit``; its CPU
library, when it loads, for the double-quant ``quantize_blockwise`` and for ``dequantize_4bit``) and, when a GPU and
bitsandbytes' CUDA library are available, on CUDA as well, it stores under ``{device}/{case}/``:

- ``packed`` (uint8, flat), ``absmax`` (float32, or uint8 when double-quantised), ``absmax2``, ``offset``,
  ``code2`` (the second-level code), ``dequant_f32`` (``dequantize_4bit`` to float32) and ``dequant`` (to the
  input's dtype, stored as float32);
- and once per case ``input/{case}/w`` (float32; exactly representable in the case's dtype), ``.../meta`` (JSON:
  shape, dtype, blocksize, double_quant).

``meta`` (JSON) records the versions, which backend ran, and the code tables ``nf4_code`` and ``dynamic_code``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback

import numpy as np

NF4_CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32)


def cases() -> dict[str, tuple[np.ndarray, str, int, bool]]:
    """name -> (w float32 [out, in], dtype name, blocksize, double_quant)."""
    rng = np.random.default_rng(20261123)
    out: dict[str, tuple[np.ndarray, str, int, bool]] = {}

    def normal(shape, std=0.02):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    out["odd_3x7"] = (normal((3, 7)), "float32", 64, False)  # 21 elements: one partial block, odd count
    out["partial_10x50"] = (normal((10, 50)), "float32", 64, False)  # 7 full blocks + 52
    out["partial_10x50_bs128"] = (normal((10, 50)), "float32", 128, False)
    w = normal((3, 50))  # 150 = 2 full blocks + 22; block 1 and the partial block all zeros
    w.reshape(-1)[64:128] = 0
    w.reshape(-1)[128:] = 0
    out["zero_blocks_3x50"] = (w, "float32", 64, False)
    # values exactly on the midpoints (and their negatives), absmax 1 and 2 (x * (1/2) is exact), in full blocks and
    # in a partial block (divided, not multiplied)
    mid = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)
    row = np.concatenate([[1.0], mid, -mid[::-1], np.nextafter(mid, 2), np.nextafter(mid, -2)]).astype(np.float32)
    row = np.concatenate([row, np.zeros(64 - row.size % 64 if row.size % 64 else 0, np.float32)])
    blocks = [row, 2 * row, 0.5 * row, np.float32(0.3) * row]
    tail = np.concatenate([[1.0], mid[:9]]).astype(np.float32)  # 10-element partial block
    w = np.concatenate(blocks + [tail]).astype(np.float32)
    out["midpoints"] = (w.reshape(1, -1), "float32", 64, False)
    out["midpoints_bs128"] = (w.reshape(1, -1), "float32", 128, False)
    out["normal_64x96"] = (normal((64, 96)), "float32", 64, False)
    out["normal_64x96_dq"] = (normal((64, 96)), "float32", 64, True)
    out["normal_160x200_dq"] = (normal((160, 200)), "float32", 64, True)  # 500 blocks: 256 + 244 at level two
    out["normal_160x201_dq_bs128"] = (normal((160, 201)), "float32", 128, True)  # partial last block too
    out["single_block_dq"] = (normal((8, 8)), "float32", 64, True)  # absmax - mean = 0: a zero level-two block
    out["zero_blocks_dq"] = (out["zero_blocks_3x50"][0], "float32", 64, True)
    heavy = rng.standard_t(3, size=(33, 65)).astype(np.float32)  # heavy tails, odd size
    out["heavy_33x65_dq"] = (heavy, "float32", 64, True)
    # bf16 input (values representable in bf16)
    import ml_dtypes  # shipped with jax; on the GPU machine too

    b = normal((24, 40)).astype(ml_dtypes.bfloat16).astype(np.float32)
    out["bf16_24x40"] = (b, "bfloat16", 64, False)
    out["bf16_24x40_dq"] = (b, "bfloat16", 64, True)
    return out


def run_bnb(device: str, w: np.ndarray, dtype: str, blocksize: int, double_quant: bool) -> dict[str, np.ndarray]:
    import torch
    import bitsandbytes.functional as F

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    A = torch.from_numpy(w.copy()).to(device=device, dtype=tdtype)
    packed, state = F.quantize_4bit(A, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4")
    res = {
        "packed": packed.detach().cpu().reshape(-1).numpy().astype(np.uint8),
        "absmax": state.absmax.detach().cpu().numpy(),
        "dequant_f32": F.dequantize_4bit(packed, state).float().cpu().numpy() if dtype == "float32" else
        F.dequantize_4bit(packed, _with_dtype(state, torch.float32)).float().cpu().numpy(),
        "dequant": F.dequantize_4bit(packed, state).float().cpu().numpy(),
    }
    if double_quant:
        res["absmax2"] = state.state2.absmax.detach().cpu().numpy()
        res["offset"] = np.asarray(state.offset.detach().cpu().numpy(), np.float32)
        res["code2"] = state.state2.code.detach().cpu().numpy()
        res["absmax_dequant"] = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).cpu().numpy()
    return res


def _with_dtype(state, dtype):
    import copy

    s = copy.copy(state)
    s.dtype = dtype
    return s


def main(out_dir: str) -> None:
    import torch
    import bitsandbytes
    import bitsandbytes.functional as F
    from bitsandbytes import cextension

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lib_name = type(cextension.lib).__name__
    meta = {
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_native_library": lib_name,
        "cpu_native_library_loaded": "Mock" not in lib_name and "Error" not in lib_name,
        "nf4_code": F.get_4bit_type("nf4").tolist(),
        "dynamic_code": F.create_dynamic_map().tolist(),
        "devices": [],
        "errors": {},
    }
    arrays: dict[str, np.ndarray] = {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for name, (w, dtype, blocksize, dq) in cases().items():
        arrays[f"input/{name}/w"] = w
        arrays[f"input/{name}/meta"] = np.array(json.dumps(
            {"shape": list(w.shape), "dtype": dtype, "blocksize": blocksize, "double_quant": dq}))
    for device in devices:
        ok = 0
        for name, (w, dtype, blocksize, dq) in cases().items():
            try:
                for key, value in run_bnb(device, w, dtype, blocksize, dq).items():
                    arrays[f"{device}/{name}/{key}"] = value
                ok += 1
            except Exception as exc:  # record it (e.g. no CUDA library for this torch), keep the CPU results
                meta["errors"][f"{device}/{name}"] = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
        if ok:
            meta["devices"].append(device)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(out / "nf4_bnb_fixture.npz", **arrays)
    print(json.dumps({k: v for k, v in meta.items() if k not in ("nf4_code", "dynamic_code")}, indent=1))
    # quick self-report: CPU vs CUDA bytes
    if "cuda" in meta["devices"]:
        for name in cases():
            a, b = arrays.get(f"cpu/{name}/packed"), arrays.get(f"cuda/{name}/packed")
            if a is not None and b is not None:
                same = np.array_equal(a, b) and np.array_equal(arrays[f"cpu/{name}/absmax"], arrays[f"cuda/{name}/absmax"])
                print(f"{name}: cpu == cuda: {same}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data")
