"""LR warm-up / schedule callbacks: the learning rate the compiled step USES, batch by batch.

tests/scripts/lr_probe.py trains w * x with gradient exactly 1, so the weight after each batch
reveals the rate (and, with momentum, the velocity) the step applied. Every case runs on 2
processes (size enters the warm-up formula), on the backend in KERAS_BACKEND; one job runs
every case (CONFIGS).
"""

import json
import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.usefixtures("backend")]

PROBE = os.path.join(SCRIPTS, "lr_probe.py")
STEPS, SIZE, LR = 4, 2, 0.1  # 8 samples per rank, batch 2; 2 processes


#: every probe run of the tests below, by name: one job runs them all in turn (each a fresh
#: model, optimizer and callbacks; each test checks its own), since a rank's start-up
#: (importing the framework) costs more than these 12-step fits
CONFIGS = {
    "warmup": {"warmup_epochs": 2, "epochs": 3},
    "momentum": {"warmup_epochs": 2, "epochs": 3, "optimizer": "momentum"},
    "warmup_schedule": {"warmup_epochs": 2, "epochs": 3, "optimizer": "schedule"},
    "multiplier": {"schedule": [LR, 0.5, 1, 3], "epochs": 3},
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """name -> what every rank of CONFIGS[name]'s run recorded."""
    out = tmp_path_factory.mktemp("probes")
    listed = [{"name": name, **config} for name, config in CONFIGS.items()]
    launch_ok("-np", str(SIZE), PROBE, json.dumps(listed), str(out), timeout=300,
              KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    return {name: [json.loads((out / name / f"rank.{r}.json").read_text())
                   for r in range(SIZE)] for name in CONFIGS}


def probe(probed, name):
    ranks = probed[name]
    assert ranks[0] == ranks[1], name  # every rank used the same rates
    return ranks[0]


def warmup_factor(epoch, batch, warmup_epochs):
    """Horovod's formula, written out independently of the callback."""
    if epoch >= warmup_epochs:
        return SIZE  # the ramp ends at initial_lr = SIZE x (initial_lr / SIZE)
    t = epoch + (batch + 1) / STEPS
    return t * (SIZE - 1) / warmup_epochs + 1


def expected_weights(rates, momentum=0.0):
    """w after each step for gradient 1, with Horovod's momentum correction on rate changes."""
    w, v, previous, out = 0.0, 0.0, None, []
    for rate in rates:
        if momentum and previous:
            v *= rate / previous  # momentum x new/old for this batch == velocity x new/old
        v = momentum * v - rate
        w += v
        previous = rate
        out.append(w)
    return out


def warmup_rates(epochs, warmup_epochs):
    return [LR / SIZE * warmup_factor(e, b, warmup_epochs)
            for e in range(epochs) for b in range(STEPS)]


@pytest.mark.job
def test_warmup_rate_used_at_every_batch_follows_the_formula(probed):
    result = probe(probed, "warmup")
    used = -np.diff([0.0] + result["weights"])
    np.testing.assert_allclose(used, warmup_rates(3, 2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result["lrs"], [LR * 0.75, LR, LR], rtol=1e-6)  # logs["lr"]


@pytest.mark.job
def test_momentum_correction_reaches_the_compiled_step(probed):
    result = probe(probed, "momentum")
    np.testing.assert_allclose(result["weights"],
                               expected_weights(warmup_rates(3, 2), momentum=0.9),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.first_backend
@pytest.mark.job
def test_warmup_multiplies_a_learning_rate_schedule(probed):
    result = probe(probed, "warmup_schedule")
    used = -np.diff([0.0] + result["weights"])
    decay = [0.9 ** step for step in range(3 * STEPS)]
    np.testing.assert_allclose(used, np.array(warmup_rates(3, 2)) * decay, rtol=1e-5)


@pytest.mark.first_backend
@pytest.mark.job
def test_schedule_with_a_constant_multiplier(probed):
    # lr x 0.5^(epoch - 1) for epochs 1 and 2; epoch 0 keeps the optimizer's own 0.1.
    result = probe(probed, "multiplier")
    used = -np.diff([0.0] + result["weights"])
    np.testing.assert_allclose(used, [LR] * STEPS + [LR] * STEPS + [LR / 2] * STEPS, rtol=1e-6)


def test_unknown_steps_per_epoch_is_a_clear_error():
    import mgpu_launch as mgpu
    callback = mgpu.callbacks.LearningRateWarmupCallback(0.1)
    callback.set_params({"steps": None})  # fit on a dataset of unknown length
    with pytest.raises(ValueError, match="Pass steps_per_epoch"):
        callback.on_train_begin()
