"""MGPU_TORCH_CUDA_GRAPH on a machine without a GPU: eager, the same numbers, ONE warning.

The capture itself needs CUDA; it is checked on the GPU machine by
benchmarks/torch_cuda_graph/check_same_weights.py (see docs/torch-cuda-graphs.md). Here: the
flag (env or ``DistributedOptimizer(cuda_graph=True)``) falls back cleanly, with one
``CudaGraphFallbackWarning`` naming the reason, and the trained weights equal those of a run
without the flag. The exactness and LR-warm-up suites also pass with the flag set
(``MGPU_TORCH_CUDA_GRAPH=1 KERAS_BACKEND=torch pytest tests/test_training.py
tests/training/test_lr_schedule.py``).
"""

import warnings

import numpy as np
import pytest

from conftest import BACKEND

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(BACKEND != "torch", reason="the torch engine's option"),
              pytest.mark.usefixtures("backend")]


def train(monkeypatch, env=None, **optimizer_options):
    """Fit a tiny model for 6 steps; return its weights and the fallback warnings seen."""
    import keras

    import mgpu_launch as mgpu
    from mgpu_launch.backends.torch.graph import ENV, CudaGraphFallbackWarning

    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    if optimizer_options.pop("loss_scale", False):
        inner = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(optimizer=mgpu.DistributedOptimizer(inner, **optimizer_options), loss="mse",
                  auto_scale_loss=False)
    rng = np.random.default_rng(0)
    x, y = rng.random((24, 4), dtype=np.float32), rng.random((24, 2), dtype=np.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)  # same function
    ours = [str(w.message) for w in seen if issubclass(w.category, CudaGraphFallbackWarning)]
    return [w.numpy() for w in model.weights], ours


def test_the_flag_on_cpu_warns_once_and_changes_no_number(monkeypatch):
    reference, none = train(monkeypatch)
    assert none == []
    weights, fallback = train(monkeypatch, env="1")
    assert len(fallback) == 1, fallback
    assert "MGPU_TORCH_CUDA_GRAPH" in fallback[0] and "no CUDA device" in fallback[0]
    for ours, theirs in zip(weights, reference, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_the_optimizer_argument_overrides_the_environment(monkeypatch):
    _, fallback = train(monkeypatch, env="1", cuda_graph=False)
    assert fallback == []
    _, fallback = train(monkeypatch, env=None, cuda_graph=True)
    assert len(fallback) == 1 and "no CUDA device" in fallback[0]


def test_a_loss_scale_optimizer_is_named_as_the_reason(monkeypatch):
    _, fallback = train(monkeypatch, env="1", loss_scale=True)
    assert len(fallback) == 1 and "LossScaleOptimizer" in fallback[0], fallback


def test_a_bad_warmup_count_is_a_clear_error(monkeypatch):
    from mgpu_launch.backends.torch import graph as torch_graph
    monkeypatch.setenv(torch_graph.WARMUP_ENV, "0")
    with pytest.raises(ValueError, match="expected an integer >= 1"):
        torch_graph.warmup_steps()


@pytest.mark.parametrize("value,dtype", [
    (0.5, None), (3, None), (2 ** 40, None), (True, None), (0.25, "bfloat16"), (7, "float32"),
    ((128, 10), None), ((128, 10), "int32"), ([0.5, 2.0], None), (np.float32(1.5), None),
    (np.array([[1, 2], [3, 4]], np.int16), "float32"), (np.int64(3), "float16")])
def test_a_device_constant_has_keras_dtype_and_value(value, dtype):
    # The capture-time conversion of a step's constants must give what Keras's own gives
    # (keras.ops.convert_to_tensor: the torch backend's, wherever a Keras version keeps it).
    import keras

    from mgpu_launch.backends.torch.graph import device_constant
    ours, keras_own = device_constant(value, dtype), keras.ops.convert_to_tensor(value, dtype)
    assert ours.dtype == keras_own.dtype and ours.device == keras_own.device
    assert ours.shape == keras_own.shape
    assert ours.cpu().tolist() == keras_own.cpu().tolist()


def test_long_arrays_and_tensors_are_left_to_keras():
    import torch

    from mgpu_launch.backends.torch.graph import MAX_CONSTANT_ELEMENTS, device_constant
    assert device_constant(np.zeros(MAX_CONSTANT_ELEMENTS + 1)) is None
    assert device_constant(torch.zeros(2)) is None and device_constant("text") is None


def test_the_eager_steps_before_capture_are_counted(monkeypatch):
    """A failed capture's warning says how many eager steps the model took first (on GPUs
    they can make capture fail: benchmarks/torch_speed/); read from the optimizer."""
    import keras

    import mgpu_launch as mgpu
    from mgpu_launch.backends.torch.graph import _EAGER_FIRST, _steps_taken

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    assert _steps_taken(model) == 0
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert _steps_taken(model) == 2
    assert "2 eager step(s)" in _EAGER_FIRST.format(_steps_taken(model))


def test_the_efficiency_report_suggests_capture_for_an_eager_step_on_a_gpu(monkeypatch):
    """The engine's advice for a step that dominates: capture it, on a GPU only, and not
    when it is captured already or cannot be."""
    import keras
    import torch

    import mgpu_launch as mgpu
    from mgpu_launch.backends.torch.engine import TorchEngine
    from mgpu_launch.training import optimizer_options
    from mgpu_launch.training.efficiency import advice

    def model(**options):
        built = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        built.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1), **options), "mse")
        return built

    def advised(built):  # the options handed down, as the efficiency report hands them
        return TorchEngine().step_advice(built, optimizer_options.step_options(built))

    on_cpu = advised(model())  # this box has no GPU: compiling, not capture
    assert "jit_compile=True" in on_cpu and "cuda_graph" not in on_cpu, on_cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hint = advised(model())
    assert "cuda_graph=True" in hint
    assert "cuda_graph" not in advised(model(cuda_graph=True))
    figures = {"shares": {"input": 0.0, "wait": 0.0, "comm": 0.0, "callbacks": 0.0,
                          "other": 0.0}, "late": None, "ranks": [{}], "step_hint": hint,
               "communication": None}
    assert advice(figures) == ("no cause above 5%: the step itself (compute) dominates; "
                               + hint)
