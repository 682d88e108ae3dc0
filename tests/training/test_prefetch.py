"""Device prefetch: the background iterator itself, and Keras's fit feeding through it."""

import threading
import time

import pytest

keras = pytest.importorskip("keras")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch.training import prefetch  # noqa: E402

BACKEND = keras.backend.backend()


def test_items_arrive_in_order_transformed_and_then_it_stops():
    assert list(prefetch.Prefetcher(range(50), lambda x: x * 2, depth=3)) == list(range(0, 100, 2))


def test_the_thread_works_ahead_but_at_most_depth_items():
    produced = []  # (item, the thread that produced it)

    def source():
        for i in range(100):
            produced.append((i, threading.current_thread().name))
            yield i

    batches = prefetch.Prefetcher(source(), lambda x: x, depth=2)
    assert next(batches) == 0
    # Ahead of the consumer: 1 handed out + 2 queued, made by the prefetch thread ...
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [item for item, _ in produced[:3]] == [0, 1, 2], produced
    assert {thread for _, thread in produced} == {"mgpu-prefetch"}, produced
    time.sleep(0.3)
    # ... and no further: + 1 the thread holds while it waits for room
    assert len(produced) <= 4, produced


def test_a_source_error_is_raised_in_the_consumer_after_the_good_items():
    def source():
        yield 1
        yield 2
        raise OSError("disk went away at batch 3")

    batches = prefetch.Prefetcher(source(), lambda x: x, depth=2)
    assert [next(batches), next(batches)] == [1, 2]
    with pytest.raises(OSError, match="disk went away at batch 3"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)


def test_dropping_the_iterator_early_ends_the_thread():
    def endless():
        while True:
            yield 0

    before = set(threading.enumerate())
    batches = prefetch.Prefetcher(endless(), lambda x: x, depth=2)
    next(batches)
    (thread,) = [t for t in threading.enumerate()
                 if t not in before and t.name == "mgpu-prefetch"]  # it started ...
    assert thread.is_alive()
    del batches
    thread.join(5)
    assert not thread.is_alive()  # ... and ended with its iterator


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_prefetch_setting_is_explained(monkeypatch, value):
    monkeypatch.setenv("MGPU_PREFETCH", value)
    with pytest.raises(ValueError, match=rf"MGPU_PREFETCH='{value}': expected the number of "
                                         rf"batches .* 0 turns device prefetch off"):
        prefetch.prefetch_depth(accelerator=True)


def test_on_by_default_on_gpus_only(monkeypatch):
    monkeypatch.delenv("MGPU_PREFETCH", raising=False)
    assert (prefetch.prefetch_depth(True), prefetch.prefetch_depth(False)) == (2, 0)
    monkeypatch.setenv("MGPU_PREFETCH", "3")
    assert prefetch.prefetch_depth(False) == 3


class ThreadRecorder(keras.utils.PyDataset):
    """Fixed batches; remembers which thread asked for each."""

    def __init__(self):
        super().__init__()
        rng = __import__("numpy").random.default_rng(0)
        self.x = rng.random((6, 8, 4), dtype="float32")
        self.y = (self.x.sum(-1) > 2).astype("int32")
        self.threads = []

    def __len__(self):
        return 6

    def __getitem__(self, index):
        self.threads.append(threading.current_thread().name)
        return self.x[index], self.y[index]


def _fit_losses(depth, monkeypatch):
    monkeypatch.setenv("MGPU_PREFETCH", str(depth))
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.5)),
                  "sparse_categorical_crossentropy")
    batches = ThreadRecorder()
    handed = []  # batches the training loop took from the prefetch thread's feed
    original_next = prefetch._Pass.__next__

    def recording_next(self):
        item = original_next(self)
        handed.append(item)
        return item
    monkeypatch.setattr(prefetch._Pass, "__next__", recording_next)
    history = model.fit(batches, epochs=2, verbose=0)
    return history.history["loss"], set(batches.threads), len(handed)


@pytest.mark.backend
def test_fit_feeds_from_the_prefetch_thread_with_the_same_result(monkeypatch):
    prefetched, threads, handed = _fit_losses(2, monkeypatch)
    direct, direct_threads, direct_handed = _fit_losses(0, monkeypatch)
    assert prefetched == pytest.approx(direct, rel=1e-6)
    assert "mgpu-prefetch" not in direct_threads and direct_handed == 0
    assert handed >= 2 * len(ThreadRecorder())  # every batch of both epochs (JAX peeks one more)
    if BACKEND in ("jax", "torch"):
        assert threads == {"mgpu-prefetch"}
    # TensorFlow: the PyDataset runs in tf.data's own threads; the prefetch thread iterates
    # that tf.data pipeline and copies each batch to the device.
