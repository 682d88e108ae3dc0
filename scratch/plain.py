import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "torch")
import keras, torch
from models import *
which = sys.argv[1]; jit = sys.argv[2] == "1"
keras.utils.set_random_seed(1)
if which == "gpt2":
    model = gpt2(); x, y = gpt2_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
else:
    model = convnet(); x, y = conv_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss, jit_compile=jit)
t = time.time()
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
print("epoch1", time.time() - t)
t = time.time()
model.fit(x, y, batch_size=8, epochs=2, verbose=0)
print("epoch2-3 per step", (time.time() - t) / 16)
from torch._dynamo.utils import counters
print({k: dict(v) for k, v in counters.items() if v})
