"""What ``jaxgrad audit`` checks: every op contributes ``audit_cases()``; nothing is registered at import time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class OpAudit:
    name: str
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    make_args: Callable[[Any, Any], tuple]  # (key, size) -> args: white noise, asymmetric shapes
    sizes: Sequence[Any]
    arg_names: tuple[str, ...] | None = None


def all_audit_cases() -> tuple[OpAudit, ...]:
    """The audit cases of every op in the package, in a fixed order."""
    import importlib

    modules = ("jaxgrad.ops.swiglu", "jaxgrad.kan.layer", "jaxgrad.cnn.conv")
    return tuple(case for m in modules for case in importlib.import_module(m).audit_cases())
