"""Single-process checks of the Keras glue: engine choice, argument errors, config round trip."""

import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.backend

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch import backends  # noqa: E402


def test_unknown_backend_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"no engine for the Keras backend 'mxnet'; supported: jax, tensorflow"):
        backends.get_engine("mxnet")


@pytest.mark.parametrize("kwargs, message", [
    ({"op": mgpu.Max}, "expected mgpu.Average or mgpu.Sum"),
    ({"backward_passes_per_step": 0}, "expected an integer >= 1"),
    ({"compression": "int3"}, "expected Compression.none"),
    ({"gradient_predivide_factor": 2.0, "op": mgpu.Sum}, "only with op=mgpu.Average"),
    ({"clipnorm": 1.0}, "set them on the wrapped optimizer"),
])
def test_bad_arguments_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_wraps_only_keras_optimizers():
    with pytest.raises(ValueError, match="wraps a keras.optimizers.Optimizer"):
        mgpu.DistributedOptimizer("sgd")


def test_config_round_trip_and_forwarding():
    inner = keras.optimizers.SGD(0.25, momentum=0.5)
    opt = mgpu.DistributedOptimizer(inner, op=mgpu.Sum, compression=mgpu.Compression.fp16,
                                    backward_passes_per_step=3)
    again = mgpu.DistributedOptimizer.from_config(opt.get_config())
    assert isinstance(again.inner_optimizer, keras.optimizers.SGD)
    assert again.inner_optimizer.momentum == 0.5
    assert (again.op, again.compression.name, again.backward_passes_per_step) == (mgpu.Sum, "fp16", 3)
    opt.learning_rate = 0.125
    assert float(keras.ops.convert_to_numpy(inner.learning_rate)) == 0.125


def test_scale_lr_single_process():
    mgpu.init()
    assert mgpu.scale_lr(0.1) == 0.1


def test_a_loss_scaler_around_it_is_refused():
    # compile() adds such a wrapper under mixed_float16: its finite-check would see local
    # gradients, so ranks could disagree on skipping a step.
    opt = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1))
    outer = keras.optimizers.LossScaleOptimizer(opt)
    variable = keras.Variable(1.0)
    with pytest.raises(ValueError, match="auto_scale_loss=False"):
        outer.build([variable])


def test_wrapping_a_loss_scaler_is_fine():
    opt = mgpu.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    variable = keras.Variable(1.0)
    opt.build([variable])
    assert float(keras.ops.convert_to_numpy(opt.scale_loss(1.0))) == 2.0 ** 15
