"""The training layer: the Keras glue that turns one process's ``model.fit`` into data-parallel
training.

It stands on the engines (one per Keras backend, which move the gradients) and on
``mgpu_launch.keras_internals`` (the checked door to Keras's private names), and is what the
public paths ``mgpu_launch.callbacks``, ``mgpu_launch.data`` and ``mgpu_launch.layers``
re-export. Its modules:

    bootstrap                   mgpu.init() / mgpu.shutdown(): joins the runtime, sets up the
                                backend's engine, installs the Keras patches, in that order
    optimizer, optimizer_step   DistributedOptimizer: wraps a Keras optimizer, averages the
                                gradients through the engine, accumulates backward passes
    optimizer_options           its options as one frozen value (DistributedOptions)
    optimizer_sync              its first step: the same variables, the root's weights
    sharding, sharded_saving    the optimizer state sharded across ranks (ZeRO stage 1), and
                                its files in plain Keras's layout
    data, prefetch              sharding with equal batch counts on every rank; the device
                                prefetcher
    layers, batch_statistics    SyncBatchNormalization and the cross-rank batch moments
    callbacks/                  broadcast, metric average, LR warm-up and schedules, rank-0
                                checkpoints, throughput, BackupAndRestore
    epoch_resume, resize        resuming mid-epoch after a restart; stopping every rank at the
                                same backup point to resize an elastic job
    fit_guard, stall_probes     the checks before the first step that every rank runs the same
                                steps; the marks that tell the stall inspector where fit is
    patches/                    every change to Keras's own behaviour (its methods replaced),
                                registered in one table and checked before it is installed

Nothing here imports the Horovod names (``mgpu_launch.horovod``) above it.
"""
