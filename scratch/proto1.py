import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np, keras, torch
from torch.fx.experimental.proxy_tensor import make_fx
from models import *
which = sys.argv[1]
keras.utils.set_random_seed(1)
if which == "gpt2":
    model = gpt2(); x, y = gpt2_data()
else:
    model = convnet(); x, y = conv_data()
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss)
model.fit(x, y, batch_size=8, epochs=1, verbose=0, steps_per_epoch=1)  # build everything
fn = model.make_train_function()
fn = model.train_function

def all_variables(model):
    seen, out = set(), []
    for v in list(model.variables) + list(model.optimizer.variables) + list(model.metrics_variables):
        if id(v) not in seen:
            seen.add(id(v)); out.append(v)
    return out

variables = all_variables(model)
print("variables", len(variables))
batch = (
    {k: torch.as_tensor(v[:8]) for k, v in x.items()} if isinstance(x, dict) else torch.as_tensor(x[:8]),
    torch.as_tensor(y[:8]),
)
from keras import tree
flat_data = tree.flatten(batch)

def pure(state, data):
    mapping = list(zip(variables, state))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = fn([tree.pack_sequence_as(batch, data)])
        for v, t in mapping:
            new = scope.get_current_value(v)
            if new is not None and new is not t:
                with torch.no_grad():
                    t.copy_(new)
    return logs

state = [v.value for v in variables]
t = time.time()
gm = make_fx(pure, tracing_mode="fake", _allow_non_fake_inputs=False)(state, flat_data)
print("trace s", time.time() - t)
print(len(gm.graph.nodes), "nodes")
import collections; print(collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function").most_common(60))
