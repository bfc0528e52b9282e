"""``horovod.keras.elastic`` on Keras 3: the helpers of :mod:`mpitrain.tensorflow.keras.elastic`."""

from ..tensorflow.keras.elastic import (
    CommitStateCallback,
    ElasticLimitError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    KerasState,
    ObjectState,
    State,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    init,
    run,
    shutdown,
)

__all__ = ["CommitStateCallback", "ElasticLimitError", "HorovodInternalError",
           "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "init", "run", "shutdown"]
