r"""The precision of each output of a program, read from the program itself: what it asks for and what XLA kept.

A gradient is judged against the rounding it *should* have, and the forward does not fix that: a backward may round
its cotangent to bf16 behind an exact f32 forward, run cuDNN's bf16 dgrad, or recompute attention in bf16 inside a
flash kernel. And on a GPU the forward can compute *finer* than the function asks: XLA may drop an ``f32 -> bf16 ->
f32`` convert pair (excess precision is allowed by default), so an explicit bf16 cast in the forward leaves no trace
in its rounding while the backward still rounds. Taking the forward's precision for every gradient then reports a
correct backward as a bug.

Here each output's precision is the **coarsest rounding on its way**, propagated forward through the program's
dataflow: every value carries the coarsest precision among the values it was computed from and the rounding of the
operation that made it:

* an array's dtype (bf16, f16, f32, f64) and a ``reduce_precision`` to a format;
* a product (``dot_general``, ``conv_general_dilated``; in HLO ``dot``, ``convolution`` and cuBLAS / cuDNN custom
  calls) in its operands' dtype; f32 operands at ``HIGHEST`` stay f32, at the default precision they take the
  platform's (TF32 on a GPU: :func:`jaxgrad.verify.precision.platform_precision`);
* a kernel the compiler cannot open (``pallas_call``: Triton or Mosaic GPU) declares its precision through its body,
  which the jaxpr holds: the coarsest precision present there (its refs' dtypes, its products). In HLO it is an
  opaque custom call whose own rounding is left to the jaxpr.
* loops (``scan``, ``while``, ``cond``) are not followed entry by entry: every output takes the coarsest of all
  their inputs and bodies.

Two programs are read: the **jaxpr** (what the function asks for, before XLA) and the **optimized HLO** of the same
function as compiled for the device (what XLA kept). A gradient is judged at the coarser of the two. Where XLA kept a
finer precision than the function asks (excess precision), the function's is used and the report says so; the
reverse cannot happen by the rules above (XLA only upcasts), and where it does (an unknown custom call), the HLO's
coarser precision is used. The rule loosens a gradient's bound only where the program itself rounds that coarsely, so
a backward that is coarse by accident is judged at its own precision and still fails when it is also wrong.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

__all__ = ["OutputPrecision", "program_precisions", "jaxpr_precisions", "hlo_precisions", "coarser"]

# Finest to coarsest. TF32 and f16 share a unit roundoff; f16 ranks coarser for its range (it overflows at 65504).
_RANK = {"f64": 0, "f32": 1, "tf32": 2, "f16": 3, "bf16": 4}
_FORMATS = {(11, 52): "f64", (8, 23): "f32", (8, 10): "tf32", (5, 10): "f16", (8, 7): "bf16"}
_PRODUCTS = {"dot_general", "conv_general_dilated"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}

P = tuple[str, str]  # (precision, why)
_NONE: P = ("", "")  # integer / boolean values: no rounding


def coarser(a: str, b: str) -> str:
    """The coarser of two precision names ('' counts as no precision)."""
    if not a:
        return b
    if not b:
        return a
    return a if _RANK[a] >= _RANK[b] else b


def _merge(*ps: P) -> P:
    out = _NONE
    for p in ps:
        if p[0] and (not out[0] or _RANK[p[0]] > _RANK[out[0]]):
            out = p
    return out


def _dtype_precision(dtype) -> str:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        return ""
    if not jnp.issubdtype(dtype, jnp.floating):
        return ""
    if dtype == jnp.float64:
        return "f64"
    if dtype == jnp.float32:
        return "f32"
    if dtype == jnp.float16:
        return "f16"
    return "bf16"  # bfloat16 and the 8-bit formats: the coarsest the model knows


@dataclasses.dataclass(frozen=True)
class OutputPrecision:
    """The precision of one program output: asked (the jaxpr), kept (XLA's optimized HLO), judged (their coarser)."""

    asked: str
    asked_why: str
    kept: str | None = None  # None: the compiled program could not be read
    kept_why: str = ""

    @property
    def judged(self) -> str:
        return coarser(self.asked, self.kept or "")

    @property
    def excess(self) -> bool:
        """XLA kept a finer precision than the function asks for."""
        return self.kept is not None and bool(self.kept) and bool(self.asked) and _RANK[self.kept] < _RANK[self.asked]

    def describe(self) -> str:
        s = f"{self.judged or 'exact'} ({self.asked_why or 'no rounding'}"
        if self.excess:
            s += f"; XLA kept {self.kept} ({self.kept_why}): excess precision, judged at the function's {self.asked}"
        elif self.kept and _RANK.get(self.kept, 0) > _RANK.get(self.asked, 0):
            s += f"; compiled: {self.kept_why}"
        return s + ")"


# ---------------------------------------------------------------------------------------------------------------
# jaxpr: what the function asks for
# ---------------------------------------------------------------------------------------------------------------
def _product_precision(prim: str, dtypes, precision, platform: str) -> P:
    op = max((_dtype_precision(d) for d in dtypes), key=lambda p: _RANK.get(p, -1), default="")
    if op != "f32":
        return (op, f"{op} operands of {prim}") if op else _NONE
    names = {str(p).upper() for p in (precision if isinstance(precision, tuple) else (precision,))}
    if any("HIGHEST" in n or "F32_F32_F32" in n or "HIGH" == n.split(".")[-1] for n in names if n != "NONE"):
        return "f32", f"f32 {prim} at HIGHEST precision"
    return platform, f"f32 {prim} at the default precision ({platform} on this platform)"


def _contribution(jaxpr: jcore.Jaxpr, platform: str) -> P:
    """The coarsest rounding anywhere in a (kernel or loop) body: its values' dtypes, its products, its casts."""
    out = _NONE
    for v in [*jaxpr.invars, *jaxpr.constvars]:
        out = _merge(out, _aval_precision(v.aval, "a value in the body"))
    for eqn in jaxpr.eqns:
        out = _merge(out, _eqn_own(eqn, platform))
        for v in eqn.outvars:
            out = _merge(out, _aval_precision(v.aval, f"{eqn.primitive.name} in the body"))
        for sub in _sub_jaxprs(eqn):
            out = _merge(out, _contribution(sub, platform))
    return out


def _aval_precision(aval, why: str) -> P:
    dtype = getattr(aval, "dtype", None)
    inner = getattr(aval, "inner_aval", None)  # a Pallas ref
    if inner is not None:
        dtype = getattr(inner, "dtype", dtype)
    p = _dtype_precision(dtype) if dtype is not None else ""
    return (p, f"{p} {why}") if p else _NONE


def _sub_jaxprs(eqn) -> list[jcore.Jaxpr]:
    subs = []
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                subs.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                subs.append(x)
    return subs


def _eqn_own(eqn, platform: str) -> P:
    """The rounding an equation itself adds (besides its outputs' dtypes)."""
    prim = eqn.primitive.name
    if prim in _PRODUCTS:
        return _product_precision(prim, [v.aval.dtype for v in eqn.invars], eqn.params.get("precision"), platform)
    if prim == "reduce_precision":
        fmt = (eqn.params["exponent_bits"], eqn.params["mantissa_bits"])
        p = _FORMATS.get(fmt) or ("bf16" if fmt[1] <= 7 else "f16" if fmt[1] <= 10 else "f32")
        return p, f"reduce_precision to {p}"
    return _NONE


def _eval_jaxpr(jaxpr: jcore.Jaxpr, ins: list[P], consts: list[P], platform: str) -> list[P]:
    env: dict[Any, P] = {}

    def read(v) -> P:
        if isinstance(v, jcore.Literal):
            return _NONE  # a constant carries no rounding of the computation
        return env[v]

    for v, p in zip(jaxpr.constvars, consts, strict=True):
        env[v] = p
    for v, p in zip(jaxpr.invars, ins, strict=True):
        env[v] = p
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        prim = eqn.primitive.name
        sub = eqn.params.get(_CALLS[prim]) if prim in _CALLS else None
        if sub is not None:
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else None
            inner = closed.jaxpr if closed is not None else sub
            consts = [(_dtype_precision(c.dtype), "a constant") if hasattr(c, "dtype") else _NONE
                      for c in (closed.consts if closed is not None else [])]
            outs = _eval_jaxpr(inner, args[len(args) - len(inner.invars):], consts, platform)
        else:
            merged = _merge(*args, _eqn_own(eqn, platform))
            for body in _sub_jaxprs(eqn):  # loops, conditionals, kernels: everything meets everything
                c = _contribution(body, platform)
                if c[0]:
                    merged = _merge(merged, (c[0], f"{prim}: {c[1]}"))
            outs = [merged] * len(eqn.outvars)
        for v, p in zip(eqn.outvars, outs, strict=True):
            own = _aval_precision(v.aval, f"result of {prim}")
            env[v] = _merge(p, own) if own[0] else _NONE  # integer and boolean values carry no rounding
    return [read(v) for v in jaxpr.outvars]


def jaxpr_precisions(f: Callable[..., Any], *args: Any, platform: str = "f32") -> list[P]:
    """``(precision, why)`` of each flat output of ``f(*args)`` as its jaxpr asks (module doc)."""
    closed = jax.make_jaxpr(f)(*args)
    ins = [_aval_precision(v.aval, "input") for v in closed.jaxpr.invars]
    consts = [(_dtype_precision(c.dtype), "a constant") if hasattr(c, "dtype") else _NONE for c in closed.consts]
    return _eval_jaxpr(closed.jaxpr, ins, consts, platform)


# ---------------------------------------------------------------------------------------------------------------
# HLO: what XLA kept
# ---------------------------------------------------------------------------------------------------------------
_HLO_TYPE = re.compile(r"\b(bf16|f16|f32|f64|f8e\w+)\[")
_HLO_PREC = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64"}
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    inner: str  # the text between the opcode's parentheses
    attrs: str


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at ``s[i]`` (brackets inside string literals are skipped)."""
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c == '"':
            j += 1
            while j < len(s) and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(s)


def _parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for raw in text.splitlines():
        if current is None:
            m = _HEAD.match(raw)
            if m and raw.rstrip().endswith("{"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if raw.startswith("}"):
            current = None
            continue
        m = _LINE.match(raw)
        if not m:
            continue
        name, rest = m.group(2), m.group(3)
        if rest.startswith("("):
            end = _balanced(rest, 0)
            typ, rest = rest[:end], rest[end:].lstrip()
        else:
            typ, _, rest = rest.partition(" ")
        op_end = rest.find("(")
        opcode = rest[:op_end]
        close = _balanced(rest, op_end)
        operands = re.findall(r"%([\w.\-]+)", rest[op_end:close])
        comps[current].append(_Instr(name, typ, opcode, operands, rest[op_end + 1:close - 1], rest[close:]))
        if m.group(1):
            comps[current].append(_Instr("__root__", "", "__root__", [name], "", ""))
    return comps, entry


def _type_precision(typ: str) -> P:
    ps = [_HLO_PREC.get(t, "bf16") for t in _HLO_TYPE.findall(typ)]
    p = max(ps, key=lambda q: _RANK[q], default="")
    return (p, f"{p} values") if p else _NONE


def _tuple_arity(typ: str) -> int:
    """Top-level element count of an HLO tuple type ``(a, b, ...)``; 0 for an array type."""
    if not typ.startswith("("):
        return 0
    depth, n = 0, 1
    for c in typ[1:-1]:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            n += 1
    return n if typ.strip() != "()" else 0


def _flat(v) -> P:
    return _merge(*(_flat(x) for x in v)) if isinstance(v, list) else v


def _hlo_product(ins: _Instr, operand_types: list[str], platform: str, what: str) -> P:
    op = _merge(*(_type_precision(t) for t in operand_types))[0]
    if op != "f32":
        return (op, f"{op} operands of {what}") if op else _NONE
    a = ins.attrs.lower()
    if "highest" in a or "f32_f32_f32" in a:
        return "f32", f"f32 {what} at HIGHEST precision"
    if "tf32" in a:
        return "tf32", f"{what} in TF32"
    return platform, f"f32 {what} at the default precision ({platform} on this platform)"


def _eval_hlo(comps, name: str, params: list, platform: str, memo: dict) -> Any:
    key = (name, tuple(map(repr, params)))
    if key in memo:
        return memo[key]
    env: dict[str, Any] = {}
    types: dict[str, str] = {}
    root = None
    for ins in comps[name]:
        if ins.opcode == "__root__":
            root = env[ins.operands[0]]
            continue
        types[ins.name] = ins.type
        args = [env.get(o, _NONE) for o in ins.operands]
        called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations|called_computations)="
                            r"\{?([%\w.\-, ]+)\}?", ins.attrs)
        subs = [s.strip().lstrip("%") for group in called for s in group.split(",") if s.strip()]
        own = _type_precision(ins.type)
        if ins.opcode == "parameter":
            idx = int(ins.inner.strip() or 0)
            val = params[idx] if idx < len(params) else own
        elif ins.opcode == "get-tuple-element":
            m = re.search(r"index=(\d+)", ins.attrs)
            src = args[0] if args else _NONE
            val = src[int(m.group(1))] if isinstance(src, list) and m and int(m.group(1)) < len(src) else _flat(src)
        elif ins.opcode == "tuple":
            val = list(args)
        elif ins.opcode in ("fusion", "call") and len(subs) == 1 and subs[0] in comps:
            val = _eval_hlo(comps, subs[0], args, platform, memo)
        else:
            merged = _merge(*(_flat(a) for a in args))
            if ins.opcode in ("dot", "convolution"):
                merged = _merge(merged, _hlo_product(ins, [types.get(o, "") for o in ins.operands], platform,
                                                      ins.opcode))
            elif ins.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                target = target.group(1) if target else ""
                if "cublas" in target or "cudnn$conv" in target or "gemm" in target:
                    merged = _merge(merged, _hlo_product(ins, [types.get(o, "") for o in ins.operands], platform,
                                                          target))
            for s in subs:  # loops, conditionals, reductions' appliers: everything meets everything
                if s in comps:
                    merged = _merge(merged, _flat(_eval_hlo(comps, s, [merged] * 64, platform, memo)))
            n = _tuple_arity(ins.type)
            val = [_merge(merged, own)] * n if n else merged
        if not isinstance(val, list):
            val = _merge(val, own) if own[0] else _NONE
        env[ins.name] = val
    memo[key] = root
    return root


def hlo_precisions(hlo_text: str, platform: str = "f32") -> list[P]:
    """``(precision, why)`` of each flat output of a compiled program, from its optimized HLO text."""
    comps, entry = _parse_hlo(hlo_text)
    if not entry:
        raise ValueError("hlo_precisions: no ENTRY computation in the HLO text")
    params: list[P] = [_NONE] * sum(1 for i in comps[entry] if i.opcode == "parameter")
    for ins in comps[entry]:
        if ins.opcode == "parameter":
            p = _type_precision(ins.type)
            params[int(ins.inner.strip())] = (p[0], f"{p[0]} input") if p[0] else _NONE
    root = _eval_hlo(comps, entry, params, platform, {})
    out: list[P] = []

    def flatten(v):
        if isinstance(v, list):
            for x in v:
                flatten(x)
        else:
            out.append(v)

    flatten(root)
    return out


def program_precisions(f: Callable[..., Any], *args: Any, platform: str = "f32",
                       hlo_text: str | None = None) -> list[OutputPrecision]:
    """The precision of each flat output of ``f(*args)``: asked by its jaxpr, kept by XLA (module doc).

    ``hlo_text``: the optimized HLO of ``f`` as the caller compiled it (``compiled.as_text()``); by default the
    program ``jax.jit(f)`` compiles to on the default device. Where it cannot be read (or its outputs do not line up
    with the jaxpr's), ``kept`` is None and the jaxpr alone decides."""
    asked = jaxpr_precisions(f, *args, platform=platform)
    kept: list[P] | None
    try:
        text = hlo_text if hlo_text is not None else jax.jit(f).lower(*args).compile().as_text()
        kept = hlo_precisions(text, platform)
        if len(kept) != len(asked):
            kept = None
    except Exception:  # an HLO this parser does not read: the jaxpr decides
        kept = None
    return [OutputPrecision(a[0], a[1], None if kept is None else kept[i][0], "" if kept is None else kept[i][1])
            for i, a in enumerate(asked)]

