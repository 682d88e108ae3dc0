"""mgpu.data.shard on 2 real processes: equal steps, disjoint parts, shared reshuffling."""

import importlib.util
import json
import os

import pytest

from conftest import SCRIPTS, launch_ok, requires_mpirun

# The worker also shards a tf.data.Dataset, so it runs on the TensorFlow backend. Do not import
# tensorflow here: next to a CUDA build of torch (with triton) in one process it aborts.
pytestmark = [requires_mpirun,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="needs tensorflow (tf.data)")]

SAMPLES, BATCH, SIZE = 1001, 32, 2


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard")
    launch_ok("-np", str(SIZE), os.path.join(SCRIPTS, "shard_ids.py"), str(out), timeout=180,
              KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    return [json.loads((out / f"rank.{r}.json").read_text()) for r in range(SIZE)]


@pytest.mark.job
@pytest.mark.parametrize("kind", ["arrays", "tfdata"])
def test_equal_steps_disjoint_parts_and_coverage(seen, kind):
    for epoch in range(2):
        parts = [rank[kind][epoch] for rank in seen]
        # 1001 // 2 = 500 samples per rank -> 15 whole batches of 32 on each rank
        assert len(parts[0]) == len(parts[1]) == (SAMPLES // SIZE // BATCH) * BATCH
        union = parts[0] + parts[1]
        assert len(union) == len(set(union))                   # each sample at most once
        assert SAMPLES - len(union) < SIZE * BATCH             # all but < size x batch
        assert len(parts[0]) % BATCH == 0                      # whole batches: equal steps


@pytest.mark.job
@pytest.mark.parametrize("kind", ["arrays", "tfdata"])
def test_reshuffled_every_epoch_in_step_across_ranks(seen, kind):
    first, second = ([rank[kind][epoch] for rank in seen] for epoch in range(2))
    assert first[0] != second[0]                     # a new order in the next epoch
    assert set(first[0]).isdisjoint(first[1])        # and still disjoint between ranks
    assert set(second[0]).isdisjoint(second[1])


@pytest.mark.job
def test_pydataset_batches_are_split_whole(seen):
    parts = [rank["pydataset"][0] for rank in seen]
    assert len(parts[0]) == 16 * BATCH and len(parts[1]) == 15 * BATCH + 9
    assert sorted(parts[0] + parts[1]) == list(range(SAMPLES))


@pytest.mark.job
def test_fit_on_sharded_arrays_runs_on_every_rank(seen):
    assert [rank["fit_epochs"] for rank in seen] == [2, 2]


def test_too_few_samples_for_the_ranks_says_what_can_help(monkeypatch):
    import numpy as np

    from mgpu_launch.training import data

    monkeypatch.setattr(data, "_placement", lambda: (0, 4))  # rank 0 of 4, without MPI
    with pytest.raises(ValueError, match=r"3 samples cannot give each of 4 ranks one batch of "
                                         r"1; there are fewer samples than ranks, so no "
                                         r"batch_size can help: use more samples, or fewer "
                                         r"processes \(-np\)"):
        data.shard(np.zeros((3, 2)), batch_size=1)
    with pytest.raises(ValueError, match=r"10 samples cannot give each of 4 ranks one batch of "
                                         r"4; use batch_size=2 or less"):
        data.shard(np.zeros((10, 2)), batch_size=4)
