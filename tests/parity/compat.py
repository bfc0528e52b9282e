"""Compare one mpitrain object with one Horovod entry of the parity data (see README there).

A Horovod signature is kept as a list of strings in Python's own spelling: ``"tensor"``,
``"name=None"``, ``"*args"``, ``"*"`` (keyword-only follow), ``"**kwargs"``.  mpitrain is
compatible when a call written for Horovod means the same thing: Horovod's positional
parameters come first, with the same names in the same order; every Horovod keyword-only
parameter is accepted by name; whatever mpitrain adds after them has a default; and every
Horovod default, evaluated in the mpitrain face (``Average``, ``global_process_set``,
``Compression.none`` are the face's own objects), equals mpitrain's.  A parameter that Horovod
requires may have a default in mpitrain (a call that works in Horovod still works).  A Horovod
signature of only ``(*args, **kwargs)`` forwards to what it wraps and is not compared.
"""

from __future__ import annotations

import ast
import inspect
from types import ModuleType
from typing import Any

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Spec:
    """A Horovod parameter list, parsed."""

    def __init__(self, params: list[str]) -> None:
        self.positional: list[tuple[str, str | None]] = []
        self.keyword_only: list[tuple[str, str | None]] = []
        self.varargs = self.varkw = False
        kw_only = False
        for p in params:
            if p == "*":
                kw_only = True
            elif p.startswith("**"):
                self.varkw = True
            elif p.startswith("*"):
                self.varargs = kw_only = True
            else:
                name, _, default = p.partition("=")
                (self.keyword_only if kw_only else self.positional).append(
                    (name, default if _ else None))


def evaluate_default(source: str, face: ModuleType) -> Any:
    """The value of a Horovod default (source text) in the mpitrain face's namespace."""
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        pass
    node = ast.parse(source, mode="eval").body
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise ValueError(f"cannot evaluate the Horovod default {source!r}")
    value: Any = getattr(face, node.id)
    for part in parts:
        value = getattr(value, part)
    return value


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b) or (
            isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool) and a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a bool are not equal here
        return False


def signature_problems(obj: Any, params: list[str], face: ModuleType,
                       method: bool = False) -> list[str]:
    """Why a Horovod call with ``params`` would not work the same on ``obj`` ([] if it does).

    ``method``: ``obj`` is a function looked up on a class; its first parameter (``self``) is
    bound at the call and not part of the comparison.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        return [f"no signature: {exc}"]
    if method and inspect.isfunction(obj):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    spec = Spec(params)
    if spec.varargs and spec.varkw and not spec.positional and not spec.keyword_only:
        return []  # Horovod passes everything through to what it wraps: nothing to compare
    ours = list(sig.parameters.values())
    ours_positional = [p for p in ours if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in ours}
    has_varkw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours)
    has_varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in ours)
    problems: list[str] = []
    for i, (name, _) in enumerate(spec.positional):
        got = ours_positional[i].name if i < len(ours_positional) else None
        if got != name:
            problems.append(f"parameter {i} is {got!r}, Horovod's is {name!r}")
    for name, _ in spec.keyword_only:
        p = by_name.get(name)
        if (p is None and not has_varkw) or (p is not None and p.kind is
                                              inspect.Parameter.POSITIONAL_ONLY):
            problems.append(f"keyword {name!r} is not accepted")
    if spec.varargs and not has_varargs:
        problems.append("Horovod takes *args, this does not")
    if spec.varkw and not has_varkw:
        problems.append("Horovod takes **kwargs, this does not")
    horovod_names = {n for n, _ in spec.positional + spec.keyword_only}
    for p in ours:
        if p.name in horovod_names or p.kind in (inspect.Parameter.VAR_POSITIONAL,
                                                 inspect.Parameter.VAR_KEYWORD):
            continue
        if p.default is _EMPTY:
            problems.append(f"extra parameter {p.name!r} has no default")
    for name, source in spec.positional + spec.keyword_only:
        p = by_name.get(name)
        if source is None or p is None:
            continue
        if p.default is _EMPTY:
            problems.append(f"{name} has no default, Horovod's is {source}")
            continue
        try:
            expected = evaluate_default(source, face)
        except (AttributeError, ValueError) as exc:
            problems.append(f"{name}: Horovod's default {source} does not exist here ({exc})")
            continue
        if not _same_value(p.default, expected):
            problems.append(f"{name} defaults to {p.default!r}, Horovod's to {source} "
                            f"= {expected!r}")
    return problems
