#!/usr/bin/env python
"""Where the LoRA block's fwd+bwd time goes (issue #13): a per-op table from a ``jax.profiler`` trace.

    python scripts/lora_profile.py [--sizes full|small] [--variants "custom_vjp cudnn,jax.grad(reference) cudnn"]
                                   [--steps 5] [--out runs/bench] [--artifacts DIR]
    python scripts/lora_profile.py --from-artifacts DIR [--out ...]      # re-make the table from a saved run

Each variant is built and compiled by :func:`jaxgrad.bench.lora_block.run_jax_variant` itself (the benchmark's inputs,
block call and timing), with two hooks on the harness it calls: ``compile_fn`` keeps the function and its
arguments, and ``time_fn``, after the benchmark's own timing, compiles the same function once more **without XLA's
command buffers** (``xla_gpu_enable_command_buffer=""``: inside a CUDA graph the kernels lose the HLO op
annotation the table is keyed on), times that executable too, and runs ``--steps`` steps of it under
``jax.profiler.trace(..., create_perfetto_trace=True)``. The table is read from the ``.trace.json.gz`` (gzip +
json; no xprof / tensorboard plugin needed) and the executable's optimised HLO text (``compiled.as_text()``):

* GPU: every complete event on a ``/device:GPU:*`` stream line (kernels, memcpy, memset); CPU: the thunk
  executor's events (tests). An event's ``hlo_op`` names the HLO instruction (a fusion, a cuBLAS / cuDNN
  custom call, a copy); events without one are matched by kernel name (XLA names a fusion's kernel after it),
  else listed as unattributed.
* What an op computes comes from the HLO: custom-call target (cuBLAS gemm, cuDNN attention fwd / bwd), the
  opcodes of a fusion's body (dot -> gemm; reduce -> reduction; only converts / copies -> convert; else
  elementwise), and the source of its instructions (the ``StackFrames`` JAX records: ``jaxgrad/ops/rmsnorm.py``
  -> rmsnorm, ``rope.py`` -> rope, ``swiglu.py`` -> swiglu, ``lora_linear.py`` -> lora_linear, ...), and which
  pass: fwd, bwd, or the custom VJP's recomputed forward in the backward (``_block_bwd`` -> ``_recompute``).
  A gemm is "lora" when one of M, N, K is <= 128 (r = 16 at the benchmark shape; XLA concatenates adapters
  that share an input, e.g. 2 x 8192 x 96 x 1024), else "base".
* Floor of each op: ``max(flops / 790 TFLOP/s, bytes / 3.35 TB/s)``; bytes = the op's operand and result buffers
  (workspace outputs of custom calls excluded), read / written once; flops = ``2 M N K`` for a gemm (its
  dimension numbers), ``4 B Hq pairs d`` (fwd) / ``8 B Hq pairs d`` (bwd) for attention (``pairs = T (T + 1) / 2``
  when causal; the block's FLOP convention: cuDNN's backward also recomputes ``QK^T``, 10 not 8, not counted).
  790 TFLOP/s is what large bf16 GEMMs sustain on an H100 SXM (the data sheet's dense bf16 peak is 989); an f32
  (TF32) gemm is held to the same 790, so its gap includes the 2x it loses to TF32.

Output: ``<out>/lora-profile-<device>-<stamp>.txt`` (and ``.json``; ``--out`` defaults to ``runs/bench`` under the
current directory, git-ignored in a checkout, so a run never changes the repository; ``--out benchmarks/results``
adds the table to the committed results), header first: device, versions, commit
(``JAXGRAD_COMMIT`` / ``JAXGRAD_DIRTY`` from the launcher, see :func:`jaxgrad.bench.harness.provenance`), command
line. ``--artifacts DIR`` also keeps each variant's trace and HLO text (gzip) and a ``meta`` json, from which
``--from-artifacts`` remakes the same table elsewhere (its header says so).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime as _dt
import glob
import gzip
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MATMUL_FLOPS = 790e12  # bf16 dense, what large cuBLAS GEMMs sustain on an H100 SXM (data sheet: 989e12)
HBM_BYTES = 3.35e12  # H100 SXM HBM3
SKINNY = 128  # a gemm with M, N or K <= this is a LoRA product (r = 16; XLA merges up to 7 adapters: 112)
DEFAULT_VARIANTS = ("custom_vjp cudnn", "jax.grad(reference) cudnn")
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
# jaxgrad.bench.harness.DEFAULT_RESULTS_DIR (git-ignored); spelled out, since importing it imports jax, which
# --from-artifacts does not need
DEFAULT_OUT = "runs/bench"

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_TRIVIAL = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "reshape", "broadcast", "iota"}
_DATA_MOVE = _TRIVIAL | {"convert", "copy", "transpose", "slice", "concatenate", "dynamic-slice", "pad",
                         "dynamic-update-slice", "reverse"}
_SOURCE_SKIP = ("bench.py", "benchmarking.py", "lora_profile.py", "test_lora_profile.py")


# ---------------------------------------------------------------------------------------------------------------
# HLO text
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str

    def attr(self, pattern: str) -> str | None:
        m = re.search(pattern, self.attrs)
        return m.group(1) if m else None

    @property
    def calls(self) -> str | None:
        return self.attr(r"calls=%?([\w.\-]+)")

    @property
    def target(self) -> str | None:
        return self.attr(r'custom_call_target="([^"]+)"')

    @property
    def op_name(self) -> str:
        return self.attr(r'op_name="([^"]*)"') or ""

    @property
    def frame(self) -> int | None:
        f = self.attr(r"stack_frame_id=(\d+)")
        return None if f is None else int(f)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in an HLO shape string (a tuple gives several)."""
    out = []
    for dt, dims in re.findall(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]", shape):
        out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def nbytes(shape: str, skip_scratch: bool = False) -> float:
    total = 0.0
    for dt, dims in arrays(shape):
        if skip_scratch and dt in ("s8", "u8"):  # custom calls' workspace
            continue
        size = _ITEMSIZE.get(dt, 1 if dt.startswith("f8") else 4)
        total += size * math.prod(dims)
    return total


def _balanced(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index just past the bracket matching ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instr(line: str, computation: str) -> Instr | None:
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    name, rest = m.group(1), line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, rest = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    close = _balanced(rest, m.end() - 1)
    operand_text, attrs = rest[m.end():close - 1], rest[close:].lstrip(", ")
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    if not operands and operand_text.strip() and opcode not in ("constant", "parameter", "iota"):
        operands = [tok.split()[-1] for tok in operand_text.split(",") if tok.strip()]
    return Instr(name, shape, opcode, operands, attrs, computation)


@dataclasses.dataclass
class HloModule:
    name: str
    instrs: dict[str, Instr]
    computations: dict[str, list[str]]
    files: dict[int, str]
    functions: dict[int, str]
    locations: dict[int, tuple[int, int, int]]  # id -> (file id, function id, line)
    frames: dict[int, tuple[int, int]]  # id -> (location id, parent id as printed)

    def frame_chain(self, frame: int | None) -> list[tuple[str, str, int]]:
        """``(file, function, line)`` innermost first. The text prints a frame's parent as its id + 1 (0: none)."""
        chain, seen = [], set()
        while frame and frame in self.frames and frame not in seen:
            seen.add(frame)
            loc, parent = self.frames[frame]
            f, fn, line = self.locations.get(loc, (0, 0, 0))
            chain.append((self.files.get(f, "?"), self.functions.get(fn, "?"), line))
            frame = parent - 1
        return chain

    def body(self, instr: Instr) -> list[Instr]:
        """The instructions of a fusion's (or call's) computation, nested fusions included."""
        out, todo, seen = [], [instr.calls] if instr.calls else [], set()
        while todo:
            comp = todo.pop()
            if comp in seen or comp not in self.computations:
                continue
            seen.add(comp)
            for n in self.computations[comp]:
                ins = self.instrs[n]
                out.append(ins)
                if ins.calls:
                    todo.append(ins.calls)
        return out

    def lookup(self, op: str) -> Instr | None:
        if op in self.instrs:
            return self.instrs[op]
        return self._sanitized().get(op)

    def _sanitized(self) -> dict[str, Instr]:
        if not hasattr(self, "_san"):
            self._san = {re.sub(r"[^A-Za-z0-9_]", "_", n): i for n, i in self.instrs.items()}
        return self._san


def parse_hlo(text: str) -> HloModule:
    """The optimised HLO text of one executable (``compiled.as_text()``): its instructions by name (names are
    unique in a module), the computations, and the stack-frame tables JAX attaches."""
    m = re.search(r"HloModule\s+([\w.\-]+)", text)
    mod = HloModule(m.group(1) if m else "?", {}, {}, {}, {}, {}, {})
    section, comp = None, None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        if section and re.match(r"^\d+ ", s):
            k, v = s.split(" ", 1)
            k = int(k)
            if section == "FileNames":
                mod.files[k] = v.strip('"')
            elif section == "FunctionNames":
                mod.functions[k] = v.strip('"')
            elif section == "FileLocations":
                g = lambda key: int(re.search(key + r"=(\d+)", v).group(1))  # noqa: E731
                mod.locations[k] = (g("file_name_id"), g("function_name_id"), g("line"))
            else:
                mod.frames[k] = (int(re.search(r"file_location_id=(\d+)", v).group(1)),
                                 int(re.search(r"parent_frame_id=(\d+)", v).group(1)))
            continue
        if not line.startswith((" ", "\t")):
            section = None
            h = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$", s)
            if h:
                comp = h.group(1)
                mod.computations[comp] = []
            elif s == "}":
                comp = None
            continue
        if comp is not None:
            ins = _parse_instr(line, comp)
            if ins is not None:
                mod.instrs[ins.name] = ins
                mod.computations[comp].append(ins.name)
    return mod


# ---------------------------------------------------------------------------------------------------------------
# What an op is, and its floor
# ---------------------------------------------------------------------------------------------------------------
def _ints(text: str | None) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text or "")]


def _gemm_mnk(lhs: tuple[int, ...], rhs: tuple[int, ...], lc, rc, lb, rb) -> tuple[int, int, int, int]:
    """``(batch, M, N, K)`` of a dot from its operand dims and dimension numbers."""
    batch = math.prod(lhs[d] for d in lb) if lb else 1
    k = math.prod(lhs[d] for d in lc) if lc else 1
    m = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
    n = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
    return batch, m, n, k


def _shape_of(mod: HloModule, name: str, comp_shapes: dict[str, str]) -> str:
    if name in comp_shapes:
        return comp_shapes[name]
    ins = mod.instrs.get(name)
    return ins.shape if ins else ""


def _json_list(cfg: str, key: str) -> list[int] | None:
    m = re.search(r'"' + key + r'":\[([^\]]*)\]', cfg)
    return None if m is None else _ints(m.group(1))


@dataclasses.dataclass
class OpInfo:
    category: str
    kind: str  # gemm | attention | reduction | elementwise | convert | copy | other
    flops: float = 0.0
    bytes: float = 0.0
    source: str = ""
    phase: str = ""
    detail: str = ""

    @property
    def floor_s(self) -> float:
        return max(self.flops / MATMUL_FLOPS, self.bytes / HBM_BYTES)

    @property
    def bound(self) -> str:
        if not self.flops and not self.bytes:
            return "-"
        return "flops" if self.flops / MATMUL_FLOPS >= self.bytes / HBM_BYTES else "bytes"


def _sources(mod: HloModule, instrs: list[Instr]) -> tuple[str, str, str]:
    """(dominant jaxgrad source ``file:function``, dominant file stem, pass) of a group of instructions."""
    files, funcs, phases = collections.Counter(), collections.Counter(), collections.Counter()
    for ins in instrs:
        if ins.opcode in _TRIVIAL:
            continue
        chain = mod.frame_chain(ins.frame)
        inner = next(((f, fn) for f, fn, _ in chain if "jaxgrad" in f and not f.endswith(_SOURCE_SKIP)), None)
        if inner:
            stem = pathlib.Path(inner[0]).stem
            files[stem] += 1
            funcs[f"{stem}:{inner[1]}"] += 1
        names = [fn for _, fn, _ in chain]
        if "_block_bwd" in names:
            phases["bwd-recompute" if "_recompute" in names else "bwd"] += 1
        elif "_block_fwd" in names:
            phases["fwd"] += 1
        elif ins.op_name:
            phases["bwd" if "transpose(" in ins.op_name else "fwd"] += 1
    top = lambda c: c.most_common(1)[0][0] if c else ""  # noqa: E731
    return top(funcs), top(files), top(phases)


_CALL_SITES = ("block", "_block_sdpa", "_block_impl")  # frames a custom VJP's backward equations are attributed to


def _infer(ops: set[str]) -> str | None:
    """What a fusion without a source below the block's call site computes, from its opcodes (the custom VJP's
    backward: JAX attributes its equations to the ``block(...)`` call)."""
    if "rsqrt" in ops:
        return "rmsnorm"
    if "sine" in ops or "cosine" in ops:
        return "rope"
    if "logistic" in ops or ({"exponential", "divide"} <= ops and "reduce" not in ops):
        return "swiglu"
    if "concatenate" in ops and "negate" in ops:
        return "rope"
    if "exponential" in ops and "reduce" in ops:
        return "softmax"
    return None


def describe(mod: HloModule, name: str) -> OpInfo:
    """Category, FLOPs, bytes, source and pass of the HLO instruction ``name`` (see the module docstring)."""
    ins = mod.lookup(name)
    if ins is None:
        return OpInfo(category=f"unmapped: {name}", kind="other")
    shapes = {n: mod.instrs[n].shape for n in mod.computations.get(ins.computation, [])}
    operand_shapes = [_shape_of(mod, o, shapes) for o in ins.operands]
    target = ins.target or ""
    body = mod.body(ins)
    src, stem, phase = _sources(mod, body + [ins])
    info = OpInfo(category="", kind="other", source=src, phase=phase)
    info.bytes = sum(nbytes(s) for s in operand_shapes) + nbytes(ins.shape, skip_scratch=ins.opcode == "custom-call")
    if ins.opcode == "custom-call" and "cudnn" in target.lower() and ("fmha" in target.lower()
                                                                      or "attention" in target.lower()):
        bwd = "backward" in target.lower()
        q = arrays(operand_shapes[0])[0][1] if operand_shapes and arrays(operand_shapes[0]) else ()
        cfg = ins.attrs
        causal = '"mask_type":"CAUSAL"' in cfg or '"is_causal_mask":true' in cfg
        # the score tensor [B, Hq, T, S] (cuDNN's intermediate_tensor_shape); d = q's last (contracted) dim
        m = re.search(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]', cfg)
        bhts = _ints(m.group(1)) if m else []
        if q and len(bhts) == 4:
            b_, h_, t, s_ = bhts
            d = q[-1]
            pairs = t * (t + 1) / 2 if causal and t == s_ else t * s_
            info.flops = (8.0 if bwd else 4.0) * b_ * h_ * pairs * d
            info.detail = f"B={b_} Hq={h_} T={t} S={s_} d={d}{' causal' if causal else ''}"
        info.kind, info.category = "attention", f"cuDNN attention {'bwd' if bwd else 'fwd'}"
        info.phase = phase or ("bwd" if bwd else "fwd")
        return info
    dot = None
    if ins.opcode == "custom-call" and ("cublas" in target.lower() or "gemm" in target.lower()):
        lhs, rhs = (arrays(s)[0] if arrays(s) else ("", ()) for s in operand_shapes[:2])
        lc, rc = _json_list(ins.attrs, "lhs_contracting_dimensions"), _json_list(ins.attrs, "rhs_contracting_dimensions")
        lb, rb = _json_list(ins.attrs, "lhs_batch_dimensions"), _json_list(ins.attrs, "rhs_batch_dimensions")
        dot = (lhs, rhs, lc or [], rc or [], lb or [], rb or [])
        engine = "cuBLAS"
    elif ins.opcode in ("dot", "fusion") and (ins.opcode == "dot" or any(b.opcode == "dot" for b in body)):
        d = ins if ins.opcode == "dot" else next(b for b in body if b.opcode == "dot")
        inner = {n: mod.instrs[n].shape for n in mod.computations.get(d.computation, [])}
        lhs, rhs = (arrays(_shape_of(mod, o, inner))[0] for o in d.operands[:2])
        dot = (lhs, rhs, _ints(d.attr(r"lhs_contracting_dims=\{([^}]*)\}")),
               _ints(d.attr(r"rhs_contracting_dims=\{([^}]*)\}")), _ints(d.attr(r"lhs_batch_dims=\{([^}]*)\}")),
               _ints(d.attr(r"rhs_batch_dims=\{([^}]*)\}")))
        kind = ins.attr(r'"kind":"([^"]+)"') or ""
        engine = ("triton" if "triton" in kind else "cuDNN" if "cudnn" in kind else "cuBLAS" if "cublas" in kind
                  else "XLA")
    if dot is not None:
        if src.split(":")[-1] in _CALL_SITES:
            info.source = f"({src})"
        (ldt, ldims), (rdt, rdims) = dot[0], dot[1]
        b, m, n, k = _gemm_mnk(ldims, rdims, *dot[2:])
        info.flops = 2.0 * b * m * n * k
        skinny = min(m, n, k) <= SKINNY
        dtype = "bf16" if {ldt, rdt} <= {"bf16", "f16"} else "f32/tf32" if "f32" in (ldt, rdt) else f"{ldt}x{rdt}"
        info.kind = "gemm"
        info.category = f"{engine} gemm {'lora' if skinny else 'base'} {dtype}"
        info.detail = f"{'%dx' % b if b > 1 else ''}{m}x{n}x{k} {ldt}.{rdt}->{arrays(ins.shape)[0][0] if arrays(ins.shape) else '?'}"
        return info
    if ins.opcode == "custom-call" and "mosaic_gpu" in target.lower():
        # a jaxgrad.ops.lora_linear_mgpu kernel, L R1 + (s L R2) R3: operands L [M, Kc], R1, then R2^T [r, Kc] (U or
        # G from the same L tiles in the K loop) or the rank-r product s L R2 [M, r] itself (computed by XLA,
        # TileConfig.rank_from_xla), then R3^T; results Y [M, N] (and the rank-r side output [M, r]). FLOPs: the
        # base product, the r-wide U (or G) where the kernel forms it, and the epilogue's rank-r product
        outs, lhs, third = arrays(ins.shape), arrays(operand_shapes[0]), arrays(operand_shapes[2])
        if outs and lhs and third and len(lhs[0][1]) == 2 and len(outs[0][1]) == 2:
            (ldt, (m_, kc)), (odt, (_, n_)) = lhs[0], outs[0]
            rank_in = third[0][1][0] == m_ and third[0][1][1] != kc
            r_ = third[0][1][1] if rank_in else third[0][1][0]
            info.flops = 2.0 * m_ * kc * (n_ + (0 if rank_in else r_)) + 2.0 * m_ * r_ * n_
            info.detail = f"{m_}x{n_}x{kc} r{r_}{' in' if rank_in else ''} {ldt}->{odt}"
        info.kind, info.category = "gemm", "Mosaic GPU gemm+lora bf16"
        return info
    if ins.opcode == "custom-call":
        info.category = f"custom-call {target}"
        return info
    ops = {b.opcode for b in body} or {ins.opcode}
    if ins.opcode in ("copy", "transpose", "copy-start", "copy-done"):
        info.kind = "copy"
    elif "reduce" in ops or "reduce-window" in ops or "scatter" in ops:
        info.kind = "reduction"
    elif ops <= _DATA_MOVE:
        info.kind = "convert" if "convert" in ops else "copy"
    elif ins.opcode == "fusion" or ops - _DATA_MOVE:
        info.kind = "elementwise"
    what = {"reduction": "reduction", "convert": "convert", "copy": "copy/layout", "elementwise": "elementwise",
            "other": ins.opcode}[info.kind]
    if not stem or src.split(":")[-1] in _CALL_SITES:  # no source below the block's call: guess from the opcodes
        guess = _infer(ops)
        stem = f"~{guess}" if guess else ("vjp-bwd" if stem else "xla")
        info.source = f"({src or 'no source'})"
    info.category = f"{stem} {what}"
    notable = sorted(ops & {"rsqrt", "exponential", "logistic", "sine", "cosine", "divide", "reduce", "convert",
                            "concatenate", "transpose", "rng-bit-generator", "select"})
    in_dt = sorted({dt for s in operand_shapes for dt, _ in arrays(s)})
    out_dt = sorted({dt for dt, _ in arrays(ins.shape)})
    info.detail = f"{'/'.join(in_dt)}->{'/'.join(out_dt)} {','.join(notable)}".strip()
    return info


# ---------------------------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------------------------
def find_trace(log_dir: str | pathlib.Path) -> pathlib.Path:
    """The trace JSON that ``jax.profiler.trace(log_dir, create_perfetto_trace=True)`` wrote."""
    found = sorted(glob.glob(os.path.join(str(log_dir), "**", "perfetto_trace.json.gz"), recursive=True)) or \
        sorted(glob.glob(os.path.join(str(log_dir), "**", "*.trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz / *.trace.json.gz under {log_dir}")
    return pathlib.Path(found[-1])


def load_events(path: str | pathlib.Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


@dataclasses.dataclass
class KernelEvent:
    op: str  # hlo_op, or "" when the event has none
    kernel: str
    dur_us: float
    ts: float


def device_events(events: list[dict], module: str | None = None) -> tuple[list[KernelEvent], str]:
    """The op / kernel events of the executed module: on a GPU every complete event on a ``/device:GPU:*``
    process's stream lines; without one (CPU) the events that carry an ``hlo_op``. Returns (events, which)."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, n in procs.items() if "/device:GPU" in n}
    derived = ("XLA Ops", "XLA Modules", "Steps", "Framework", "TensorFlow", "Source code", "Launch Stats",
               "XLA TraceMe")
    out = []
    if gpu:
        lines = {k for k, n in threads.items() if k[0] in gpu and not n.startswith(derived)}
        streams = {k for k in lines if threads[k].lower().startswith("stream")}
        lines = streams or lines
        for e in events:
            if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in lines:
                continue
            args = e.get("args") or {}
            if module and args.get("hlo_module") not in (None, module):
                continue
            out.append(KernelEvent(args.get("hlo_op", ""), e.get("name", ""), float(e.get("dur", 0.0)),
                                   float(e.get("ts", 0.0))))
        return out, f"GPU stream lines: {sorted(threads[k] for k in lines)}"
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and args.get("hlo_op") and (not module or args.get("hlo_module") in (None, module)):
            out.append(KernelEvent(args["hlo_op"], e.get("name", ""), float(e.get("dur", 0.0)),
                                   float(e.get("ts", 0.0))))
    return out, "host events with hlo_op (no GPU process in the trace)"


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OpRow:
    op: str
    info: OpInfo
    kernels: collections.Counter
    count: float = 0.0  # executions per step
    ms: float = 0.0  # per step
    launches: float = 0.0  # kernels per step (memsets included)
    kernel_ms: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def main_kernel(self) -> str:
        """The op's kernel with the most time, memsets / memcpys last."""
        return max(self.kernel_ms, key=lambda k: (not _is_copy_kernel(k), self.kernel_ms[k]))


def aggregate(events: list[KernelEvent], mod: HloModule, steps: int) -> list[OpRow]:
    """Per HLO op (or per kernel name where the event has no op): time and count per step, with its OpInfo."""
    rows: dict[str, OpRow] = {}
    for ev in events:
        key = ev.op
        if not key:
            ins = mod.lookup(ev.kernel)
            key = ins.name if ins else f"[{ev.kernel}]"
        row = rows.get(key)
        if row is None:
            if key.startswith("["):
                low = ev.kernel.lower()
                cat = ("memcpy/memset" if "memcpy" in low or "memset" in low else
                       "unattributed cuDNN" if "cudnn" in low or "fmha" in low or "sdpa" in low else
                       "unattributed gemm" if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma")) else
                       "unattributed Mosaic GPU" if "mosaic" in low else
                       "unattributed")
                info = OpInfo(category=cat, kind="other")
            else:
                try:
                    info = describe(mod, key)
                except Exception as e:  # noqa: BLE001 - an HLO form this reader does not know: keep the time
                    info = OpInfo(category=f"unparsed ({type(e).__name__})", kind="other")
            row = rows[key] = OpRow(key, info, collections.Counter())
        row.kernels[ev.kernel] += 1
        row.kernel_ms[ev.kernel] += ev.dur_us / 1e3 / steps
        row.ms += ev.dur_us / 1e3 / steps
    for row in rows.values():
        # executions per step: one op may launch several kernels (cuDNN's backward: its kernels and memsets;
        # cuBLAS: a memset, split-K reductions), so the fewest launches of any of its compute kernels
        compute = {k: n for k, n in row.kernels.items() if not _is_copy_kernel(k)} or row.kernels
        row.count = min(compute.values()) / steps
        row.launches = sum(row.kernels.values()) / steps
    return sorted(rows.values(), key=lambda r: -r.ms)


def _is_copy_kernel(name: str) -> bool:
    low = name.lower()
    return "memset" in low or "memcpy" in low


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def variant_table(name: str, rows: list[OpRow], meta: dict, top: int = 40) -> str:
    busy = sum(r.ms for r in rows)
    # floors per step: an op's floor times its launches per step
    fl = {r.op: r.info.floor_s * 1e3 * r.count for r in rows}
    floor = sum(fl.values())
    lines = [f"== {name} =="]
    wall, wall_p = meta.get("median_ms"), meta.get("profiled_median_ms")
    lines.append(
        f"step wall (harness median): {_f(wall)} ms as benchmarked (XLA defaults); {_f(wall_p)} ms for the "
        f"profiled executable ({meta.get('profiled_with', '?')}); {meta.get('steps')} steps traced")
    lines.append(f"GPU busy per step (sum of kernel times): {busy:.3f} ms in {sum(r.launches for r in rows):.0f} "
                 f"kernel launches of {len(rows)} ops; idle/launch gap vs profiled wall: "
                 f"{_f(None if wall_p is None else wall_p - busy)} ms; sum of op floors {floor:.3f} ms "
                 f"(the FLOP floor of the block, lora/bench.py, is separate: see header)")
    lines.append(f"events: {meta.get('events_from', '?')}")
    # by category
    cats: dict[str, list[OpRow]] = collections.defaultdict(list)
    for r in rows:
        cats[r.info.category].append(r)
    lines.append("")
    lines.append("-- by category (sorted by time - floor) --")
    head = f"{'category':<34} {'n/step':>7} {'ms':>8} {'%busy':>6} {'floor_ms':>9} {'gap_ms':>8} {'eff':>5} " \
           f"{'TFLOP/s':>8} {'GB/s':>7}"
    lines += [head, "-" * len(head)]
    stats = []
    for c, rs in cats.items():
        ms = sum(r.ms for r in rs)
        f = sum(fl[r.op] for r in rs)
        flops = sum(r.info.flops * r.count for r in rs)
        byts = sum(r.info.bytes * r.count for r in rs)
        stats.append((ms - f, c, sum(r.count for r in rs), ms, f, flops, byts))
    for gap, c, n, ms, f, flops, byts in sorted(stats, reverse=True):
        lines.append(f"{_short(c, 34):<34} {n:7.0f} {ms:8.3f} {100 * ms / busy:6.1f} {f:9.3f} {gap:8.3f} "
                     f"{(f / ms if ms else 0):5.2f} {flops / ms / 1e9 if ms else 0:8.1f} "
                     f"{byts / ms / 1e6 if ms else 0:7.0f}")
    lines.append(f"{'total':<34} {sum(s[2] for s in stats):7.0f} {busy:8.3f} {100.0:6.1f} {floor:9.3f} "
                 f"{busy - floor:8.3f} {(floor / busy if busy else 0):5.2f}")
    # coarse buckets
    buckets: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        b = buckets[_bucket(r.info)]
        b[0] += r.count
        b[1] += r.ms
        b[2] += fl[r.op]
    lines.append("coarse: " + "; ".join(f"{k} {v[1]:.3f} ms ({100 * v[1] / busy:.1f}%, n {v[0]:.0f}, floor {v[2]:.3f})"
                                        for k, v in sorted(buckets.items(), key=lambda kv: -kv[1][1])))
    # by pass
    passes = collections.defaultdict(float)
    for r in rows:
        passes[r.info.phase or "?"] += r.ms
    lines.append("by pass: " + ", ".join(f"{p} {ms:.3f} ms ({100 * ms / busy:.1f}%)" for p, ms in
                                         sorted(passes.items(), key=lambda kv: -kv[1])))
    # top ops
    lines.append("")
    lines.append(f"-- top {min(top, len(rows))} ops by time (per step) --")
    head = f"{'op':<28} {'category':<28} {'pass':<13} {'n':>3} {'ms':>7} {'%':>5} {'floor':>7} {'bnd':<5} " \
           f"{'eff':>5}  {'shape / dtypes':<34} {'source':<32} kernel"
    lines += [head, "-" * len(head)]
    for r in rows[:top]:
        f = fl[r.op]
        k = r.main_kernel + (f" (+{len(r.kernels) - 1})" if len(r.kernels) > 1 else "")
        lines.append(f"{_short(r.op, 28):<28} {_short(r.info.category, 28):<28} {r.info.phase or '-':<13} "
                     f"{r.count:3.0f} {r.ms:7.3f} {100 * r.ms / busy:5.1f} {f:7.3f} {r.info.bound:<5} "
                     f"{(f / r.ms if r.ms else 0):5.2f}  {_short(r.info.detail, 34):<34} "
                     f"{_short(r.info.source, 32):<32} {_short(k, 60)}")
    rest = rows[top:]
    if rest:
        lines.append(f"(+{len(rest)} more ops: {sum(r.ms for r in rest):.3f} ms)")
    return "\n".join(lines) + "\n"


def _bucket(info: OpInfo) -> str:
    if info.kind == "gemm":
        return f"{'lora' if ' lora ' in info.category else 'base'} gemm {'f32/tf32' if 'f32' in info.category else 'bf16'}"
    if info.kind == "attention":
        return "attention"
    if info.kind in ("elementwise", "reduction", "convert", "copy"):
        return "memory passes"
    return "other"


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def rows_json(rows: list[OpRow]) -> list[dict]:
    return [{"op": r.op, "count_per_step": r.count, "ms_per_step": r.ms, "kernels": dict(r.kernels),
             "kernel_ms_per_step": dict(r.kernel_ms), "launches_per_step": r.launches,
             "floor_ms_per_step": r.info.floor_s * 1e3 * r.count, **dataclasses.asdict(r.info)} for r in rows]


def header(env: dict, argv: list[str], extra: list[str]) -> list[str]:
    from jaxgrad.bench.lora_block import SIZES, block_flops

    lines = [
        "# lora-profile: where the LoRA block's fwd+bwd time goes (scripts/lora_profile.py, issue #13)",
        f"# device: {env.get('device_kind')} ({env.get('platform')}), host {env.get('hostname')}, "
        f"{env.get('datetime_utc')}",
        f"# jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuda plugin {env.get('cuda_plugin')}, "
        f"python {env.get('python')}",
        f"# commit {env.get('commit')} (uncommitted changes: {env.get('dirty')}); command: {' '.join(argv)}",
        f"# floors: gemm/attention at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s (bf16 dense that cuBLAS sustains on H100 SXM;"
        f" data-sheet peak 989), bytes at {HBM_BYTES / 1e12:.2f} TB/s; op floor = max of the two, bytes = the op's "
        "operand + result buffers once; eff = floor / time; gap = time - floor",
    ]
    s = SIZES.get(env.get("sizes", ""), None)
    if s:
        f = block_flops(**s)
        lines.append(f"# shape {env.get('sizes')}: {s}; block FLOPs (no recompute) {f['total']:.4g} -> "
                     f"{f['total'] / MATMUL_FLOPS * 1e3:.3f} ms at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s "
                     f"({f['total'] / 989e12 * 1e3:.3f} ms at 989); custom VJP recompute +"
                     f"{f['recompute_fwd_custom_vjp']:.4g}")
    return lines + [f"# {x}" for x in extra]


def render(variants: list[dict], env: dict, argv: list[str], extra: list[str], top: int) -> str:
    out = "\n".join(header(env, argv, extra)) + "\n\n"
    for v in variants:
        out += variant_table(v["name"], v["rows"], v["meta"], top) + "\n"
    return out


def trace_summary(events: list[dict]) -> str:
    """Processes and lines of a trace with their complete-event counts and a sample event name (diagnostics)."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    count, sample = collections.Counter(), {}
    for e in events:
        if e.get("ph") == "X":
            k = (e.get("pid"), e.get("tid"))
            count[k] += 1
            sample.setdefault(k, (e.get("name", "")[:70], sorted((e.get("args") or {}))[:8]))
    return "\n".join(f"  {procs.get(k[0], k[0])!s} | {threads.get(k, k[1])!s}: {n} events, e.g. {sample[k]}"
                     for k, n in sorted(count.items(), key=lambda kv: str(kv[0])))


def analyse(trace_path, hlo_text: str, steps: int) -> tuple[list[OpRow], str, HloModule]:
    mod = parse_hlo(hlo_text)
    events, which = device_events(load_events(trace_path), mod.name)
    return aggregate(events, mod, steps), which, mod


# ---------------------------------------------------------------------------------------------------------------
# Running a variant (the benchmark's own setup, hooked)
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _hooked_harness(cap: dict, steps: int, trace_dir: str):
    """Hook :mod:`jaxgrad.bench.harness`'s ``compile_fn`` / ``time_fn`` while ``run_jax_variant`` runs."""
    import jax

    from jaxgrad.bench import harness as bm

    orig_compile, orig_time = bm.compile_fn, bm.time_fn

    def compile_hook(fn, *args):
        compiled = orig_compile(fn, *args)
        cap.update(fn=fn, args=args, compiled=compiled)
        return compiled

    def time_hook(fn, *args, **kw):
        timing = orig_time(fn, *args, **kw)  # the benchmark's own number (XLA defaults)
        exe, how = cap["compiled"], "XLA defaults"
        if jax.default_backend() == "gpu":
            try:
                exe = jax.jit(cap["fn"]).lower(*args).compile(compiler_options=NO_COMMAND_BUFFERS)
                how = "command buffers off"
            except Exception as e:  # noqa: BLE001 - profile the default executable, and say so
                how = f"XLA defaults (command buffers could not be turned off: {type(e).__name__}: {e})"[:300]
        cap["profiled_with"] = how
        cap["profiled_timing"] = orig_time(exe, *args, **kw) if exe is not cap["compiled"] else timing
        cap["hlo"] = exe.as_text()
        for _ in range(2):
            jax.block_until_ready(exe(*args))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(exe(*args))
        cap["trace"] = str(find_trace(trace_dir))
        return timing

    bm.compile_fn, bm.time_fn = compile_hook, time_hook
    try:
        yield
    finally:
        bm.compile_fn, bm.time_fn = orig_compile, orig_time


def profile_variant(name: str, sizes: str, *, steps: int, warmup: int, repeats: int, work_dir: str) -> dict:
    from jaxgrad.bench import lora_block as lb

    cap: dict[str, Any] = {}
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=work_dir)
    with _hooked_harness(cap, steps, trace_dir):
        row = lb.run_jax_variant(name, sizes, repeats=repeats, warmup=warmup)
    meta = {"name": name, "sizes": sizes, "steps": steps, "median_ms": row.median_ms,
            "p10_ms": row.p10_ms, "p90_ms": row.p90_ms, "compile_ms": row.compile_ms,
            "profiled_median_ms": cap["profiled_timing"]["median_ms"], "profiled_with": cap["profiled_with"],
            "notes": row.notes}
    print(f"# trace {cap['trace']}:\n{trace_summary(load_events(cap['trace']))}", flush=True)
    rows, which, _ = analyse(cap["trace"], cap["hlo"], steps)
    meta["events_from"] = which
    return {"name": name, "rows": rows, "meta": meta, "trace": cap["trace"], "hlo": cap["hlo"]}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def write_outputs(variants: list[dict], env: dict, argv: list[str], extra: list[str], out_dir: str, top: int,
                  stamp: str | None = None) -> pathlib.Path:
    from jaxgrad.bench import harness as bm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = stamp or _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = f"lora-profile-{bm.device_slug(env.get('device_kind'))}-{stamp}"
    path, k = out / f"{stem}.txt", 1
    while path.exists():
        path, k = out / f"{stem}-{k}.txt", k + 1
    text = render(variants, env, argv, extra, top)
    path.write_text(text)
    payload = {"environment": env, "command": argv, "notes": extra,
               "variants": [{"name": v["name"], "meta": v["meta"], "ops": rows_json(v["rows"])} for v in variants]}
    path.with_suffix(".json").write_text(json.dumps(bm._jsonable(payload), indent=1) + "\n")
    return path


def save_artifacts(variants: list[dict], env: dict, art: str) -> None:
    """Per variant: ``trace-<v>.json.gz`` and ``hlo-<v>.txt.gz``; one ``meta.json`` (flat: the device tool brings
    back at most 8 files, two folders down)."""
    d = pathlib.Path(art)
    d.mkdir(parents=True, exist_ok=True)
    metas = []
    for v in variants:
        s = _slug(v["name"])
        shutil.copyfile(v["trace"], d / f"trace-{s}.json.gz")
        with gzip.open(d / f"hlo-{s}.txt.gz", "wt") as f:
            f.write(v["hlo"])
        metas.append({**v["meta"], "slug": s})
    from jaxgrad.bench import harness as bm

    (d / "meta.json").write_text(json.dumps(bm._jsonable({"environment": env, "variants": metas}), indent=1))


def from_artifacts(art: str) -> tuple[list[dict], dict]:
    d = pathlib.Path(art)
    meta = json.loads((d / "meta.json").read_text())
    variants = []
    for m in meta["variants"]:
        with gzip.open(d / f"hlo-{m['slug']}.txt.gz", "rt") as f:
            hlo = f.read()
        rows, which, _ = analyse(d / f"trace-{m['slug']}.json.gz", hlo, m["steps"])
        m["events_from"] = which
        variants.append({"name": m["name"], "rows": rows, "meta": m})
    return variants, meta["environment"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", choices=["full", "small"], default=None, help="default: full on a GPU, else small")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated jaxgrad.bench.lora_block variant names (off-GPU 'cudnn' becomes 'sdpa(xla)')")
    p.add_argument("--steps", type=int, default=5, help="steps traced")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=40, help="ops listed per variant")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    p.add_argument("--artifacts", default=None, help="keep traces, HLO text and meta.json here")
    p.add_argument("--from-artifacts", default=None, help="remake the table from a saved --artifacts folder")
    a = p.parse_args(argv)
    cmd = [pathlib.Path(sys.argv[0]).name if sys.argv and argv is sys.argv[1:] else "lora_profile.py", *argv]
    if a.from_artifacts:
        variants, env = from_artifacts(a.from_artifacts)
        import socket

        extra = [f"table remade with --from-artifacts on {socket.gethostname()} at "
                 f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} from the traces and HLO of "
                 f"the run above (its command: {env.get('command')})"]
        path = write_outputs(variants, env, cmd, extra, a.out, a.top)
        print(path.read_text())
        print(f"wrote {path}")
        return 0

    import jax

    from jaxgrad.bench import harness as bm

    on_gpu = jax.default_backend() == "gpu"
    sizes = a.sizes or ("full" if on_gpu else "small")
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    if not on_gpu:
        names = [n.replace("cudnn", "sdpa(xla)") for n in names]
    env = {**bm.environment(), "sizes": sizes}
    env["command"] = " ".join(cmd)
    work = tempfile.mkdtemp(prefix="lora-profile-")
    variants = []
    for name in names:
        print(f"# profiling {name!r} ({sizes}) ...", flush=True)
        try:
            v = profile_variant(name, sizes, steps=a.steps, warmup=a.warmup, repeats=a.repeats, work_dir=work)
        except Exception as e:  # noqa: BLE001 - the other variants still get their table
            import traceback

            traceback.print_exc()
            print(f"# {name!r} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(variant_table(name, v["rows"], v["meta"], a.top), flush=True)
        variants.append(v)
    if a.artifacts:
        save_artifacts(variants, env, a.artifacts)
    path = write_outputs(variants, env, cmd, [], a.out, a.top)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
