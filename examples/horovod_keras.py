"""A Horovod TF2-Keras script running on mgpu-launch: only the Horovod import line changed.

    mgpu-train -np 2 examples/horovod_keras.py
    mgpu-train -np 2 examples/horovod_keras.py --epochs 1 --steps-per-epoch 8   # CI's size

The shape of Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py, line for line, on the
8x8 digits that ship with scikit-learn instead of a download of MNIST. TensorFlow backend only
(it uses tf.data and tf.keras, as Horovod's script does). What differs on Keras 3, and why:
docs/horovod-migration.md. The two Keras 2 habits kept here on purpose are harmless on
this CPU example; on a GPU machine delete the marked pinning lines (the launcher already gives
each process one GPU), and prefer .keras checkpoints over .h5.
"""

import argparse

import tensorflow as tf
from sklearn.datasets import load_digits

import mgpu_launch.keras as hvd    # was: import horovod.tensorflow.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--steps-per-epoch", type=int, default=500, help="over all processes")
parser.add_argument("--batch-size", type=int, default=128, help="per process")
parser.add_argument("--checkpoint", default="./checkpoint-{epoch}.keras",
                    help="written by rank 0 after every epoch (Horovod's was .h5)")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process).
# mgpu-launch: delete these lines on a GPU machine: the launcher already pins one GPU per
# process, so each process sees a single GPU and gpus[hvd.local_rank()] fails on rank 1.
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

digits = load_digits()
dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(digits.images[..., tf.newaxis] / 16.0, tf.float32),
     tf.cast(digits.target, tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(args.batch_size)

digits_model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
# (mgpu-launch: Keras 3 has no such argument; hvd.init() lets compile drop it, with a warning.)
digits_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                     optimizer=opt,
                     metrics=['accuracy'],
                     experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: scale the learning rate `lr = 0.001` ---> `lr = 0.001 * hvd.size()` during
    # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(args.checkpoint))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = digits_model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
                           callbacks=callbacks, epochs=args.epochs, verbose=verbose)
if hvd.rank() == 0:
    print(f"final training accuracy (averaged over {hvd.size()} processes): "
          f"{history.history['accuracy'][-1]:.4f}")
