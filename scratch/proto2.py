import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np, keras, torch
from torch.fx.experimental.proxy_tensor import make_fx
from keras import tree
from models import *
which, backend_ = sys.argv[1], sys.argv[2]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 20

def build():
    keras.utils.set_random_seed(1)
    if which == "gpt2":
        model = gpt2(); x, y = gpt2_data(n=8 * (STEPS + 1))
    else:
        model = convnet(); x, y = conv_data(n=8 * (STEPS + 1))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss)
    return model, x, y

def batches(x, y):
    for i in range(STEPS + 1):
        s = slice(8 * i, 8 * i + 8)
        xb = {k: torch.as_tensor(v[s]) for k, v in x.items()} if isinstance(x, dict) else torch.as_tensor(x[s])
        yield (xb, torch.as_tensor(y[s]))

def all_variables(model):
    seen, out = set(), []
    for v in list(model.variables) + list(model.optimizer.variables) + list(model.metrics_variables):
        if id(v) not in seen:
            seen.add(id(v)); out.append(v)
    return out

def run(compiled):
    model, x, y = build()
    model.make_train_function()
    fn = model.train_function
    it = batches(x, y)
    first = next(it)
    t0 = time.time()
    fn([first])  # eager step 1: builds optimizer slots, metrics
    variables = all_variables(model)
    step = None
    times = []
    for i, batch in enumerate(it):
        t = time.time()
        flat = tree.flatten(batch)
        if compiled:
            if step is None:
                n = len(variables)
                keys = None
                def pure(*args):
                    state, data = args[:n], args[n:]
                    mapping = list(zip(variables, state))
                    with keras.StatelessScope(state_mapping=mapping) as scope:
                        logs = fn([tree.pack_sequence_as(batch, data)])
                        for v, t_ in mapping:
                            new = scope.get_current_value(v)
                            if new is not None and new is not t_:
                                with torch.no_grad():
                                    t_.copy_(new)
                    nonlocal keys
                    keys = sorted(logs)
                    return [logs[k] for k in keys]
                state = [v.value.detach().requires_grad_(v.value.requires_grad) for v in variables]
                gm = make_fx(pure, tracing_mode="fake")(*state, *flat)
                step = gm if backend_ == "fx" else torch.compile(gm, backend=backend_, fullgraph=True, dynamic=False)
            with torch.no_grad():
                logs = dict(zip(keys, step(*[v.value for v in variables], *flat)))
        else:
            logs = fn([batch])
        float(logs["loss"])
        times.append(time.time() - t)
    w = [np.array(v.numpy()) for v in model.weights]
    return w, times

from torch._dynamo.utils import counters
e, et = run(False)
c, ct = run(True)
diffs = [(i, w.shape, float(np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(a)))), float(np.max(np.abs(a)))) for i, (w, a, b) in enumerate(zip(e, e, c))]; print([d for d in diffs if d[2] > 1e-5]); diff = max(float(np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(a)))) for a, b in zip(e, c))
print(f"{which} {backend_}: eager first {et[0]:.3f}s steady {np.median(et[2:])*1e3:.1f} ms; compiled first {ct[0]:.2f}s steady {np.median(ct[2:])*1e3:.1f} ms; max rel diff {diff:.3g}")
print({k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats", "frames")})
