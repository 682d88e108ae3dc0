"""The TensorFlow engine reduces tensors whose static shape TensorFlow does not know (issue 48).

A Dense kernel's gradient on 3-D inputs has static shape ``(None, n)`` when the batch size is
unknown at trace time (keras-hub's ``Task.fit``, a tf.data without ``drop_remainder``,
``mgpu.data.shard``): the optimizer's reduction gives it its variable's shape
(tests/test_exactness_matrix.py trains such models); here the engine's allreduce itself, on
tensors of unknown shape traced in a tf.function, split back by their run-time sizes.
"""

import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's static shapes")]


def test_allreduce_of_tensors_of_unknown_shape_sums_each_tensor(tmp_path):
    launch_ok("-np", "2", os.path.join(SCRIPTS, "unknown_shapes.py"), str(tmp_path),
              timeout=240, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    for rank in range(2):
        with np.load(tmp_path / f"rank{rank}.npz") as saved:
            rows, fixed, vector = (saved[f"arr_{i}"] for i in range(3))
        np.testing.assert_array_equal(rows, np.full((4, 3), 3.0, np.float32))
        np.testing.assert_array_equal(fixed, np.full((2, 2), 3.0, np.float32))
        np.testing.assert_array_equal(vector, np.arange(5, dtype=np.float64) * 3)
