"""Synthetic ResNet-50 benchmark (Horovod's tensorflow2_synthetic_benchmark idea) on Keras 3.

    mgpu-train -np 2 examples/keras_resnet50_synthetic.py                  # 224x224, batch 32
    mgpu-train -np 2 examples/keras_resnet50_synthetic.py --image-size 32 --batch-size 2 \\
        --num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 2     # CI's size, any CPU

Every process trains ``keras.applications.ResNet50(weights=None)`` on one random batch, fed
again at every step, through ``model.fit`` with a DistributedOptimizer; nothing is downloaded.
After the warm-up batches (compilation), each iteration of ``--num-batches-per-iter`` batches
is timed; rank 0 prints its img/sec per iteration, then the mean per process and the total
over all processes (the sum of every rank's mean). Runs on any Keras backend. For the
project's measured figures use ``benchmarks/`` instead: this is the quick check of a machine.
"""

import argparse
import time

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--model", default="ResNet50", help="a keras.applications model")
parser.add_argument("--image-size", type=int, default=224, help="height and width (>= 32)")
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--num-warmup-batches", type=int, default=10,
                    help="batches run before timing (compilation, caches)")
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true",
                    help="send the gradients as float16 (Compression.fp16)")
args = parser.parse_args()


class SameBatch(keras.utils.PyDataset):
    """`batches` steps of one random batch, made once (Horovod's synthetic data)."""

    mgpu_begin_early = True  # a batch depends on nothing else: mgpu may begin the next epoch early

    def __init__(self, batches: int):
        super().__init__()
        rng = np.random.default_rng(mgpu.rank())
        self.batch = (rng.uniform(size=(args.batch_size, args.image_size, args.image_size, 3))
                      .astype("float32"),
                      rng.integers(0, args.num_classes, size=(args.batch_size,)))
        self.batches = batches

    def __len__(self):
        return self.batches

    def __getitem__(self, index):
        return self.batch


class IterationTimer(keras.callbacks.Callback):
    """One iteration = one epoch; the epoch-end logs are read from the device, so it has ended."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - self.start)
        self.rates.append(rate)
        if mgpu.is_chief():
            print(f"Iter #{epoch}: {rate:.1f} img/sec per process", flush=True)


model = getattr(keras.applications, args.model)(
    weights=None, input_shape=(args.image_size, args.image_size, 3), classes=args.num_classes)
compression = mgpu.Compression.fp16 if args.fp16_allreduce else mgpu.Compression.none
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                                  compression=compression),
              loss="sparse_categorical_crossentropy")
if mgpu.is_chief():
    print(f"Model: {args.model}, {args.image_size}x{args.image_size}, batch size "
          f"{args.batch_size} per process, {mgpu.size()} processes, Keras backend "
          f"{keras.backend.backend()}", flush=True)

broadcast = mgpu.callbacks.BroadcastGlobalVariablesCallback(0)
model.fit(SameBatch(args.num_warmup_batches), epochs=1, callbacks=[broadcast], verbose=0)
timer = IterationTimer()
model.fit(SameBatch(args.num_batches_per_iter), epochs=args.num_iters, callbacks=[timer],
          verbose=0)

mean, spread = float(np.mean(timer.rates)), 1.96 * float(np.std(timer.rates))
total = mgpu.allreduce(mean, op=mgpu.Sum)
if mgpu.is_chief():
    print(f"Img/sec per process: {mean:.1f} +-{spread:.1f}")
    print(f"Total img/sec on {mgpu.size()} process(es): {total:.1f} +-{mgpu.size() * spread:.1f}")
