"""The errors mpitrain's TensorFlow collectives raise when they run, as TensorFlow's classes.

Horovod's TensorFlow ops fail through TensorFlow's status codes, so its users (and its tests)
catch ``tf.errors`` classes: ranks that disagree about a collective (shape, dtype, root rank,
op) give a ``FailedPreconditionError``; an argument the op can only judge when it runs (an
alltoall without splits whose rows do not divide evenly) gives an ``InvalidArgumentError``.
Eagerly mpitrain raises those classes, each also a subclass of the error it raised before
(:class:`mpitrain.core.errors.CollectiveMismatchError`, ``ValueError``), so existing ``except``
clauses keep working; the message is mpitrain's.

Inside graphs (``tf.function``, ``tf.compat.v1`` sessions) a collective runs as a
``tf.numpy_function``, and TensorFlow turns the Python exception into a status itself: a
``ValueError`` becomes ``InvalidArgumentError`` as in Horovod, but every exception outside
TensorFlow's short list (ValueError, TypeError, StopIteration, MemoryError,
NotImplementedError) becomes ``UnknownError``, so a mismatch inside a graph is a
``tf.errors.UnknownError`` with the same message.  Only a compiled TensorFlow kernel could
report another code, and mpitrain installs none.
"""

from __future__ import annotations

import tensorflow as tf

from ..core.errors import CollectiveMismatchError


class FailedPreconditionError(tf.errors.FailedPreconditionError, CollectiveMismatchError):
    """Ranks disagree about a collective (raised on every rank of the set, eagerly)."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's argument found invalid when it runs (eagerly)."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def as_tensorflow_error(exc: BaseException) -> BaseException | None:
    """The TensorFlow-class error to raise eagerly instead of ``exc`` (None: keep ``exc``)."""
    if isinstance(exc, (FailedPreconditionError, InvalidArgumentError)):
        return None
    if isinstance(exc, CollectiveMismatchError):
        return FailedPreconditionError(str(exc))
    if type(exc) is ValueError:
        return InvalidArgumentError(str(exc))
    return None


__all__ = ["FailedPreconditionError", "InvalidArgumentError", "as_tensorflow_error"]
