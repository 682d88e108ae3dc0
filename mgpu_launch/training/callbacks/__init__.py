"""Keras callbacks for multi-process training, one concern per module.

    callbacks = [mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
                 mgpu.callbacks.MetricAverageCallback(),
                 mgpu.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=5)]

sync        BroadcastGlobalVariablesCallback, MetricAverageCallback
schedule    LearningRateWarmupCallback, LearningRateScheduleCallback
io          ModelCheckpoint (rank 0, atomic), rank0(callback)
throughput  ThroughputCallback
backup      BackupAndRestore (rank 0 writes, every rank resumes)
"""

from mgpu_launch.training.callbacks.backup import BackupAndRestore
from mgpu_launch.training.callbacks.io import ModelCheckpoint, rank0
from mgpu_launch.training.callbacks.schedule import (LearningRateScheduleCallback,
                                                     LearningRateWarmupCallback)
from mgpu_launch.training.callbacks.sync import (BroadcastGlobalVariablesCallback,
                                                 MetricAverageCallback, model_state_variables)
from mgpu_launch.training.callbacks.throughput import ThroughputCallback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "ModelCheckpoint", "rank0",
           "LearningRateWarmupCallback", "LearningRateScheduleCallback", "ThroughputCallback",
           "BackupAndRestore", "model_state_variables"]
