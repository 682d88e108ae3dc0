"""Elastic training: resuming with another number of processes, and mgpu-train's elastic mode.

The size-change tests start real jobs (TensorFlow, CPU): a job is killed mid-epoch, and the
next one, with another -np, resumes from its step backup; tests/scripts/resize_ids.py logs the
ids of the samples every step trained on, and elastickit counts those that survived.
"""

import collections
import os

import pytest

import elastickit
from conftest import SCRIPTS, explain, launch, requires_mpirun

RESIZE = os.path.join(SCRIPTS, "resize_ids.py")
SAMPLES = 64
ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _once_each(used, dropped_below):
    """Every id at most once, and all but fewer than `dropped_below` of the 64 used."""
    twice = [i for i, n in collections.Counter(used).items() if n > 1]
    assert not twice, f"samples used twice: {twice}"
    assert SAMPLES - dropped_below < len(used) <= SAMPLES, sorted(used)


@requires_mpirun
@pytest.mark.parametrize("before, after, resumed, left", [
    # 2 x 4 samples a step: the backup after batch 3 of epoch 2 is at sample 24 of its order;
    # 1 process continues with batch 7 of 16 and uses all 64
    (2, 1, "resuming at epoch 2, batch 7", 0),
    # 1 x 4: the backup is at sample 12; 2 processes (8 a step) continue at batch 3 of 8
    # (samples 12..59) and drop the last 4, fewer than one step of the new size
    (1, 2, "resuming at epoch 2, batch 3", 4),
])
def test_a_job_resumed_with_another_size_uses_every_sample_of_the_epoch_once(
        tmp_path, before, after, resumed, left):
    pytest.importorskip("tensorflow")
    backup, out = str(tmp_path / "backup"), str(tmp_path / "out")
    os.mkdir(out)
    killed = launch("-np", str(before), RESIZE, backup, out, "1", "4", timeout=180, **ENV)
    assert killed.returncode != 0, explain(killed)
    assert os.listdir(backup) == ["epoch-1-batch-3.weights.h5"], explain(killed)
    result = launch("-np", str(after), RESIZE, backup, out, timeout=180,
                    RESIZE_ATTEMPT="1", **ENV)
    assert result.returncode == 0, explain(result)
    processes = {1: "1 process", 2: "2 processes"}
    assert (f"{resumed} from {backup} (backed up by {processes[before]} after "
            f"{4 * (3 if before == 1 else 6)} samples of the epoch's order; now "
            f"{processes[after]}, learning rate 0.1 -> {0.1 * after / before:g})"
            in result.stdout), explain(result)
    assert elastickit.sizes(out) == [before, after]
    used = elastickit.used_samples(out, epoch=1)
    _once_each(used, dropped_below=after * 4)
    assert SAMPLES - len(used) == left
    for epoch in (0, 2):  # whole epochs, each with its own size
        assert sorted(elastickit.used_samples(out, epoch)) == list(range(SAMPLES))
    final = elastickit.attempts(out)[1]
    assert [log["learning_rate"] for log in final] == pytest.approx([0.1 * after / before] * after)
