"""The pinned install set is consistent, checked without network (issue #11 item 7).

What this proves: every requirement of ``pyproject.toml`` (dependencies and the ``dev`` extra) is satisfied by the
installed distributions, and so is every ``Requires-Dist`` of every distribution they pull in, transitively (``pip
check`` restricted to our closure, plus our own pins); and the ``[cuda]`` extra names ``jax[cuda13]`` at the pinned
JAX version, whose own metadata (the installed jax's ``Requires-Dist ... extra == "cuda13"``) pins ``jaxlib`` and
``jax-cuda13-plugin`` to exactly that version.

What it does not prove: that the CUDA wheels (``jax-cuda13-plugin``, ``jax-cuda13-pjrt``, the ``nvidia-*``
libraries) exist for a platform, that their own requirements resolve, or that they run on a given driver. The
opt-in test at the end runs pip's real resolver against the package index for ``.[dev,cuda]`` (``pip install
--dry-run --ignore-installed``, network needed): ``JAXGRAD_RESOLVER_ONLINE=1 pytest tests/test_install_resolver.py``.
"""

import importlib.metadata as md
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _applies(req: Requirement, extras: set[str]) -> bool:
    """Does ``req`` apply in this environment with these extras requested?"""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**default_environment(), "extra": e}) for e in (extras or {""}))


def _installed(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def _unsatisfied(roots: list[tuple[str, Requirement]]) -> tuple[list[str], int]:
    """Walk the requirement closure from ``roots`` ((who, requirement)); return the problems and the number of
    distributions visited."""
    problems, seen, todo = [], {}, list(roots)
    while todo:
        who, req = todo.pop()
        dist = _installed(req.name)
        if dist is None:
            problems.append(f"{who} requires {req}: {req.name} is not installed")
            continue
        version = dist.version
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{who} requires {req}: {req.name} {version} is installed")
        key = canonicalize_name(req.name)
        extras = set(req.extras)
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | extras
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, extras):
                todo.append((f"{dist.metadata['Name']} {version}" + (f"[{','.join(sorted(extras))}]" if extras else ""),
                             sub))
    return problems, len(seen)


def _pinned_jax() -> str:
    pins = [Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "jax"]
    assert len(pins) == 1, "pyproject.toml must name jax once in its dependencies"
    (spec,) = pins[0].specifier
    assert spec.operator == "==", f"jax must be pinned with ==, not {spec}"
    return spec.version


def _pins_exactly(req: Requirement, version: str) -> bool:
    """``req``'s specifier admits ``version`` and nothing else (``==v``, ``===v`` or ``>=v,<=v``)."""
    ops = {(s.operator, s.version) for s in req.specifier}
    if not req.specifier.contains(version, prereleases=True):
        return False
    if ("==", version) in ops or ("===", version) in ops:
        return True
    lo = {Version(v) for op, v in ops if op == ">="}
    hi = {Version(v) for op, v in ops if op == "<="}
    return Version(version) in lo and Version(version) in hi


def test_the_pinned_set_and_its_closure_are_satisfied_by_the_installed_versions():
    roots = [("jaxgrad", Requirement(r)) for r in PROJECT["dependencies"]]
    roots += [("jaxgrad[dev]", Requirement(r)) for r in PROJECT["optional-dependencies"]["dev"]]
    problems, visited = _unsatisfied([(who, r) for who, r in roots if _applies(r, {"dev"})])
    assert not problems, "installed versions break the pinned set:\n  " + "\n  ".join(problems)
    assert visited > 20  # the closure was walked (jax, flax, orbax, ... and theirs), not just our own list


def test_jax_and_jaxlib_are_pinned_to_one_version_and_installed_at_it():
    version = _pinned_jax()
    reqs = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}
    assert _pins_exactly(reqs["jaxlib"], version), f"jaxlib must be pinned to jax's version {version}"
    assert md.version("jax") == version and md.version("jaxlib") == version


def test_the_cuda_extra_is_jax_cuda13_at_the_pinned_version():
    version = _pinned_jax()
    (req,) = [Requirement(r) for r in PROJECT["optional-dependencies"]["cuda"]]
    assert req.name == "jax" and req.extras == {"cuda13"} and _pins_exactly(req, version)


def test_jax_cuda13_pins_jaxlib_and_the_cuda_plugin_at_the_same_version():
    """jax's own metadata (installed, so it is the pinned version's) for its ``cuda13`` extra."""
    version = _pinned_jax()
    assert md.version("jax") == version
    cuda = [Requirement(r) for r in md.distribution("jax").requires or []]
    cuda = [r for r in cuda if r.marker is not None and r.marker.evaluate({**default_environment(), "extra": "cuda13"})
            and not r.marker.evaluate({**default_environment(), "extra": ""})]
    by_name = {canonicalize_name(r.name): r for r in cuda}
    assert "jaxlib" in by_name and "jax-cuda13-plugin" in by_name, [str(r) for r in cuda]
    assert _pins_exactly(by_name["jaxlib"], version), str(by_name["jaxlib"])
    assert _pins_exactly(by_name["jax-cuda13-plugin"], version), str(by_name["jax-cuda13-plugin"])
    assert "with-cuda" in by_name["jax-cuda13-plugin"].extras  # the CUDA libraries come as pip wheels


def test_pins_exactly_rejects_ranges():
    assert _pins_exactly(Requirement("a<=1.2,>=1.2"), "1.2")
    assert _pins_exactly(Requirement("a==1.2"), "1.2")
    assert not _pins_exactly(Requirement("a>=1.2"), "1.2")
    assert not _pins_exactly(Requirement("a<=1.3,>=1.2"), "1.2")
    assert not _pins_exactly(Requirement("a==1.3"), "1.2")


def test_the_closure_walk_reports_a_broken_pin():
    problems, _ = _unsatisfied([("test", Requirement(f"jax=={_pinned_jax()}.post99"))])
    assert problems and "jax" in problems[0]
    problems, _ = _unsatisfied([("test", Requirement("surely-not-installed-jaxgrad-dep"))])
    assert problems and "not installed" in problems[0]


@pytest.mark.skipif(os.environ.get("JAXGRAD_RESOLVER_ONLINE") != "1",
                    reason="pip's resolver against the index needs network: JAXGRAD_RESOLVER_ONLINE=1 to run it")
def test_pip_resolves_the_cuda_install_online(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                    "--report", str(report), "-e", f"{ROOT}[dev,cuda]"], check=True, timeout=1800)
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    version = _pinned_jax()
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        assert got.get(name) == version, (name, got.get(name))
    assert any(re.match(r"nvidia-cudnn-cu13$", n) for n in got)
