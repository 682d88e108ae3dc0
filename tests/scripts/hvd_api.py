"""Test worker for mgpu_launch.keras (Horovod's names): writes OUT_DIR/rank<r>.json.

    mgpu-train -np 2 hvd_api.py OUT_DIR

Calls every Horovod name the way a Horovod script would: topology, the value collectives,
DistributedOptimizer with Horovod's keyword arguments (and the ones that must be refused),
compile(experimental_run_tf_function=False), the four callbacks, save and load_model.
"""

import json
import os
import sys
import warnings

import numpy as np

import mgpu_launch.keras as hvd
from mgpu_launch.keras.callbacks import MetricAverageCallback

hvd.init()
import keras  # noqa: E402

out_dir = sys.argv[1]
rank = hvd.rank()
report = {"topology": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                       hvd.cross_rank(), hvd.cross_size(), hvd.is_initialized()]}


def host(tensor):
    return keras.ops.convert_to_numpy(tensor).tolist()


report["allreduce"] = host(hvd.allreduce(float(rank)))
report["allreduce_average_false"] = host(hvd.allreduce(np.array(rank + 1.0), average=False))
report["allreduce_scaled"] = host(hvd.allreduce(np.full(2, rank + 1.0, np.float32), op=hvd.Sum,
                                                prescale_factor=2.0, postscale_factor=0.5))
report["allgather"] = host(hvd.allgather(np.arange(rank + 1)))
report["broadcast"] = host(hvd.broadcast(np.float32(rank + 7), root_rank=1))
report["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=1)

sgd = keras.optimizers.SGD(0.1)
refused = {
    "num_groups": lambda: hvd.DistributedOptimizer(sgd, num_groups=2),
    "groups": lambda: hvd.DistributedOptimizer(sgd, groups=[[]]),
    "process_set": lambda: hvd.DistributedOptimizer(sgd, process_set=object()),
    "adasum": lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum),
    "local_variables": lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=["not a variable"]),
    "op_and_average": lambda: hvd.allreduce(1.0, average=True, op=hvd.Sum),
    "comm": lambda: hvd.init(comm=[0]),
}
report["errors"] = {}
for label, call in refused.items():
    try:
        call()
    except ValueError as error:
        report["errors"][label] = str(error)
report["process_set_names"] = [hasattr(hvd, name) for name in (
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set")]
report["reducescatter"] = host(hvd.reducescatter(np.arange(6.0).reshape(3, 2) * (rank + 1),
                                                 op=hvd.Sum))
report["process_set"] = [hvd.global_process_set.size(), hvd.global_process_set.ranks]
report["queries"] = [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.nccl_built(),
                     hvd.ddl_built(), hvd.ccl_built()]
# what the queries must say of CUDA / NCCL: TensorFlow's own answer (the `tensorflow` wheel that
# keras-hub brings is built with CUDA, tensorflow-cpu is not); the other engines claim none here
report["built_with_cuda"] = (__import__("tensorflow").test.is_built_with_cuda()
                             if keras.backend.backend() == "tensorflow" else False)
if keras.backend.backend() == "tensorflow":  # in-graph, inside a tf.function
    import tensorflow as tf

    @tf.function
    def in_graph(x):
        return [hvd.allreduce(x), hvd.allgather(x[:rank + 1]), hvd.broadcast(x, root_rank=1),
                hvd.reducescatter(tf.stack([x, x]), op=hvd.Sum)]

    report["in_graph"] = [host(t) for t in in_graph(tf.constant([rank + 1.0, 5.0]))]

opt = hvd.DistributedOptimizer(sgd, name="dist", device_dense="/gpu:0", device_sparse="/gpu:0",
                               compression=hvd.Compression.fp16, sparse_as_dense=True,
                               gradient_predivide_factor=2.0, backward_passes_per_step=2,
                               process_set=hvd.global_process_set, scale_local_gradients=False)
report["optimizer"] = [type(opt).__name__, opt.name, opt.compression.name, opt.sparse_as_dense,
                       opt.gradient_predivide_factor, opt.backward_passes_per_step,
                       opt.average_aggregated_gradients]

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse", experimental_run_tf_function=False)
report["warnings"] = [str(w.message) for w in caught if "experimental_run_tf" in str(w.message)]
rng = np.random.default_rng(rank)
x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")
hvd.start_timeline(os.path.join(out_dir, "timeline.json"))  # Horovod's timeline, mgpu's trace
history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0, device="/gpu:0"),
    MetricAverageCallback(device="/gpu:0"),
    hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1),
    hvd.callbacks.LearningRateScheduleCallback(0.1, lambda epoch: 0.5, start_epoch=1)])
hvd.stop_timeline()
report["loss"] = history.history["loss"]
report["lr"] = history.history["lr"]
report["weights"] = [w.tolist() for w in model.get_weights()]

path = os.path.join(out_dir, "model.keras")
if rank == 0:
    model.save(path)
hvd.broadcast_object(None)  # rank 1 goes on once rank 0 has saved
loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
report["loaded"] = [type(loaded.optimizer).__name__, loaded.optimizer.compression.name,
                    int(keras.ops.convert_to_numpy(loaded.optimizer.iterations))]
loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
report["loaded_weights"] = [w.tolist() for w in loaded.get_weights()]

# Per-rank variables: a PartialDistributedOptimizer's local layer, and local_variables= in the
# broadcast callback, keep each rank's own values; the rest is averaged and copied from rank 0.
keras.utils.set_random_seed(rank)                 # different starting weights per rank
head = keras.layers.Dense(2, name="local_head")
partial = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="shared"), head])
partial.compile(optimizer=hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                          local_layers=[head]), loss="mse")
head_start = [w.tolist() for w in head.get_weights()]
partial.fit(x, y[:, :2], batch_size=4, epochs=1, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(
                0, local_variables=head.weights)])
report["partial_shared"] = [w.tolist() for w in partial.layers[0].get_weights()]
report["partial_head_moved"] = head_start != [w.tolist() for w in head.get_weights()]
report["partial_head"] = [w.tolist() for w in head.get_weights()]
report["best_checkpoint"] = hvd.callbacks.BestModelCheckpoint(monitor="loss").filepath
del model, loaded, history           # a model and its reloaded copy share a name
hvd.broadcast_global_variables(1)    # every live model's variables: rank 1's values
report["after_global_broadcast"] = [w.tolist() for w in head.get_weights()]

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
    json.dump(report, file)
