import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np
import mgpu_launch as mgpu
mgpu.init()
import keras, torch
sys.path.insert(0, os.path.dirname(__file__))
from models import *
which = sys.argv[1]; jit = {"auto": "auto", "1": True, "0": False}[sys.argv[2]]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
keras.utils.set_random_seed(1)
model = gpt2() if which == "gpt2" else convnet()
x, y = (gpt2_data if which == "gpt2" else conv_data)(n=8 * steps * mgpu.size())
x = keras.tree.map_structure(lambda a: a[mgpu.rank()::mgpu.size()], x); y = y[mgpu.rank()::mgpu.size()]
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.AdamW(1e-3, epsilon=1e-3)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
t = time.time()
model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
print("rank", mgpu.rank(), "fit s", round(time.time() - t, 1), "jit", model.jit_compile, getattr(model.train_function, "counts", None))
from torch._dynamo.utils import counters
print({k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats")})
np.savez(f"/tmp/tc_w_{which}_{sys.argv[2]}_{mgpu.size()}_{mgpu.rank()}.npz", *[np.asarray(w) for w in model.get_weights()])
