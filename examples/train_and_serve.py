"""Train on N processes, serve on one: the saved files are plain Keras / TensorFlow.

    mgpu-train -np 2 examples/train_and_serve.py train --out served/   # N processes
    python examples/train_and_serve.py serve --out served/            # 1 process, no mgpu

`train` fits a small classifier of scikit-learn's bundled digits with a DistributedOptimizer;
rank 0 writes served/model.keras and, on the TensorFlow backend, a SavedModel for TF Serving
(served/saved_model, through ``model.export``). `serve` never imports mgpu_launch: it loads
model.keras with plain ``keras.models.load_model`` (optimizer state included, so training could
go on) and the SavedModel with ``tf.saved_model.load``, and checks both predict alike.
"""

import argparse
import os

import numpy as np


def digits():
    from sklearn.datasets import load_digits
    data = load_digits()
    return (data.data / 16.0).astype("float32"), data.target.astype("int32")


def train(args):
    import mgpu_launch as mgpu
    mgpu.init()
    import keras

    x, y = digits()
    part = len(x) // mgpu.size()
    mine = slice(mgpu.rank() * part, (mgpu.rank() + 1) * part)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.Adam(
                      mgpu.scale_lr(0.002))),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x[mine], y[mine], batch_size=32, epochs=args.epochs,
              verbose=2 if mgpu.is_chief() else 0)
    if mgpu.is_chief():  # one writer; the other ranks hold the same weights
        os.makedirs(args.out, exist_ok=True)
        model.save(os.path.join(args.out, "model.keras"))
        if keras.backend.backend() == "tensorflow":
            model.export(os.path.join(args.out, "saved_model"), format="tf_saved_model")
        print(f"rank 0 wrote {args.out} ({mgpu.size()} processes trained it)")


def serve(args):
    import keras

    x, y = digits()
    model = keras.models.load_model(os.path.join(args.out, "model.keras"))
    logits = np.asarray(model.predict(x[:200], verbose=0))
    print(f"model.keras: {type(model.optimizer).__name__} optimizer at step "
          f"{int(model.optimizer.iterations.numpy())}, accuracy on 200 images "
          f"{np.mean(logits.argmax(1) == y[:200]):.3f}")
    exported = os.path.join(args.out, "saved_model")
    if os.path.isdir(exported):
        import tensorflow as tf
        served = tf.saved_model.load(exported)
        served_logits = served.serve(tf.constant(x[:200])).numpy()
        np.testing.assert_allclose(served_logits, logits, rtol=1e-4, atol=1e-4)
        print("saved_model: the same predictions through tf.saved_model.load")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "serve"])
    parser.add_argument("--out", default="served")
    parser.add_argument("--epochs", type=int, default=10)
    arguments = parser.parse_args()
    train(arguments) if arguments.mode == "train" else serve(arguments)
