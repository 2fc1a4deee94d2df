"""`jaxgrad audit` covers every custom VJP the package ships, on every backend, or says where it does not run.

Coverage is read from the code, not from a list kept by hand: the package source is scanned (``ast``) for
``jax.custom_vjp`` definitions -- decorators (``@jax.custom_vjp``, ``@functools.partial(jax.custom_vjp, ...)``) and
calls (``name = jax.custom_vjp(f, ...)``) -- each with the backward its ``defvjp`` names; an audit case covers a
definition when the traced forward of its ``fn`` (at its smallest size) holds a ``custom_vjp_call`` whose backward
is that function. Every definition is covered by a case that runs on this machine or exempted in ``EXEMPT`` with
its reason; an exemption that matches nothing is stale. (The chex variants suite, ``tests/test_op_variants.py``,
runs every registered case's op jitted, unjitted and device-placed.)
"""

import ast
import json
import pathlib

import jax
import jax.extend.core
import pytest

from jaxgrad.cli import main
from jaxgrad.ops.registry import (AUDIT_MODULES, BACKENDS, OpAudit, all_audit_cases, every_audit_case, not_run_here,
                                  run_mode, sizes_on)

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Custom VJPs that are not ops, by "module:qualified name" of the custom_vjp (a module name alone: all of its own)
EXEMPT = {
    "jaxgrad.train.grads:_global_sum.<locals>.total":
        "the engine's loss over a device mesh: its backward is ct * psum of jax.value_and_grad of the family's loss "
        "(whose custom VJPs are audited here); the batch gets no cotangent by design, which jax.grad of a plain "
        "reference would contradict; tests/test_train_mesh.py checks it across devices",
    "jaxgrad.train.grads:plan_sum_loss.<locals>.total":
        "the engine's loss over a (data, fsdp) mesh with a shard plan: its backward is ct * the psum / psum_scatter "
        "of jax.value_and_grad of the family's per-device loss (whose custom VJPs are audited here); "
        "tests/test_lora_sharding*.py check every layout against one device (float64, 1e-12)",
    "jaxgrad.cnn.precision:_conv_flipped_dw.<locals>.conv2d_flipped_dw":
        "a deliberately wrong VJP (the weight gradient flipped): the bug the CNN precision study's verifier demo "
        "catches",
    "jaxgrad.verify.planted":
        "with_backward_edit: plants a bug in any function's backward, the verifier's examples and tests",
    "jaxgrad.verify.planted_ops":
        "the planted-bug catalogue: hand-written VJPs with deliberate bugs (and their correct twins), the verifier's "
        "own examples (jaxgrad audit --planted)",
    "jaxgrad.verify.calibration":
        "correct kernels that round as tensor cores do, on which the verifier's detection and false-alarm sweeps "
        "are calibrated: models of hardware rounding, not ops of the package",
}


# ---------------------------------------------------------------------------------------------------------------
# The scan
# ---------------------------------------------------------------------------------------------------------------
def _is_custom_vjp(node) -> bool:
    """``jax.custom_vjp`` / ``custom_vjp``, called with options, or inside ``functools.partial``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "custom_vjp"
    if isinstance(node, ast.Name):
        return node.id == "custom_vjp"
    if isinstance(node, ast.Call):
        partial = isinstance(node.func, (ast.Attribute, ast.Name)) and \
            getattr(node.func, "attr", getattr(node.func, "id", None)) == "partial"
        return _is_custom_vjp(node.func) or (partial and bool(node.args) and _is_custom_vjp(node.args[0]))
    return False


class _Definitions(ast.NodeVisitor):
    """The ``jax.custom_vjp`` definitions of one module: qualified name -> (line, qualified name of the backward)."""

    def __init__(self):
        self.scope: list[str] = []
        self.found: dict[str, int] = {}
        self.backward: dict[str, str] = {}

    def qual(self, name: str) -> str:
        return "".join(f"{s}.<locals>." for s in self.scope) + name

    def visit_FunctionDef(self, node):
        if any(_is_custom_vjp(d) for d in node.decorator_list):
            self.found[self.qual(node.name)] = node.lineno
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        if isinstance(node.value, ast.Call) and _is_custom_vjp(node.value.func):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.found[self.qual(target.id)] = node.lineno
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "defvjp" and isinstance(f.value, ast.Name) \
                and len(node.args) == 2 and isinstance(node.args[1], ast.Name):
            self.backward[self.qual(f.value.id)] = self.qual(node.args[1].id)
        self.generic_visit(node)


def custom_vjp_definitions(sources: dict[str, str]) -> dict[str, str]:
    """``{"module:custom_vjp name": "module:backward name"}`` over ``{module: source}`` (qualified names as Python's
    ``__qualname__``: ``outer.<locals>.inner`` for a nested function)."""
    out = {}
    for module, text in sources.items():
        scan = _Definitions()
        scan.visit(ast.parse(text))
        for name in scan.found:
            bwd = scan.backward.get(name)
            out[f"{module}:{name}"] = f"{module}:{bwd}" if bwd else ""
    return out


def package_sources() -> dict[str, str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p.read_text()
            for p in sorted((ROOT / "jaxgrad").rglob("*.py"))}


def _backwards_in(jaxpr, found: set) -> None:
    """The backward functions of every ``custom_vjp_call`` in ``jaxpr`` and its sub-jaxprs, as "module:qualname"."""
    for eqn in jaxpr.eqns:
        bwd = eqn.params.get("bwd")
        if bwd is not None and eqn.primitive.name.startswith("custom_vjp"):
            f = getattr(bwd, "f", bwd)
            found.add(f"{f.__module__}:{f.__qualname__}")
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _backwards_in(sub.jaxpr, found)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _backwards_in(sub, found)


def audited_backwards(cases) -> set[str]:
    """The custom VJP backwards the cases' ``fn`` reach, from their traced forward at the smallest size."""
    found: set[str] = set()
    for case in cases:
        args = case.make_args(jax.random.key(0), case.sizes[0])
        _backwards_in(jax.make_jaxpr(case.fn)(*args).jaxpr, found)
    return found


def _exempt(definition: str) -> bool:
    module = definition.split(":", 1)[0]
    return definition in EXEMPT or any(module == m or module.startswith(m + ".") for m in EXEMPT if ":" not in m)


def uncovered(definitions: dict[str, str], audited: set[str]) -> list[str]:
    """The definitions that no audit case reaches and no exemption names."""
    return sorted(d for d, bwd in definitions.items() if bwd not in audited and not _exempt(d))


def stale_exemptions(definitions: dict[str, str]) -> list[str]:
    return sorted(e for e in EXEMPT
                  if not any(d == e or (":" not in e and d.split(":")[0].startswith(e)) for d in definitions))


# ---------------------------------------------------------------------------------------------------------------
# The specification
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def definitions():
    return custom_vjp_definitions(package_sources())


@pytest.fixture(scope="module")
def audited():
    return audited_backwards(all_audit_cases())


def test_the_scan_finds_the_packages_custom_vjps_and_their_backwards(definitions):
    # both forms (decorator and call), module level and nested, each paired with the function its defvjp names
    assert definitions["jaxgrad.ops.rmsnorm:_rms_norm"] == "jaxgrad.ops.rmsnorm:_bwd"
    assert definitions["jaxgrad.ops.rmsnorm:_rms_norm_pallas"] == "jaxgrad.ops.rmsnorm:_pbwd"
    assert definitions["jaxgrad.ops.attention:_attention"] == "jaxgrad.ops.attention:_bwd"
    assert definitions["jaxgrad.train.grads:_global_sum.<locals>.total"] == \
        "jaxgrad.train.grads:_global_sum.<locals>.bwd"
    assert all(bwd for bwd in definitions.values()), {d: b for d, b in definitions.items() if not b}


def test_every_custom_vjp_is_audited_or_exempted_with_a_reason(definitions, audited):
    missing = uncovered(definitions, audited)
    assert not missing, ("custom VJPs no `jaxgrad audit` case reaches (add an audit_cases() entry, its module to "
                         f"jaxgrad.ops.registry.AUDIT_MODULES, or an exemption with its reason here): {missing}")
    assert not stale_exemptions(definitions), stale_exemptions(definitions)
    assert all(len(reason) > 40 for reason in EXEMPT.values())


def test_the_ops_of_the_package_are_audited_not_exempted(definitions, audited):
    ops = {"jaxgrad.ops.swiglu:_swiglu", "jaxgrad.ops.rmsnorm:_rms_norm", "jaxgrad.ops.rmsnorm:_rms_norm_pallas",
           "jaxgrad.ops.rope:_apply_rope", "jaxgrad.ops.attention:_attention",
           "jaxgrad.ops.flash_attention:_flash", "jaxgrad.ops.lora_linear:_lora_linear",
           "jaxgrad.ops.nf4_matmul:_nf4_matmul", "jaxgrad.kan.layer:_kan_linear_vjp", "jaxgrad.cnn.conv:_conv2d"}
    ops |= {d for d in definitions if d.startswith("jaxgrad.lora.block:")}
    assert ops <= set(definitions), sorted(ops - set(definitions))
    assert {d for d in ops if definitions[d] not in audited} == set()


def test_a_new_unregistered_custom_vjp_fails_the_coverage_test(definitions, audited):
    """The coverage test can fail: a module with a new custom VJP (either form) is named until it is audited."""
    new_op = '''
import functools
import jax
import jax.extend.core

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scaled(x, c):
    return c * x

def _fwd(x, c):
    return c * x, None

def _bwd(c, res, g):
    return (c * g,)

_scaled.defvjp(_fwd, _bwd)

def _impl(x):
    return x * x

_square = jax.custom_vjp(_impl)
_square.defvjp(lambda x: (x * x, x), _bwd)
'''
    sources = package_sources() | {"jaxgrad.ops.new_op": new_op}
    found = custom_vjp_definitions(sources)
    assert uncovered(found, audited) == ["jaxgrad.ops.new_op:_scaled", "jaxgrad.ops.new_op:_square"]
    # once a case reaches its backward, it is covered
    assert uncovered(found, audited | {"jaxgrad.ops.new_op:_bwd"}) == []
    # and an exemption for a definition that no longer exists is stale
    assert stale_exemptions({d: b for d, b in definitions.items() if not d.startswith("jaxgrad.cnn.precision")}) \
        == ["jaxgrad.cnn.precision:_conv_flipped_dw.<locals>.conv2d_flipped_dw"]


def test_registry_modules_and_case_names():
    import importlib

    assert all(importlib.import_module(m).audit_cases() for m in AUDIT_MODULES)
    cases = every_audit_case()
    names = [c.name for c in cases]
    assert all(c.name.startswith(f"{c.op}[{c.backend}]") for c in cases), names
    by_op = {}
    for c in cases:
        by_op.setdefault(c.op, set()).add(c.backend)
    assert by_op["lora_block"] == set(BACKENDS)  # every backend of the block: xla, pallas, mosaic, cudnn
    for op in ("swiglu", "rms_norm", "nf4_matmul"):
        assert by_op[op] == {"xla", "pallas"}, op
    assert by_op["kan_linear"] == {"xla", "pallas", "mosaic"}
    assert by_op["flash_attention"] == {"pallas"} and by_op["attention"] == {"xla"}


def test_where_each_backend_runs():
    def case(backend, interpret_sizes=None):
        return OpAudit(f"op[{backend}]", abs, abs, lambda k, s: (), ((1,), (2,), (3,)), backend=backend,
                       interpret_sizes=interpret_sizes)

    assert run_mode(case("xla"), "cpu") == ("compiled", "")
    assert run_mode(case("pallas"), "gpu") == ("compiled", "")
    assert run_mode(case("pallas"), "cpu") == ("interpret mode", "")
    assert sizes_on(case("pallas", ((1,),)), "cpu") == ((1,),) and sizes_on(case("pallas", ((1,),)), "gpu") == \
        ((1,), (2,), (3,))
    assert run_mode(case("pallas", ()), "cpu")[0] is None and run_mode(case("pallas", ()), "gpu")[0] == "compiled"
    for gpu_only in ("mosaic", "cudnn"):
        assert run_mode(case(gpu_only), "gpu") == ("compiled", "")
        mode, why = run_mode(case(gpu_only), "cpu")
        assert mode is None and "GPU" in why and sizes_on(case(gpu_only), "cpu") == ()
    with pytest.raises(ValueError, match="'backend' must be one of"):
        case("triton")
    with pytest.raises(ValueError, match="'sizes' must name at least one"):
        OpAudit("op[xla]", abs, abs, lambda k, s: (), ())


def test_off_a_gpu_nothing_is_dropped_silently():
    every = {c.name for c in every_audit_case()}
    runs = {c.name for c in all_audit_cases("cpu")}
    skipped = {c.name: why for c, why in not_run_here("cpu")}
    assert runs | set(skipped) == every and not runs & set(skipped)
    assert set(skipped) == {"lm_head_loss[mosaic] frozen head", "kan_linear[mosaic]", "lora_block[mosaic]",
                            "lora_block[cudnn]"}
    assert {c.name for c in all_audit_cases("gpu")} == every and not not_run_here("gpu")


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------
def test_list_names_every_case_with_its_backend_and_where_it_runs(capsys):
    assert main(["audit", "--list"]) == 0
    out = capsys.readouterr().out
    for case in every_audit_case():
        assert case.name in out
    if jax.default_backend() == "cpu":
        assert "lora_block[mosaic]" in out and "not run: Mosaic GPU has no interpreter" in out
        assert "interpret mode, sizes" in out


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU only: the GPU-only cases are not run")
def test_gpu_only_cases_are_reported_not_run_in_the_summary_and_the_json(capsys, tmp_path):
    out = tmp_path / "audit.json"
    assert main(["audit", "--op", "swiglu[xla]", "--op", "lora_block[mosaic]", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PASS  swiglu[xla]" in text and "compiled" in text
    assert "----  lora_block[mosaic]  not run here: Mosaic GPU has no interpreter" in text
    data = json.loads(out.read_text())
    assert [(d["name"], d["backend"], d["mode"], d["passed"]) for d in data] == [
        ("swiglu[xla]", "xla", "compiled", True), ("lora_block[mosaic]", "mosaic", None, None)]
    # a selection of GPU-only cases alone is an error that says why, not an empty pass
    assert main(["audit", "--op", "[cudnn]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxgrad audit: error: lora_block[cudnn] does not run on this machine (cpu): cuDNN runs")


@pytest.mark.gpu
def test_gpu_audit_runs_every_backend_of_every_op_and_passes(tmp_path, capsys):
    """On a GPU, ``jaxgrad audit`` runs every case compiled -- XLA, Pallas (Triton), Mosaic GPU and cuDNN -- at
    its full sizes, and every case passes."""
    out = tmp_path / "audit.json"
    rc = main(["audit", "--json", str(out)])
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {d["name"] for d in data} == {c.name for c in every_audit_case()}
    assert all(d["mode"] == "compiled" for d in data), [d["name"] for d in data if d["mode"] != "compiled"]
    assert {d["backend"] for d in data} == set(BACKENDS)
    assert rc == 0 and all(d["passed"] for d in data), text
