import os
os.environ.setdefault("KERAS_BACKEND", "torch")
import sys, numpy as np, keras, torch
import mgpu_launch as mgpu
seed = None if sys.argv[1] == "none" else 1
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32), keras.layers.Dropout(0.5, seed=seed), keras.layers.Dense(3)])
model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.0)), keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32"); y = np.zeros(8, int)
model.make_train_function()
losses = []
for i in range(5):
    model.reset_metrics()
    logs = model.train_function([(torch.as_tensor(x), torch.as_tensor(y))])
    losses.append(float(logs["loss"]))
print(sys.argv[1], losses, dict(model.train_function.counts))
