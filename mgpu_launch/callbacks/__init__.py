"""Keras callbacks for multi-process training, one concern per module.

    callbacks = [mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
                 mgpu.callbacks.MetricAverageCallback(),
                 mgpu.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=5)]

sync        BroadcastGlobalVariablesCallback, MetricAverageCallback
schedule    LearningRateWarmupCallback, LearningRateScheduleCallback
"""

from mgpu_launch.callbacks.schedule import (LearningRateScheduleCallback,
                                            LearningRateWarmupCallback)
from mgpu_launch.callbacks.sync import (BroadcastGlobalVariablesCallback, MetricAverageCallback,
                                        model_state_variables)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateWarmupCallback", "LearningRateScheduleCallback", "model_state_variables"]
