"""``tf.compat.v1`` session hooks for ``MonitoredTrainingSession`` code."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .functions import BroadcastFromRoot, broadcast_variables


class BroadcastGlobalVariablesHook(BroadcastFromRoot, tf.compat.v1.train.SessionRunHook):
    """Once the session exists, copy ``root_rank``'s global variables to every rank.

    ``MonitoredTrainingSession`` initialises the variables, or restores them from its
    ``checkpoint_dir``, before this hook runs; so a job whose rank 0 alone has
    ``checkpoint_dir`` resumes everywhere from rank 0's checkpoint.

    Every rank must pass this hook, with the same graph.  Arguments: see
    :class:`.functions.BroadcastFromRoot`.
    """

    bcast_op: Any = None  # made by begin(), for the graph being finalised

    def begin(self) -> None:
        # The op must exist before the session finalises the graph; a new graph needs a new op.
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            self.bcast_op = broadcast_variables(tf.compat.v1.global_variables(), self.root_rank,
                                                process_set=self.process_set)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
