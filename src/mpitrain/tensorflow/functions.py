"""Broadcasting model state: variables (TF2) and a graph's global variables (tf.compat.v1)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from ..core.process_sets import ProcessSet, global_process_set
from ._support import not_converted as _not_converted
from .broadcast_ops import grouped_broadcast


@_not_converted
def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Overwrite every variable with ``root_rank``'s value, in one fused op.

    Use it once after the model (and the optimizer's slots) exist, so every rank starts from
    the same state.  Every rank must call it with the same variables in the same order.

    Args:
        variables: ``tf.Variable`` or ``keras.Variable`` objects (e.g. ``model.variables``,
            ``opt.variables``).
        root_rank: the world rank whose values win.
        process_set: the ranks taking part (default: all).
        inplace: accepted for Horovod compatibility; values are always assigned in place.

    Returns:
        ``None`` eagerly; in a graph, an op that performs every assignment.

    Raises:
        TypeError: something in ``variables`` is not a variable.
    """
    del inplace
    variables = list(variables)
    for i, v in enumerate(variables):
        if not callable(getattr(v, "assign", None)):  # tf.Variable or keras.Variable
            raise TypeError(f"variables[{i}] is a {type(v).__name__}, not a variable")
    values = grouped_broadcast(variables, root_rank, process_set=process_set)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


@_not_converted
def broadcast_(variables: Iterable[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Horovod's in-place broadcast: every variable takes ``root_rank``'s value, in one op.

    Every rank must call it with the same variables (kinds, shapes, dtypes) in the same order.

    Returns:
        The variables' values after the assignment (in a graph, tensors that run it).

    Raises:
        TypeError: something in ``variables`` is not a variable.
    """
    variables = list(variables)
    for i, v in enumerate(variables):
        if not callable(getattr(v, "assign", None)):  # tf.Variable or keras.Variable
            raise TypeError(f"variables[{i}] is a {type(v).__name__}, not a variable")
    values = grouped_broadcast(variables, root_rank, name=name, process_set=process_set)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies(assigns):
        return [tf.identity(value) for value in values]


def broadcast_global_variables(root_rank: int) -> Any:
    """An op that broadcasts every global variable of the default ``tf.compat.v1`` graph.

    Raises:
        RuntimeError: called eagerly, where there are no global variables; use
            :func:`broadcast_variables` on ``model.variables`` instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() needs a tf.compat.v1 graph (there "
                           "are no global variables eagerly); call broadcast_variables("
                           "model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastFromRoot:
    """Horovod's constructor of its broadcast hook and callback (both copy ``root_rank``'s
    variables to every rank once, when training starts): a base of both, before the
    framework's class, whose ``__init__`` it calls.

    Args:
        root_rank: the world rank whose variables win.
        device: accepted for Horovod compatibility.
        process_set: the ranks taking part (default: all).
    """

    def __init__(self, root_rank: int, device: str = "",
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        del device
        self.root_rank = root_rank
        self.process_set = process_set
