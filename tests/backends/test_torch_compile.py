"""The compiled torch train step (mgpu_launch.backends.torch.compiled, issue 63 items 2-3).

On one process, in this process: a tiny keras-hub GPT-2 causal LM and a small conv net are
compiled ONCE (one trace, one dynamo graph, no graph break, no recompile) and then run
compiled; their weights after the steps equal the eager step's up to float32 rounding (the
compiler fuses and reorders sums; ``ROUNDING`` says how much). A layer that reads
a tensor on the host makes the step fall back to eager with ONE line; `jit_compile` and
MGPU_TORCH_COMPILE choose the path. The two-process compiled step (the allreduce inside the
graph) is the exactness matrix's, run with MGPU_TORCH_COMPILE=1 (docs/torch-compile.md).
"""

import numpy as np
import pytest

from conftest import BACKEND

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's compiled step")]

STEPS = 5  #: updates per fit (batch 8)
#: compiled vs eager: the compiler fuses and reorders float32 sums, so the weights differ by
#: roundings (the exactness matrix's float32 tolerance). Adam's epsilon is 1e-3, as in
#: tests/scripts/exactness_hub.py: GPT-2's attention key biases have a zero gradient in exact
#: arithmetic, and with Keras's 1e-7 their rounding noise (~1e-9) would move them by ~1e-5
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def _gpt2():
    import keras
    import keras_hub
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=8)
    model = keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 40, size=(8 * STEPS, 9)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8 * STEPS, 8), bool)}
    return model, x, ids[:, 1:]


def _convnet():
    import keras
    model = keras.Sequential([
        keras.Input((12, 12, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
    rng = np.random.default_rng(0)
    return (model, rng.normal(size=(8 * STEPS, 12, 12, 3)).astype("float32"),
            rng.integers(0, 5, size=8 * STEPS))


class _ReadsOnHost:
    """A layer that reads a tensor on the host (float()): it cannot be traced."""

    def __new__(cls):
        import keras

        class ReadsOnHost(keras.layers.Layer):
            def call(self, x):
                scale = float(keras.ops.convert_to_numpy(keras.ops.max(keras.ops.abs(x))))
                return x / (1.0 + 0.0 * scale)

            def compute_output_shape(self, shape):  # no symbolic call (it would read too)
                return shape
        return ReadsOnHost()


def _planted():
    import keras
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              _ReadsOnHost(), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(8 * STEPS, 6)).astype("float32"), \
        rng.integers(0, 3, size=8 * STEPS)


def _train(make, jit_compile, distributed=True):
    """(weights after STEPS updates, the train function) of a fresh model from `make`."""
    import keras

    import mgpu_launch as mgpu

    keras.utils.set_random_seed(1)
    model, x, y = make()
    optimizer = keras.optimizers.AdamW(1e-3, epsilon=1e-3)
    if distributed:
        optimizer = mgpu.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], model.train_function


@pytest.mark.parametrize("make", [_gpt2, _convnet], ids=["gpt2", "convnet"])
def test_the_step_compiles_once_without_graph_breaks(make):
    import torch
    from torch._dynamo.utils import counters

    from mgpu_launch.backends.reduction import StepPath
    from mgpu_launch.backends.torch.compiled import CompiledTrainStep
    from mgpu_launch.backends.torch.step_path import path_of

    if make is _gpt2:
        pytest.importorskip("keras_hub")
    torch._dynamo.reset()
    counters.clear()
    weights, step = _train(make, jit_compile=True)
    assert isinstance(step, CompiledTrainStep) and step.fallback is None, step.fallback
    # one eager step (it builds the optimizer's slots), one trace, the rest compiled
    assert dict(step.counts) == {"eager": 1, "traced": 1, "compiled": STEPS - 1}
    assert path_of(step) == StepPath("compiled", ready=True, fallback=None)  # what benches say
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    eager, _ = _train(make, jit_compile=False)
    for index, (ours, theirs) in enumerate(zip(weights, eager, strict=True)):
        np.testing.assert_allclose(ours, theirs, err_msg=f"weight #{index}", **ROUNDING)
    assert not all(np.array_equal(a, b) for a, b in zip(weights, _initial(make)))


def _initial(make):
    import keras
    keras.utils.set_random_seed(1)
    return [np.asarray(w) for w in make()[0].get_weights()]


def test_an_untraceable_layer_falls_back_to_eager_with_one_line(capfd):
    from mgpu_launch.backends.torch.compiled import FALLBACK_PREFIX
    from mgpu_launch.backends.torch.step_path import path_of

    capfd.readouterr()
    weights, step = _train(_planted, jit_compile=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if FALLBACK_PREFIX in line]
    assert len(lines) == 1, lines
    assert "tracing failed" in lines[0] and "jit_compile=False" in lines[0], lines[0]
    assert step.counts["compiled"] == 0 and step.counts["eager"] == STEPS, step.counts
    path = path_of(step)  # what mgpu-bench's step_path / step_fallback record
    assert path.name == "eager" and path.ready and path.fallback == step.fallback, path
    eager, _ = _train(_planted, jit_compile=False)
    for ours, theirs in zip(weights, eager, strict=True):  # the same eager step: bit for bit
        np.testing.assert_array_equal(ours, theirs)


def test_a_loss_scale_optimizer_is_named_without_tracing(capfd):
    import keras

    import mgpu_launch as mgpu
    from mgpu_launch.backends.torch.compiled import FALLBACK_PREFIX

    model, x, y = _planted()
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1))), loss="sparse_categorical_crossentropy", jit_compile=True,
        auto_scale_loss=False)
    capfd.readouterr()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    lines = [line for line in capfd.readouterr().err.splitlines() if FALLBACK_PREFIX in line]
    assert len(lines) == 1 and "LossScaleOptimizer" in lines[0], lines
    assert model.train_function.counts == {"eager": STEPS}


def test_the_step_path_is_ready_once_the_compiled_program_ran():
    """What mgpu-bench's warm-up clock asks after every step (``Engine.step_path``): not ready
    before the compiled step's first compiled run, eager when capture is impossible here (no
    CUDA device: its reason kept), eager and ready with no step made."""
    import keras

    import mgpu_launch as mgpu
    from mgpu_launch.backends.reduction import StepOptions, StepPath
    from mgpu_launch.backends.torch.compiled import CompiledTrainStep
    from mgpu_launch.backends.torch.graph import GraphedTrainStep
    from mgpu_launch.backends.torch.step_path import path_of

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    step = CompiledTrainStep(model, lambda data: {}, StepOptions())
    assert path_of(step) == StepPath("compiled", ready=False)
    step.counts.update(eager=1, traced=1, compiled=1)  # the second step: traced and ran
    assert path_of(step) == StepPath("compiled", ready=True)
    captured = GraphedTrainStep(model, step, StepOptions(cuda_graph=True), is_chief=False)
    path = path_of(captured)
    assert path.name == "compiled" and path.fallback.startswith("capture: "), path
    assert path_of(None) == StepPath("eager", ready=True)


@pytest.mark.parametrize("setting, jit_compile, expected", [
    (None, "auto", False),  # CPU: off by default (docs/torch-compile.md says why)
    ("1", "auto", True), ("0", "auto", False),
    ("1", False, False),  # the model's own choice wins
    ("0", True, True)])
def test_jit_compile_and_the_setting_choose_the_path(monkeypatch, setting, jit_compile,
                                                      expected):
    import keras

    import mgpu_launch as mgpu

    if setting is None:
        monkeypatch.delenv("MGPU_TORCH_COMPILE", raising=False)
    else:
        monkeypatch.setenv("MGPU_TORCH_COMPILE", setting)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse",
                  jit_compile=jit_compile)
    assert model.jit_compile is expected
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    plain.compile(keras.optimizers.SGD(0.1), "mse")  # not ours: Keras's own "auto" (eager)
    assert plain.jit_compile is False


def test_evaluate_and_predict_stay_eager_under_jit_compile():
    # Keras's own torch.compile of its step functions is not used for our models: the train
    # step is ours (wrapped at fit), evaluate and predict run eagerly.
    import keras

    import mgpu_launch as mgpu

    def made(optimizer):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer, "mse", jit_compile=True)
        model.make_test_function()
        model.make_predict_function()
        return model

    ours = made(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    assert not hasattr(ours.test_function, "__wrapped__")  # torch.compile's wrapper has it
    assert not hasattr(ours.predict_function, "__wrapped__")
    plain = made(keras.optimizers.SGD(0.1))  # Keras's own choice, untouched
    assert hasattr(plain.test_function, "__wrapped__")


# The "every fallback trains correctly and prints its one line": one tiny model per
# case the compiled step may not handle. Each either compiles (traces) and ends within
# ROUNDING of Keras's eager step -- the compiler reorders float32 sums, nothing else differs --
# or falls back with exactly one line naming why, and then trains bit for bit as eager does
# (the same eager step; the failed trace changed no variable).


def _masked():  # Embedding(mask_zero=True) + LSTM: the mask reaches the recurrence
    import keras
    model = keras.Sequential([keras.Input((5,), dtype="int32"),
                              keras.layers.Embedding(12, 4, mask_zero=True),
                              keras.layers.LSTM(3), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 12, size=(8 * STEPS, 5))
    ids[:, 3:] *= rng.integers(0, 2, size=(8 * STEPS, 1))  # half the rows: 2 padded tokens
    return model, ids.astype("int32"), rng.integers(0, 3, size=8 * STEPS)


def _renorm():  # BatchNormalization(renorm=True): its r/d corrections and moving statistics
    import keras
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(renorm=True),
                              keras.layers.Activation("relu"), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(8 * STEPS, 6)).astype("float32"), \
        rng.integers(0, 3, size=8 * STEPS)


def _last_batch_of_one():  # 8 * STEPS + 1 samples: the last batch holds one (a 2nd signature)
    import keras
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(8 * STEPS + 1, 6)).astype("float32"), \
        rng.integers(0, 3, size=8 * STEPS + 1)


def _float64():  # every weight float64 (a dtype policy of the layers)
    import keras
    model = keras.Sequential([keras.Input((6,), dtype="float64"),
                              keras.layers.Dense(8, activation="tanh", dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(8 * STEPS, 6)), rng.integers(0, 3, size=8 * STEPS)


def _custom_train_step():  # a Model subclass with its own torch train_step
    import keras

    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            predicted = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=predicted)
            loss.backward()
            trainable = self.trainable_weights
            self.optimizer.apply([v.value.grad for v in trainable], trainable)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    rng = np.random.default_rng(0)
    return Custom(inputs, outputs), rng.normal(size=(8 * STEPS, 6)).astype("float32"), \
        rng.integers(0, 3, size=8 * STEPS)



@pytest.mark.parametrize("make, expected", [
    pytest.param(_masked, {"eager": 1, "traced": 1, "compiled": STEPS - 1}, id="masked-lstm",
                 marks=pytest.mark.slow),  # an LSTM of 5 steps unrolled: ~40 s to compile
    pytest.param(_renorm, {"eager": 1, "traced": 1, "compiled": STEPS - 1}, id="renorm"),
    # the last batch is a new signature: traced and compiled once more, then it runs compiled
    pytest.param(_last_batch_of_one, {"eager": 1, "traced": 2, "compiled": STEPS},
                 id="last-batch-of-1"),
    pytest.param(_float64, "float64 weights", id="float64"),
    pytest.param(_custom_train_step, {"eager": 1, "traced": 1, "compiled": STEPS - 1},
                 id="custom-train-step")])
def test_each_hard_case_compiles_like_eager_or_falls_back_with_one_line(capfd, make, expected):
    """`expected`: the compiled step's counts, or the words its one fallback line names.
    Renorm's first Dense bias has a zero gradient in exact arithmetic (the BatchNormalization
    after it subtracts the batch mean), so both paths move it by rounding noise only (~4e-9):
    ROUNDING's atol, not a relative bound, covers it."""
    from mgpu_launch.backends.torch.compiled import FALLBACK_PREFIX
    from mgpu_launch.backends.torch.step_path import path_of

    capfd.readouterr()
    weights, step = _train(make, jit_compile=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if FALLBACK_PREFIX in line]
    eager, _ = _train(make, jit_compile=False)
    if isinstance(expected, dict):
        assert not lines and step.fallback is None, lines
        assert dict(step.counts) == expected and path_of(step).name == "compiled"
        for index, (ours, theirs) in enumerate(zip(weights, eager, strict=True)):
            np.testing.assert_allclose(ours, theirs, err_msg=f"weight #{index}", **ROUNDING)
    else:
        assert len(lines) == 1 and expected in lines[0], lines
        assert step.counts["compiled"] == 0, step.counts
        for ours, theirs in zip(weights, eager, strict=True):  # the same eager step
            np.testing.assert_array_equal(ours, theirs)
    assert not all(np.array_equal(a, b) for a, b in zip(weights, _initial(make)))
