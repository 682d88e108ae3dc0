"""The exactness matrix (issue 25), for the Keras backend in KERAS_BACKEND: for each optimizer
and model kind people train, N processes x batch b give the weights of 1 process x batch N*b.

One `mgpu-train -np 2` job runs every case in sequence (scripts/exactness.py: each case builds
a fresh model, trains STEPS updates through a DistributedOptimizer and, on one rank, once more
with the plain optimizer on the global batch as the reference); the tests compare the files.
A second, smaller job runs one case at np=4. On the torch backend one more start runs every
case, sharded state included, under real ``torchrun --nproc-per-node 2`` (no MPI: the
torch.distributed control plane).

Tolerances. Float32 cases: rtol 1e-5 (atol 1e-6 for weights that end near zero), as in
tests/test_training.py: the only difference between the runs is the order of float32 sums.
Mixed precision (mixed_float16 with a LossScaleOptimizer, mixed_bfloat16) is held to two
references. (1) One process accumulating the ranks' batches one after the other (Keras's
gradient_accumulation_steps=N, batch b): the same low-precision forward and backward passes,
float32 sums of their gradients: rtol 1e-5 (measured: bit-identical on all three backends).
(2) One process with the batch of N*b: there each gradient is summed in low precision over N*b
samples instead of b, so gradients differ by roundings of float16 (unit roundoff 2**-11 =
4.9e-4) or bfloat16 (2**-8 = 3.9e-3), and Adam, which normalizes each element, leaves an
element near zero no relative precision (measured up to 9e-4 elementwise in float16, 1.6e-2 in
bfloat16). So that comparison bounds each tensor's largest difference, relative to its largest
weight, by one unit roundoff (measured: float16 1.2e-5 to 6.7e-5, bfloat16 2.7e-4 to 5.4e-4;
Keras alone, batch 8 vs 2 passes of 4, differs by the same amounts). docs/training-recipe.md,
"Mixed precision", has the figures.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, assert_ok, launch_ok, requires_mpirun, torchrun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.usefixtures("backend")]

WORKER = os.path.join(SCRIPTS, "exactness.py")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": BACKEND}
#: the cases scripts/exactness.py knows (vision_sync_bn: synchronized BatchNorm, issue 25 item 3;
#: tests/training/test_sync_batchnorm.py has its uneven-batch, mask and inference cases)
CASES = ["sgd_momentum", "adam", "adamw", "rmsprop", "clipnorm", "global_clipnorm",
         "embedding_adam", "embedding_int64_ids", "transformer_adamw",
         "lstm", "accumulation", "mixed_float16", "mixed_bfloat16", "vision_sync_bn"]
if BACKEND == "tensorflow":
    CASES.append("raw_tf_variable")  # issue 25 item 4
#: issue 48: a Dense on 3-D inputs fed by mgpu.data.shard (an unknown batch size on TF), and
#: keras-hub transformers (GPT-2 causal LM, BERT classifier, BERT + LoRA), each fed as arrays
#: to Task.fit, through mgpu.data.shard and as a tf.data without drop_remainder
#: (tests/scripts/exactness_hub.py says why their AdamW takes epsilon 1e-3)
CASES.append("dense_3d_shard")
HUB_CASES = [f"{model}_{feed}" for model in ("gpt2_lm", "bert_classifier", "bert_lora")
             for feed in ("split", "shard", "tfdata")]
if importlib.util.find_spec("keras_hub"):  # not imported here: it imports TensorFlow
    CASES += HUB_CASES
else:
    CASES += [pytest.param(case, marks=pytest.mark.skip(reason="keras-hub is not installed "
                                                         "(pip install keras-hub)"))
              for case in HUB_CASES]
#: a float16 / bfloat16 unit roundoff, relative to each tensor's largest weight (docstring)
TOLERANCE = {"mixed_float16": {"per_tensor": 2.0 ** -11},
             "mixed_float16_overflow": {"per_tensor": 2.0 ** -11},
             "mixed_bfloat16": {"per_tensor": 2.0 ** -8}}
#: cases also compared with Keras's own accumulation of the ranks' batches (ranks_as_passes)
RANKS_AS_PASSES = {"mixed_float16", "mixed_bfloat16"}
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}
#: torch with its step compiled (MGPU_TORCH_COMPILE=1 forces it on CPU; docs/torch-compile.md):
#: the reference runs eagerly, and the float32 cases still agree at FLOAT32 (the compiler only
#: reorders float32 sums). In mixed_bfloat16, inductor computes a fused kernel's bfloat16 ops in
#: float32 and rounds once at its end where eager Keras rounds after every op, so the ranks'
#: weights differ from the eager accumulation by bfloat16 roundings, not float32 ones: measured
#: 3.1e-4 of each tensor's largest weight (2026-11-29, CPU), bounded like the batch-of-N*b
#: reference by one bfloat16 unit roundoff.
COMPILED = BACKEND == "torch" and os.environ.get("MGPU_TORCH_COMPILE") == "1"
ACCUMULATED = {"mixed_bfloat16": TOLERANCE["mixed_bfloat16"]} if COMPILED else {}


def names(cases):
    return [case.values[0] if hasattr(case, "values") else case for case in cases]


def run_job(directory, cases, np_, **env):
    runnable = [case for case in cases if not getattr(case, "marks", ())]
    return launch_ok("-np", str(np_), WORKER, json.dumps(names(runnable)), str(directory),
                     timeout=1500, **QUIET, **env)


#: what an npz holds besides the weights (arr_0, arr_1, ...)
STATE_KEYS = ("iterations", "learning_rate", "state_bytes")


def load(path):
    with np.load(path) as saved:
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files) - len(STATE_KEYS))]
        return weights, {key: saved[key] for key in STATE_KEYS}


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("exactness")
    run_job(directory, CASES, 2)
    return directory


def check_case(directory, case, np_):
    reference, expected = load(directory / f"{case}.reference.npz")
    ranks = [load(directory / f"{case}.rank{r}.npz") for r in range(np_)]
    for weights, _ in ranks[1:]:  # every rank holds the same weights, bit for bit
        for ours, theirs in zip(ranks[0][0], weights, strict=True):
            np.testing.assert_array_equal(ours, theirs)
    weights, state = ranks[0]
    tolerance = TOLERANCE.get(case, FLOAT32)
    for index, (ours, theirs) in enumerate(zip(weights, reference, strict=True)):
        if "per_tensor" in tolerance:
            worst = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
            assert worst <= tolerance["per_tensor"], (case, index, worst)
        else:
            np.testing.assert_allclose(ours, theirs, err_msg=f"{case} weight #{index}",
                                       **tolerance)
    # Updates counted and learning rate read as Keras's own optimizer does (with accumulation:
    # Keras's gradient_accumulation_steps, whose schedule sees every backward pass).
    assert int(state["iterations"]) == int(expected["iterations"]), case
    np.testing.assert_allclose(state["learning_rate"], expected["learning_rate"], rtol=1e-6)
    if case in RANKS_AS_PASSES:  # the same float16 arithmetic as the ranks': float32 tolerance
        accumulated = load(directory / f"{case}.accumulated.npz")[0]
        for index, (ours, theirs) in enumerate(zip(weights, accumulated, strict=True)):
            if case in ACCUMULATED:  # compiled: fused roundings (COMPILED says why)
                worst = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
                assert worst <= ACCUMULATED[case]["per_tensor"], (case, index, worst)
                continue
            np.testing.assert_allclose(ours, theirs, err_msg=f"{case} weight #{index}",
                                       **FLOAT32)


@pytest.mark.job
@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one_process(two_process_job, case):
    check_case(two_process_job, case, 2)


@pytest.mark.first_backend
@pytest.mark.job
def test_four_processes_match_one_process(tmp_path):
    run_job(tmp_path, ["transformer_adamw"], 4)
    check_case(tmp_path, "transformer_adamw", 4)


#: the cases with an Embedding: their gradients are IndexedSlices on TensorFlow
SPARSE_CASES = ["embedding_adam", "embedding_int64_ids", "transformer_adamw"]


@pytest.mark.job
@pytest.mark.skipif(BACKEND != "tensorflow", reason="IndexedSlices gradients are TensorFlow's")
def test_sparse_gradients_through_the_xla_compatible_gather(tmp_path):
    # The path a default fit takes on GPUs (jit_compile="auto" is XLA there), forced on the CPU,
    # which cannot compile collectives: fixed-size buffers, zero-valued padding slices. The
    # worker refuses the dynamic gather, so this fails if the static path is not the one taken.
    run_job(tmp_path, SPARSE_CASES, 2, MGPU_TF_SPARSE_GATHER="static", EXACTNESS_STATIC_ONLY="1")
    for case in SPARSE_CASES:
        check_case(tmp_path, case, 2)


# -- single process, in this process: the paths that need no second rank ------------------------
def _small_model(optimizer, policy="float32", run_eagerly=False):
    """A compiled MLP, its weights the same at every call, and its 32 samples."""
    keras = pytest.importorskip("keras")
    keras.mixed_precision.set_global_policy(policy)  # read by the layers as they are made
    try:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3, dtype="float32")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng(3)
    model.set_weights([rng.normal(size=w.shape) * 0.3 for w in model.weights])
    model.compile(optimizer=optimizer, auto_scale_loss=False, run_eagerly=run_eagerly,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, size=32)


def _fit_small_model(optimizer, passes=1, policy="float32", run_eagerly=False):
    """The weights after 4 updates of 8 samples (in `passes` backward passes each)."""
    model, x, y = _small_model(optimizer, policy, run_eagerly)
    model.fit(x, y, batch_size=8 // passes, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def test_loss_scaled_optimizer_inside_is_plain_keras_on_one_process():
    # Issue 25 item 2: on JAX this crashed (a tracer leaked from the loss scaler's cond).
    import keras

    import mgpu_launch as mgpu

    ours = mgpu.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0 ** 10, dynamic_growth_steps=2))
    weights = _fit_small_model(ours, policy="mixed_float16")
    plain = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                initial_scale=2.0 ** 10, dynamic_growth_steps=2)
    expected = _fit_small_model(plain, policy="mixed_float16")
    for a, b in zip(weights, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    # 4 steps, the scale doubled every 2 finite ones: the loss scaler's own state moved too.
    assert float(ours.inner_optimizer.dynamic_scale.numpy()) == 2.0 ** 12
    assert int(ours.iterations.numpy()) == 4


class _RecordingSchedule:
    """An ExponentialDecay that also records every step it is called with (eager steps)."""

    def __new__(cls, calls):
        import keras

        class Recording(keras.optimizers.schedules.ExponentialDecay):
            def __call__(self, step):
                calls.append(int(np.asarray(keras.ops.convert_to_numpy(step))))
                return super().__call__(step)
        return Recording(0.02, decay_steps=1, decay_rate=0.8)


@pytest.mark.skipif(BACKEND == "jax", reason="records steps in Python: an eager step "
                    "(JAX traces even then; the matrix's accumulation case covers it)")
def test_a_schedule_sees_the_backward_passes_as_under_keras_accumulation():
    # Issue 25 item 5: Keras's gradient_accumulation_steps calls the schedule with the number
    # of backward passes (and counts iterations in updates); ours must do the same.
    import keras

    import mgpu_launch as mgpu

    ours_calls, keras_calls = [], []
    ours = mgpu.DistributedOptimizer(keras.optimizers.Adam(_RecordingSchedule(ours_calls)),
                                     backward_passes_per_step=2)
    weights = _fit_small_model(ours, passes=2, run_eagerly=True)
    plain = keras.optimizers.Adam(_RecordingSchedule(keras_calls), gradient_accumulation_steps=2)
    expected = _fit_small_model(plain, passes=2, run_eagerly=True)
    assert ours_calls == keras_calls and ours_calls[:4] == [1, 3, 5, 7], (ours_calls, keras_calls)
    assert int(ours.iterations.numpy()) == int(plain.iterations.numpy()) == 4
    rates = [float(keras.ops.convert_to_numpy(o.learning_rate)) for o in (ours, plain)]
    assert rates[0] == rates[1], rates
    for a, b in zip(weights, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("passes", [1, 2])
def test_lr_multiplier_reaches_a_schedule_under_the_loss_scaler(passes):
    # The LR callbacks' multiplier lives in the DistributedOptimizer; the schedule it scales is
    # the innermost optimizer's, two stateless scopes deeper on JAX (it must not be a constant).
    import keras

    import mgpu_launch as mgpu
    from mgpu_launch.training.callbacks import schedule

    ours = mgpu.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.8))),
        backward_passes_per_step=passes)
    assert schedule.lr_target(ours) == ("multiplier", ours.lr_multiplier)
    model, x, y = _small_model(ours, policy="mixed_float16")
    before = [np.asarray(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=8 // passes, epochs=1, shuffle=False, verbose=0)
    moved = [np.asarray(w) for w in model.get_weights()]
    assert not any(np.array_equal(a, b) for a, b in zip(before, moved))
    ours.lr_multiplier.assign(0.0)  # what a callback does: now Adam's steps are zero
    model.fit(x, y, batch_size=8 // passes, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(moved, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(ours.iterations.numpy()) == 8
    ours.lr_multiplier.assign(1.0)  # the rate read between steps: the schedule at every pass
    rate = float(keras.ops.convert_to_numpy(ours.learning_rate))
    np.testing.assert_allclose(rate, 0.02 * 0.8 ** (8 * passes), rtol=1e-5)


# -- issue 60: the optimizer state sharded across ranks --------------------------------------------
#: the matrix's cases run again with shard_optimizer_state=True (EXACTNESS_SHARD=1): the four
#: optimizers, global clipping, accumulation, both mixed precisions, an Embedding (sparse on TF),
#: and a loss scaler skipping steps for one variable's overflow (one rank's part of the state)
SHARD_CASES = ["sgd_momentum", "adam", "adamw", "rmsprop", "global_clipnorm", "accumulation",
               "mixed_float16", "mixed_bfloat16", "transformer_adamw", "mixed_float16_overflow"]
#: the slots per variable of the cases whose state the test adds up
STATE_LAYOUT = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "rmsprop": 2}


@pytest.fixture(scope="module")
def sharded_job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded")
    run_job(directory, SHARD_CASES, 2, EXACTNESS_SHARD="1")
    return directory


def check_sharded(directory, case, np_):
    """Sharded equals unsharded (rtol 1e-6), on every rank bit for bit; the step counted and
    the rate read alike; each rank holds about 1/np_ of the state."""
    unsharded = [load(directory / f"{case}.rank{r}.npz") for r in range(np_)]
    sharded = [load(directory / f"{case}.sharded.rank{r}.npz") for r in range(np_)]
    for weights, _ in sharded[1:]:
        for ours, theirs in zip(sharded[0][0], weights, strict=True):
            np.testing.assert_array_equal(ours, theirs)
    (weights, state), (expected, expected_state) = sharded[0], unsharded[0]
    for index, (ours, theirs) in enumerate(zip(weights, expected, strict=True)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0,
                                   err_msg=f"{case} weight #{index}, sharded vs unsharded")
    assert int(state["iterations"]) == int(expected_state["iterations"]), case
    assert float(state["learning_rate"]) == float(expected_state["learning_rate"]), case
    whole = int(expected_state["state_bytes"])
    parts = [int(s["state_bytes"]) for _, s in sharded]
    assert max(parts) < whole, (case, parts, whole)
    if case in STATE_LAYOUT:  # float32 weights: the slots add up exactly
        slots = STATE_LAYOUT[case]
        model_bytes = sum(w.nbytes for w in expected)
        scalars = whole - slots * model_bytes  # iterations, the rate: on every rank
        assert 0 < scalars <= 64, (case, whole, model_bytes)
        assert sum(parts) == slots * model_bytes + np_ * scalars, (case, parts)
        largest = max(w.nbytes for w in expected)
        for part in parts:  # greedy by size: at most 1/N of the whole plus one variable
            assert part <= slots * (model_bytes / np_ + largest) + scalars, (case, parts)
    check_case(directory, case, np_)  # and the unsharded run matched one process


@pytest.mark.job
@pytest.mark.parametrize("case", SHARD_CASES)
def test_sharded_state_matches_unsharded(sharded_job, case):
    check_sharded(sharded_job, case, 2)


@pytest.mark.first_backend
@pytest.mark.job
def test_sharded_state_at_four_processes(tmp_path):
    cases = ["adamw", "transformer_adamw"]
    run_job(tmp_path, cases, 4, EXACTNESS_SHARD="1")
    for case in cases:
        check_sharded(tmp_path, case, 4)


# -- the matrix without MPI: real torchrun (issue 59) ----------------------------------------------
#: every case above, float32, mixed precision, keras-hub and sharded state, over the control
#: plane torchrun's ranks meet on (torch.distributed: its TCP store and a gloo group). Torch
#: backend only: TensorFlow under torchrun is refused (tests/runtime/test_transport_torch.py),
#: and the JAX backend's run under torchrun is tests/test_training.py's. Process sets and
#: elastic state have tests of their own over this transport (test_transport_torch.py).
under_torchrun = pytest.mark.skipif(BACKEND != "torch", reason="torchrun starts mgpu scripts on "
                                    "the torch backend (and JAX: test_training.py); "
                                    "TensorFlow runs over MPI only")


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """``torchrun --standalone --nproc-per-node 2 exactness.py``: one start for every case, each
    also sharded (EXACTNESS_SHARD=1); measured ~60 s on the 2-core CPU box."""
    directory = tmp_path_factory.mktemp("exactness_torchrun")
    runnable = [case for case in CASES + SHARD_CASES if not getattr(case, "marks", ())]
    cases = list(dict.fromkeys(names(runnable)))
    assert_ok(torchrun(2, WORKER, json.dumps(cases), str(directory), timeout=1200,
                       **QUIET, EXACTNESS_SHARD="1"))
    return directory


@under_torchrun
@pytest.mark.job
@pytest.mark.parametrize("case", CASES)
def test_two_torchrun_ranks_match_one_process(torchrun_job, case):
    check_case(torchrun_job, names([case])[0], 2)


@under_torchrun
@pytest.mark.job
@pytest.mark.parametrize("case", SHARD_CASES)
def test_sharded_state_under_torchrun_matches_unsharded(torchrun_job, case):
    check_sharded(torchrun_job, case, 2)
