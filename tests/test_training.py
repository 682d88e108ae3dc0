"""THE correctness suite, for the Keras backend in KERAS_BACKEND: N processes x batch b == 1 x N*b.

Every run is a real `mgpu-train` job training a Dense model through `model.fit`; the reference
is the same script on one process with the plain optimizer and the global batch. scripts/test.sh
runs this module once per backend.
"""

import json
import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, explain, launch, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.usefixtures("backend")]
only_on = {name: pytest.mark.skipif(BACKEND != name, reason=f"{name}-backend only")
           for name in ("tensorflow", "jax", "torch")}

TRAIN = os.path.join(SCRIPTS, "train.py")
# MGPU_PREFETCH=2: batches come through the device-prefetch thread as on GPUs (off by
# default on CPU), so exactness covers that path too on JAX and torch.
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": BACKEND, "MGPU_PREFETCH": "2"}


def train(tmp_path_factory, config, np_=None, **env):
    out = tmp_path_factory.mktemp("run")
    argv = (["-np", str(np_)] if np_ else []) + [TRAIN, json.dumps(config), str(out)]
    launch_ok(*argv, timeout=300, **QUIET, **env)
    weights = [[arr for _, arr in sorted(np.load(out / f"rank.{r}.npz").items(),
                                        key=lambda kv: int(kv[0].split("_")[1]))]
               for r in range(np_ or 1)]
    info = [json.loads((out / f"rank.{r}.json").read_text()) for r in range(np_ or 1)]
    return weights, info


def assert_same(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def assert_ranks_identical(weights):
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process, plain optimizer, global batch: the weights every distributed run must match."""
    return {
        "sgd": train(tmp_path_factory, {"plain": True})[0][0],
        "adam": train(tmp_path_factory, {"plain": True, "optimizer": "adam", "lr": 0.01})[0][0],
        "sgd_2lr": train(tmp_path_factory, {"plain": True, "lr": 0.2})[0][0],
        "sgd_batch16": train(tmp_path_factory, {"plain": True, "global_batch": 16})[0][0],
    }


def test_two_processes_equal_one_process_with_the_global_batch(tmp_path_factory, reference):
    weights, info = train(tmp_path_factory, {}, np_=2)
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])
    assert info[0]["optimizer"] == "DistributedOptimizer"
    assert info[0]["iterations"] == 3 * 96 // 8  # 3 epochs of 12 global batches
    # Gradients reduced once: no DistributedDataParallel wrapper from Keras >= 3.16 (torch).
    assert info[0]["ddp_wrapper"] == "NoneType"
    # MetricAverageCallback: every rank logs the same (averaged) loss.
    assert info[0]["loss"] == info[1]["loss"]


def test_adam(tmp_path_factory, reference):
    weights, _ = train(tmp_path_factory, {"optimizer": "adam", "lr": 0.01}, np_=2)
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["adam"])


@pytest.mark.first_backend
def test_op_sum_doubles_the_gradient(tmp_path_factory, reference):
    # SGD with momentum is linear in the gradient: summing 2 ranks == averaging with 2x lr.
    weights, _ = train(tmp_path_factory, {"op": "sum"}, np_=2)
    assert_same(weights[0], reference["sgd_2lr"])


def test_backward_passes_per_step(tmp_path_factory, reference):
    # 2 ranks x 2 local passes of 4 == one update over a global batch of 16.
    weights, info = train(tmp_path_factory, {"passes": 2, "global_batch": 16}, np_=2)
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd_batch16"])
    assert info[0]["iterations"] == 3 * 96 // 16


def test_fp16_compression_is_close(tmp_path_factory, reference):
    # fp16 on the wire keeps ~3 significant digits per gradient element.
    weights, _ = train(tmp_path_factory, {"compression": "fp16"}, np_=2)
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"], rtol=1e-2, atol=1e-3)


@pytest.mark.first_backend
def test_different_seeds_start_from_rank_0(tmp_path_factory, reference):
    # No BroadcastGlobalVariablesCallback: the optimizer's first step does it.
    weights, _ = train(tmp_path_factory, {"seed_per_rank": 1}, np_=2)
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


@only_on["tensorflow"]
def test_mpi_transport(tmp_path_factory, reference):
    weights, _ = train(tmp_path_factory, {}, np_=2, MGPU_TF_TRANSPORT="mpi")
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


def test_save_load_continue_equals_uninterrupted(tmp_path_factory, reference):
    model_path = str(tmp_path_factory.mktemp("ckpt") / "model.keras")
    train(tmp_path_factory, {"epochs": 2, "save_to": model_path}, np_=2)
    weights, info = train(tmp_path_factory, {"epochs": 1, "load_from": model_path}, np_=2)
    assert info[0]["optimizer"] == "DistributedOptimizer"
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


def test_a_parameter_without_gradient_on_one_rank_does_not_hang(tmp_path):
    launch_ok("-np", "2", os.path.join(SCRIPTS, "unused.py"), str(tmp_path), timeout=180, **QUIET)
    weights = [list(np.load(tmp_path / f"rank.{r}.npz").values()) for r in range(2)]
    assert_ranks_identical(weights)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="MGPU_FUSION_MB: JAX and torch engines")
def test_bucket_size_does_not_change_the_result(tmp_path_factory):
    one_per_tensor, _ = train(tmp_path_factory, {"optimizer": "adam"}, np_=2,
                              MGPU_FUSION_MB="0.00001")
    all_in_one, _ = train(tmp_path_factory, {"optimizer": "adam"}, np_=2, MGPU_FUSION_MB="1000")
    assert_ranks_identical([one_per_tensor[0], all_in_one[0]])


@pytest.mark.first_backend
def test_different_models_fail_fast_with_the_variable_named(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    result = launch("-np", "2", TRAIN, json.dumps({"extra_units_on_rank1": True}), str(out),
                    timeout=120, **QUIET)
    assert result.returncode != 0
    assert "MismatchError" in result.stderr and "differ between ranks" in result.stderr
    assert "(6, 9)" in result.stderr and "(6, 8)" in result.stderr, explain(result)


@only_on["tensorflow"]
def test_explicit_xla_on_cpu_is_refused_clearly(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla")
    result = launch("-np", "2", TRAIN, json.dumps({"jit_compile": True}), str(out),
                    timeout=120, **QUIET)
    assert result.returncode != 0
    assert "cannot be compiled with XLA" in result.stderr, explain(result)


def test_single_process_accumulation(tmp_path_factory, reference):
    # No launcher: size 1, no collectives; 2 passes of 8 == one update over 16.
    weights, info = train(tmp_path_factory, {"passes": 2, "global_batch": 16})
    assert_same(weights[0], reference["sgd_batch16"])
    assert info[0]["optimizer"] == "DistributedOptimizer"
