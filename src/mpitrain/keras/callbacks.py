"""``horovod.keras.callbacks`` on Keras 3: the callbacks of
:mod:`mpitrain.tensorflow.keras.callbacks`.
"""

from ..tensorflow.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
