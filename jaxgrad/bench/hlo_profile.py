"""Reading a ``jax.profiler`` trace against the optimised HLO it ran: what each op is, what it costs, its floor.

The trace is the ``.trace.json.gz`` JAX writes (``jax.profiler.trace(..., create_perfetto_trace=True)``; gzip +
json, no xprof / tensorboard plugin needed); the HLO is the executable's ``compiled.as_text()``.

* GPU: every complete event on a ``/device:GPU:*`` stream line (kernels, memcpy, memset); CPU: the thunk executor's
  events (tests). An event's ``hlo_op`` names the HLO instruction (a fusion, a cuBLAS / cuDNN custom call, a copy);
  events without one are matched by kernel name (XLA names a fusion's kernel after it), else listed as
  unattributed.
* What an op computes comes from the HLO (:func:`describe`): custom-call target (cuBLAS gemm, cuDNN attention fwd /
  bwd), the opcodes of a fusion's body (dot -> gemm; reduce -> reduction; only converts / copies -> convert; else
  elementwise), the source of its instructions (the ``StackFrames`` JAX records: ``jaxgrad/ops/rmsnorm.py`` ->
  rmsnorm, ...), and which pass: fwd, bwd, or a custom VJP's recomputed forward in the backward.
* Floor of each op: ``max(flops / MATMUL_FLOPS, bytes / HBM_BYTES)``; bytes = the op's operand and result buffers
  (workspace outputs of custom calls excluded), read / written once; flops = ``2 M N K`` for a gemm, ``4 B Hq pairs
  d`` (fwd) / ``8 B Hq pairs d`` (bwd) for attention (``pairs = T (T + 1) / 2`` when causal).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import math
import os
import pathlib
import re

MATMUL_FLOPS = 790e12  # bf16 dense, what large cuBLAS GEMMs sustain on an H100 SXM (data sheet: 989e12)
HBM_BYTES = 3.35e12  # H100 SXM HBM3
SKINNY = 128  # a gemm with M, N or K <= this is a LoRA product (r = 16; XLA merges up to 7 adapters: 112)
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_TRIVIAL = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "reshape", "broadcast", "iota"}
_DATA_MOVE = _TRIVIAL | {"convert", "copy", "transpose", "slice", "concatenate", "dynamic-slice", "pad",
                         "dynamic-update-slice", "reverse"}
#: frames never named as an op's source: the benchmark and profiling code around the block
_SOURCE_SKIP = ("test_lora_profile.py",)
_BENCH_DIR = "jaxgrad/bench/"


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
        inner = next(((f, fn) for f, fn, _ in chain if "jaxgrad" in f and _BENCH_DIR not in f
                      and not f.endswith(_SOURCE_SKIP)), None)
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
        lc = _json_list(ins.attrs, "lhs_contracting_dimensions")
        rc = _json_list(ins.attrs, "rhs_contracting_dimensions")
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
        out_dtype = arrays(ins.shape)[0][0] if arrays(ins.shape) else "?"
        info.detail = f"{'%dx' % b if b > 1 else ''}{m}x{n}x{k} {ldt}.{rdt}->{out_dtype}"
        return info
    if ins.opcode == "custom-call" and "mosaic_gpu" in target.lower():
        # a jaxgrad.ops.lora_linear_mgpu kernel, L R1 + (s L R2) R3: operands L [M, Kc], R1, the rank-r product
        # s L R2 [M, r] (computed by XLA), R3^T; results Y [M, N] (and the rank-r side output [M, r]). FLOPs: the
        # base product and the epilogue's rank-r product. Profiles of older kernels that formed U (or G) in their
        # K loop (R2^T [r, Kc] as the third operand) are read too: their r-wide product is counted
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


def idle_gaps(events: list[KernelEvent], mod: HloModule, steps: int) -> list[tuple[str, float]]:
    """The GPU's idle time per step before each op, largest first: for each kernel (in start order) the time since
    every earlier kernel ended, attributed to the kernel's op. The gap before a step's first op includes the host's
    time between steps; gaps before the other ops are launch latency (a kernel launched after the one before it
    ended) or host work between them."""
    gaps: collections.Counter = collections.Counter()
    end = None
    for ev in sorted(events, key=lambda e: e.ts):
        if end is not None and ev.ts > end:
            ins = None if ev.op else mod.lookup(ev.kernel)
            gaps[ev.op or (ins.name if ins else f"[{ev.kernel}]")] += (ev.ts - end) / 1e3 / steps
        end = ev.ts + ev.dur_us if end is None else max(end, ev.ts + ev.dur_us)
    return gaps.most_common()


def analyse(trace_path, hlo_text: str, steps: int) -> tuple[list[OpRow], str, HloModule]:
    mod = parse_hlo(hlo_text)
    events, which = device_events(load_events(trace_path), mod.name)
    return aggregate(events, mod, steps), which, mod


def analyse_with_gaps(trace_path, hlo_text: str, steps: int) -> tuple[list[OpRow], str, list[tuple[str, float]]]:
    """:func:`analyse`'s rows and event source, and :func:`idle_gaps` of the same events."""
    mod = parse_hlo(hlo_text)
    events, which = device_events(load_events(trace_path), mod.name)
    return aggregate(events, mod, steps), which, idle_gaps(events, mod, steps)
