"""Horovod's ``horovod.tensorflow.util`` helpers that its tests and some users' code import.

``_executing_eagerly`` is the one in common use (Horovod's own test base imports it; it is
:func:`executing_eagerly` here);
``vars_to_refs``/``refs_to_vars`` turn (nested lists of) variables into hashable references and
back, as Horovod's optimizers do to cache by ``groups``.  Keras 3 variables have no ``ref()``:
for those a reference is the variable itself wrapped in :class:`_Ref` (hashed by identity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def executing_eagerly() -> bool:
    """True when TensorFlow executes eagerly here (not while building a graph)."""
    return bool(tf.executing_eagerly())


_executing_eagerly = executing_eagerly  # Horovod's name


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a ``tf.function`` (Horovod runs eager gradient reductions as one graph)."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise ``f`` on its (hashable) arguments and on whether execution is eager."""
    cache: dict[Any, Any] = {}

    def wrapper(*args: Any) -> Any:
        key = (args, executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


class _Ref:
    """A hashable reference to an object without ``ref()`` (a Keras 3 variable)."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def deref(self) -> Any:
        return self._obj

    def __hash__(self) -> int:
        return id(self._obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other._obj is self._obj


def vars_to_refs(variables: Any) -> Any:
    """A variable's reference (``ref()``, or :class:`_Ref`); lists become tuples of them."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    ref = getattr(variables, "ref", None)
    return ref() if callable(ref) else _Ref(variables)


def refs_to_vars(refs: Any) -> Any:
    """Undo :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


__all__ = ["executing_eagerly", "refs_to_vars", "vars_to_refs"]
