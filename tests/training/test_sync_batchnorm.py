"""Synchronized BatchNormalization: 2 ranks x batch b == 1 process x batch 2b, on every backend.

One real `mgpu-train -np 2` job per backend (scripts/sync_bn.py) trains the synchronized
model, a local-BatchNorm control and (TensorFlow, torch) an uneven-batch case, each next to
its plain-Keras reference on the global batch; the in-process tests cover one process.
"""

import os

import numpy as np
import pytest

from conftest import SCRIPTS, launch_ok, requires_mpirun

keras = pytest.importorskip("keras")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch.training import patches  # noqa: E402

BACKEND = keras.backend.backend()
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": BACKEND}


def weights_of(results, case):
    count = len([key for key in results if key.startswith(case + ".")])
    return [results[f"{case}.{i}"] for i in range(count)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_bn")
    launch_ok("-np", "2", os.path.join(SCRIPTS, "sync_bn.py"), str(out), timeout=300, **QUIET)
    return [dict(np.load(out / f"rank.{rank}.npz")) for rank in range(2)]


def assert_matches_reference(results, case, weights=14):
    # 14: conv, 2 x BN (gamma, beta, moving mean and variance), 2 x Dense; masked: 8
    actual, expected = weights_of(results, case), weights_of(results, case + "_ref")
    assert len(actual) == len(expected) == weights
    for index, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=f"{case} weight {index}")


@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_two_ranks_equal_one_process_with_the_global_batch(job):
    for results in job:
        assert_matches_reference(results, "sync")
    # Weights and moving statistics identical on every rank, bit for bit.
    for a, b in zip(weights_of(job[0], "sync"), weights_of(job[1], "sync"), strict=True):
        np.testing.assert_array_equal(a, b)


@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_masked_positions_do_not_count(job):
    for results in job:
        assert_matches_reference(results, "masked", weights=8)


@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_local_statistics_do_not_match_so_the_comparison_has_teeth(job):
    worst = max(float(np.max(np.abs(a - e))) for a, e in
                zip(weights_of(job[0], "local"), weights_of(job[0], "local_ref")))
    assert worst > 1e-2


@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_inference_runs_no_collective(job):
    # Rank 1 predicted alone after training: it would have waited forever for rank 0.
    np.testing.assert_allclose(job[1]["predict.0"], job[1]["predict_ref.0"], rtol=1e-5,
                               atol=1e-5)


@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
@pytest.mark.skipif(BACKEND == "jax", reason="the JAX step needs one batch shape on all ranks")
def test_uneven_batches_give_the_global_statistics(job):
    # Rank 0 has 3 samples, rank 1 has 5: the same as one process with the 8.
    for results in job:
        assert_matches_reference(results, "uneven")


@pytest.mark.backend
def test_the_batch_norm_patches_match_the_installed_keras():
    for name in ("batch_norm_init", "batch_norm_moments"):
        assert patches.PATCHES[name].check() is not None


@pytest.mark.backend
def test_one_process_is_plain_batch_normalization():
    # TensorFlow keeps Keras's own synchronized path (a tf.distribute strategy's, here none:
    # local statistics from sums of squares), equal up to rounding; JAX and torch bit for bit.
    same = (np.testing.assert_array_equal if BACKEND != "tensorflow" else
            lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6))
    x = np.random.default_rng(1).normal(3.0, 2.0, size=(8, 4)).astype("float32")
    plain = keras.layers.BatchNormalization(momentum=0.5)
    synced = [mgpu.layers.SyncBatchNormalization(momentum=0.5),
              keras.layers.BatchNormalization(momentum=0.5, synchronized=True)]
    expected = keras.ops.convert_to_numpy(plain(x, training=True))
    for layer in synced:
        assert layer.synchronized
        same(keras.ops.convert_to_numpy(layer(x, training=True)), expected)
        same(keras.ops.convert_to_numpy(layer.moving_mean), plain.moving_mean.numpy())
        same(keras.ops.convert_to_numpy(layer(x, training=False)),
             keras.ops.convert_to_numpy(plain(x, training=False)))


def test_config_round_trip_and_horovod_names():
    layer = mgpu.layers.SyncBatchNormalization(momentum=0.9, epsilon=1e-5)
    again = mgpu.layers.SyncBatchNormalization.from_config(layer.get_config())
    assert again.synchronized and again.momentum == 0.9 and again.epsilon == 1e-5
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is mgpu.layers.SyncBatchNormalization
    import mgpu_launch.keras as hvd
    assert hvd.SyncBatchNormalization is mgpu.layers.SyncBatchNormalization
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)
