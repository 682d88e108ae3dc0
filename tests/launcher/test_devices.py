"""GPU visibility and per-worker pinning (no GPU needed: driven by CUDA_VISIBLE_DEVICES)."""

import pytest

from mgpu_launch.config.devices import PinningError, keras_backend, pin_gpu, visible_gpus
from mgpu_launcher.worker import pins_by_visible_devices


def pin(local_rank, local_size, environ):
    """As the worker pins: the rule from the backend's facts (backends/<name>/__init__.py)."""
    return pin_gpu(local_rank, local_size, environ,
                   by_visible_devices=pins_by_visible_devices(environ))


@pytest.mark.parametrize("value, expected", [
    ("0,1", ["0", "1"]), ("3", ["3"]), ("", []), ("-1", []),
    ("GPU-5ad1,GPU-77aa", ["GPU-5ad1", "GPU-77aa"]),
])
def test_visible_gpus_follow_cuda_visible_devices(value, expected):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == expected


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_pinning_sets_cuda_visible_devices(backend):
    environ = {"CUDA_VISIBLE_DEVICES": "4,5", "KERAS_BACKEND": backend}
    assert pin(1, 2, environ) == "5"
    assert environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert environ["MGPU_LOCAL_DEVICE"] == "1" and environ["MGPU_GPU"] == "5"


def test_jax_keeps_every_gpu_visible():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "KERAS_BACKEND": "jax"}
    assert pin(1, 2, environ) == "1"
    assert environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert environ["MGPU_LOCAL_DEVICE"] == "1"


def test_a_backend_without_an_engine_is_pinned_by_cuda_visible_devices():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "KERAS_BACKEND": "openvino"}
    assert pin(1, 2, environ) == "1" and environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_gpu_pins_nothing():
    environ = {"CUDA_VISIBLE_DEVICES": ""}
    assert pin_gpu(0, 2, environ) is None
    assert "MGPU_GPU" not in environ


def test_more_workers_than_gpus_is_an_error():
    with pytest.raises(PinningError, match="3 workers on this host but only 2 visible GPU"):
        pin_gpu(0, 3, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_keras_backend_from_variable_then_config(tmp_path):
    assert keras_backend({"KERAS_BACKEND": "jax"}) == "jax"
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert keras_backend({"KERAS_HOME": str(tmp_path)}) == "torch"
    assert keras_backend({"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"
