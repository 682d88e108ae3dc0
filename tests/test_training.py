"""THE correctness suite, for the Keras backend in KERAS_BACKEND: N processes x batch b == 1 x N*b.

Every run is a real `mgpu-train` job training a Dense model through `model.fit`; the reference
is the same script on one process with the plain optimizer and the global batch. scripts/test.sh
runs this module once per backend. The runs that need no environment of their own share a job:
the 1-process ones one process, the 2-process ones one `mgpu-train -np 2` job (each config a
fresh model; each test checks its own config's files), since a rank's start-up (importing the
framework) costs more than its training here.
"""

import json
import os

import numpy as np
import pytest

from conftest import (BACKEND, SCRIPTS, assert_ok, explain, launch, launch_ok, rank_weights,
                      jax_processes, requires_mpirun, torchrun)

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.usefixtures("backend")]
only_on = {name: pytest.mark.skipif(BACKEND != name, reason=f"{name}-backend only")
           for name in ("tensorflow", "jax", "torch")}

TRAIN = os.path.join(SCRIPTS, "train.py")
# MGPU_PREFETCH=2: batches come through the device-prefetch thread as on GPUs (off by
# default on CPU), so exactness covers that path too on JAX and torch.
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": BACKEND, "MGPU_PREFETCH": "2"}


def _read(out, count):
    """The weights (by rank, in layer order) and rank.N.json files a run wrote to `out`."""
    weights = [[arr for _, arr in sorted(np.load(out / f"rank.{r}.npz").items(),
                                        key=lambda kv: int(kv[0].split("_")[1]))]
               for r in range(count)]
    info = [json.loads((out / f"rank.{r}.json").read_text()) for r in range(count)]
    return weights, info


def train(tmp_path_factory, config, np_=None, **env):
    out = tmp_path_factory.mktemp("run")
    argv = (["-np", str(np_)] if np_ else []) + [TRAIN, json.dumps(config), str(out)]
    launch_ok(*argv, timeout=300, **QUIET, **env)
    return _read(out, np_ or 1)


def train_each(tmp_path_factory, configs, np_=None, starter="mgpu-train"):
    """One job that trains every config of `configs` (name -> config) in turn, each on a fresh
    model (scripts/train.py with a list): one framework start-up per rank, not one per config.
    `starter`: ``"mgpu-train"`` (over MPI), ``"torchrun"`` (`np_` ranks started by real
    torchrun, no mgpu-train: the torch.distributed control plane) or ``"jax"`` (`np_` plain
    processes with JAX's variables: the jax.distributed control plane).

    Returns:
        name -> (weights by rank, infos by rank), as train() returns them.
    """
    out = tmp_path_factory.mktemp("runs")
    listed = [{"name": name, **config} for name, config in configs.items()]
    script = [TRAIN, json.dumps(listed), str(out)]
    if starter == "torchrun":
        assert_ok(torchrun(np_, *script, timeout=600, **QUIET))
    elif starter == "jax":
        assert_ok(jax_processes(np_, *script, timeout=600, **QUIET))
    else:
        launch_ok(*((["-np", str(np_)] if np_ else []) + script), timeout=600, **QUIET)
    return {name: _read(out / name, np_ or 1) for name in configs}


def assert_same(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def assert_ranks_identical(weights):
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The 1-process runs, in one process: the plain-optimizer references (global batch) every
    distributed run must match, then test_single_process_accumulation's run (last: the plain
    runs come before any DistributedOptimizer in the process)."""
    return train_each(tmp_path_factory, {
        "sgd": {"plain": True},
        "adam": {"plain": True, "optimizer": "adam", "lr": 0.01},
        "sgd_2lr": {"plain": True, "lr": 0.2},
        "sgd_batch16": {"plain": True, "global_batch": 16},
        "accumulation": {"passes": 2, "global_batch": 16},
    })


@pytest.fixture(scope="module")
def reference(one_process):
    """1 process, plain optimizer, global batch: the weights every distributed run must match."""
    return {name: one_process[name][0][0] for name in ("sgd", "adam", "sgd_2lr", "sgd_batch16")}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The 2-process runs of the tests below, in one `mgpu-train -np 2` job (each a fresh model
    and DistributedOptimizer; each test checks its own); "saved" also writes the model that
    test_save_load_continue_equals_uninterrupted loads in a job of its own.

    Returns:
        (name -> (weights by rank, infos by rank), the saved model's path)
    """
    model_path = str(tmp_path_factory.mktemp("ckpt") / "model.keras")
    return train_each(tmp_path_factory, {
        "global_batch": {},
        "adam": {"optimizer": "adam", "lr": 0.01},
        "op_sum": {"op": "sum"},
        "passes": {"passes": 2, "global_batch": 16},
        "fp16": {"compression": "fp16"},
        "seeds": {"seed_per_rank": 1},
        "saved": {"epochs": 2, "save_to": model_path},
    }, np_=2), model_path


def test_two_processes_equal_one_process_with_the_global_batch(two_processes, reference):
    weights, info = two_processes[0]["global_batch"]
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])
    assert info[0]["optimizer"] == "DistributedOptimizer"
    assert info[0]["iterations"] == 3 * 96 // 8  # 3 epochs of 12 global batches
    # Gradients reduced once: no DistributedDataParallel wrapper from Keras >= 3.16 (torch).
    assert info[0]["ddp_wrapper"] == "NoneType"
    # MetricAverageCallback: every rank logs the same (averaged) loss.
    assert info[0]["loss"] == info[1]["loss"]


def test_adam(two_processes, reference):
    weights, _ = two_processes[0]["adam"]
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["adam"])


@pytest.mark.first_backend
def test_op_sum_doubles_the_gradient(two_processes, reference):
    # SGD with momentum is linear in the gradient: summing 2 ranks == averaging with 2x lr.
    weights, _ = two_processes[0]["op_sum"]
    assert_same(weights[0], reference["sgd_2lr"])


def test_backward_passes_per_step(two_processes, reference):
    # 2 ranks x 2 local passes of 4 == one update over a global batch of 16.
    weights, info = two_processes[0]["passes"]
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd_batch16"])
    assert info[0]["iterations"] == 3 * 96 // 16


def test_fp16_compression_is_close(two_processes, reference):
    # fp16 on the wire keeps ~3 significant digits per gradient element.
    weights, _ = two_processes[0]["fp16"]
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"], rtol=1e-2, atol=1e-3)


@pytest.mark.first_backend
def test_different_seeds_start_from_rank_0(two_processes, reference):
    # No BroadcastGlobalVariablesCallback: the optimizer's first step does it.
    weights, _ = two_processes[0]["seeds"]
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


#: the starters without MPI each backend runs under, and the control plane its ranks then meet on
#: (torch under JAX's variables: not supported, docs/torchrun.md)
WITHOUT_MPI = {"torch": [("torchrun", "torch.distributed")],
               "jax": [("jax", "jax.distributed"), ("torchrun", "torch.distributed")]}


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow runs over MPI only")
@pytest.mark.parametrize("starter, plane", WITHOUT_MPI.get(BACKEND, []))
def test_started_without_mpi_two_processes_equal_one_process(tmp_path_factory, reference,
                                                             starter, plane):
    # The same script with no mgpu-train and no MPI. torchrun: the ranks meet at torchrun's TCP
    # store and talk over the gloo group the control plane started (transport_torch); the torch
    # engine reduces over that group, the JAX engine starts jax.distributed on a port rank 0
    # picks and shares over it (not MASTER_PORT: torchrun's store holds that) and reduces with
    # psum over its gloo. jax: two plain processes with JAX's variables meet at JAX's
    # coordination service (transport_jax), the engine's psum over its gloo.
    runs = train_each(tmp_path_factory, {
        "global_batch": {}, "adam": {"optimizer": "adam", "lr": 0.01},
        "passes": {"passes": 2, "global_batch": 16},
    }, np_=2, starter=starter)
    for name, expected in (("global_batch", "sgd"), ("adam", "adam"), ("passes", "sgd_batch16")):
        weights, info = runs[name]
        assert_ranks_identical(weights)
        assert_same(weights[0], reference[expected])
        assert info[0]["optimizer"] == "DistributedOptimizer"
        assert info[0]["loss"] == info[1]["loss"]
        assert [i["control_plane"] for i in info] == [plane, plane]


@only_on["tensorflow"]
def test_mpi_transport(tmp_path_factory, reference):
    weights, _ = train(tmp_path_factory, {}, np_=2, MGPU_TF_TRANSPORT="mpi")
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


def test_save_load_continue_equals_uninterrupted(tmp_path_factory, two_processes, reference):
    # Saved after 2 epochs by the two_processes job; loaded and trained on in a fresh job.
    model_path = two_processes[1]
    weights, info = train(tmp_path_factory, {"epochs": 1, "load_from": model_path}, np_=2)
    assert info[0]["optimizer"] == "DistributedOptimizer"
    assert_ranks_identical(weights)
    assert_same(weights[0], reference["sgd"])


def test_a_parameter_without_gradient_on_one_rank_does_not_hang(tmp_path):
    launch_ok("-np", "2", os.path.join(SCRIPTS, "unused.py"), str(tmp_path), timeout=180, **QUIET)
    weights = rank_weights(tmp_path)
    assert_ranks_identical(weights)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="MGPU_FUSION_MB: JAX and torch engines")
def test_bucket_size_does_not_change_the_result(tmp_path_factory, two_processes):
    one_per_tensor, _ = train(tmp_path_factory, {"optimizer": "adam", "lr": 0.01}, np_=2,
                              MGPU_FUSION_MB="0.00001")
    # All in one bucket: the two_processes job's run of the same config, at the default
    # MGPU_FUSION_MB (JAX 64 MB, torch 25 MB), far above this model's few hundred bytes of
    # gradients (its own job would only repeat that run).
    all_in_one, _ = two_processes[0]["adam"]
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


def test_single_process_accumulation(one_process, reference):
    # No launcher: size 1, no collectives; 2 passes of 8 == one update over 16.
    weights, info = one_process["accumulation"]
    assert_same(weights[0], reference["sgd_batch16"])
    assert info[0]["optimizer"] == "DistributedOptimizer"
