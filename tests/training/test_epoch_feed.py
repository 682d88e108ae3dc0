"""The prefetch thread across epochs (issue 49): one thread for all the epochs of a fit, which
begins the next epoch's batches while this one ends where that gives Keras's batches exactly.

The feed itself (passes in order, dropped passes, the run-ahead and its limit), then real fits
against Keras's own feeding (``MGPU_PREFETCH=0``): the batches each step sees and the weights,
over several epochs, with shuffled arrays and with a PyDataset that reshuffles in
``on_epoch_end``, validation between the epochs. Only arrays in their own order begin early
(issue 58): a PyDataset drawing from ``random`` and a callback drawing between epochs keep
Keras's order.
"""

import threading
import time

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch import backends  # noqa: E402
from mgpu_launch.training import prefetch  # noqa: E402

BACKEND = keras.backend.backend()


def _wait_for(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


class Sources:
    """make_source for a feed: pass p is [10p, 10p+1, 10p+2]; remembers the passes it made
    and those whose batches were read (begun)."""

    def __init__(self):
        self.made, self.begun = [], []

    def __call__(self, number):
        self.made.append(number)
        return self._batches(number)

    def _batches(self, number):
        self.begun.append(number)  # runs at the first next, as a generator's body does
        yield from [10 * number + i for i in range(3)]


def test_passes_come_in_order_each_with_only_its_own_batches():
    feed = prefetch.EpochFeed(Sources(), lambda x: x, depth=2)
    assert [list(feed.next_pass()) for _ in range(3)] == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]


def test_a_pass_dropped_early_is_abandoned_and_the_next_starts_afresh():
    sources = Sources()
    feed = prefetch.EpochFeed(sources, lambda x: x, depth=2)
    first = feed.next_pass()
    assert next(first) == 0  # a build batch: Keras takes one and drops the pass
    assert list(feed.next_pass()) == [10, 11, 12]
    assert sources.made == [0, 1]


def test_a_source_given_to_the_pass_is_used_made_by_the_caller():
    made = Sources()
    feed = prefetch.EpochFeed(made, lambda x: -x, depth=1)
    assert list(feed.next_pass(iter([5, 6]))) == [-5, -6]
    assert list(feed.next_pass()) == [-10, -11, -12] and made.made == [1]


def test_an_error_reaches_the_consumer_and_the_next_pass_still_runs():
    def source(number):
        if number == 0:
            raise OSError("disk went away")
        return [number]

    feed = prefetch.EpochFeed(source, lambda x: x, depth=2)
    with pytest.raises(OSError, match="disk went away"):
        next(feed.next_pass())
    assert list(feed.next_pass()) == [1]


def test_the_next_pass_begins_before_it_is_asked_for_but_not_past_the_plan():
    sources = Sources()
    feed = prefetch.EpochFeed(sources, lambda x: x, depth=2, run_ahead=True,
                              planned_batches=6)
    assert list(feed.next_pass()) == [0, 1, 2]
    # the second pass begins with nobody asking for it yet ...
    assert _wait_for(lambda: sources.begun == [0, 1]), sources.begun
    assert list(feed.next_pass()) == [10, 11, 12]
    time.sleep(0.3)
    assert sources.begun == [0, 1]  # ... and no third one: the plan was two passes
    # (its iterator may be made, which reads nothing: a tf.data iterator is slow to start)


def test_without_run_ahead_a_pass_begins_when_asked_for():
    sources = Sources()
    feed = prefetch.EpochFeed(sources, lambda x: x, depth=2, planned_batches=6)
    assert list(feed.next_pass()) == [0, 1, 2]
    time.sleep(0.3)
    assert sources.made == [0] and sources.begun == [0]


def test_dropping_the_feed_ends_its_thread():
    feed = prefetch.EpochFeed(Sources(), lambda x: x, depth=1)
    next(feed.next_pass())
    thread = feed._thread
    assert thread.is_alive()
    del feed
    thread.join(5)
    assert not thread.is_alive()


# -- fit, against Keras's own feeding -------------------------------------------------------------
class Recorder(keras.Model):
    """Remembers the first feature of every sample of every batch its train step sees."""

    seen = []

    def train_step(self, *args):  # JAX: (state, data); TensorFlow, torch: (data,)
        x = args[-1][0]
        if self.run_eagerly and _concrete(x):  # not while TensorFlow traces it for the build
            Recorder.seen.append(keras.ops.convert_to_numpy(x)[:, 0].tolist())
        return super().train_step(*args)


def _concrete(x) -> bool:
    if BACKEND == "tensorflow":
        import tensorflow as tf
        return not tf.is_symbolic_tensor(x)
    return True


class Reshuffled(keras.utils.PyDataset):
    """Five batches whose order its own on_epoch_end reshuffles (Keras calls it each epoch)."""

    def __init__(self, seed=1):
        super().__init__()
        rng = np.random.default_rng(0)
        self.x = rng.random((5, 4, 3), dtype="float32")
        self.y = rng.random((5, 4, 1), dtype="float32")
        self.order, self.rng = list(range(5)), np.random.default_rng(seed)

    def __len__(self):
        return 5

    def __getitem__(self, index):
        return self.x[self.order[index]], self.y[self.order[index]]

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


class Plain(keras.utils.PyDataset):
    """Five fixed batches, no epoch hooks of its own."""

    def __init__(self):
        super().__init__()
        self.data = Reshuffled()

    def __len__(self):
        return 5

    def __getitem__(self, index):
        return self.data[index]


def _arrays():
    rng = np.random.default_rng(0)
    return rng.random((20, 3), dtype="float32"), rng.random((20, 1), dtype="float32")


def _fit(depth, data, monkeypatch, eager, callbacks=()):
    """(batches the steps saw, weights, the threads that ran the device copy) of one fit."""
    monkeypatch.setenv("MGPU_PREFETCH", str(depth))
    threads = set()
    engine_class = type(backends.get_engine_or_default())
    keras_transfer = engine_class.prefetch_transfer

    def recording_transfer(self):
        copy = keras_transfer(self)
        return lambda batch: threads.add(threading.current_thread()) or copy(batch)
    monkeypatch.setattr(engine_class, "prefetch_transfer", recording_transfer)
    Recorder.seen = []
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    model = Recorder(inputs, keras.layers.Dense(1)(inputs))
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse",
                  run_eagerly=eager)
    x, y = _arrays()
    if data == "arrays":
        model.fit(x, y, batch_size=4, epochs=3, shuffle=True, validation_data=(x[:8], y[:8]),
                  verbose=0, callbacks=list(callbacks))
    else:
        model.fit(data(), epochs=3, validation_data=Reshuffled(seed=2), verbose=0,
                  callbacks=list(callbacks))
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    del model
    assert _wait_for(lambda: not any(t.is_alive() for t in threads)), "a feed outlived its fit"
    return Recorder.seen, weights, threads


def _shard_tf_data():
    """The README's recipe on _arrays: mgpu.data.shard of a tf.data, shuffled, batches of 4."""
    tf = pytest.importorskip("tensorflow")
    return mgpu.data.shard(tf.data.Dataset.from_tensor_slices(_arrays()), batch_size=4,
                           shuffle=True, seed=3)


def _own_tf_data():
    """The same pipeline built by hand (not by shard): mgpu cannot know its next epoch early."""
    tf = pytest.importorskip("tensorflow")
    return tf.data.Dataset.from_tensor_slices(_arrays()).shuffle(20, seed=3).batch(4)


@pytest.mark.backend
@pytest.mark.parametrize("data", ["arrays", Reshuffled, _shard_tf_data],
                         ids=["shuffled arrays", "reshuffling PyDataset", "shard of a tf.data"])
def test_every_step_sees_keras_own_batches_in_order_and_the_weights_match(monkeypatch, data):
    seen, _, threads = _fit(2, data, monkeypatch, eager=True)
    keras_seen, _, keras_threads = _fit(0, data, monkeypatch, eager=True)
    assert len(keras_seen) == 15 and not keras_threads
    assert seen == keras_seen
    # one thread for the training data, one for the validation data: not one per epoch
    assert len(threads) == 2, threads
    # the compiled step, fed the same way, ends at the same weights
    _, weights, _ = _fit(2, data, monkeypatch, eager=False)
    _, keras_weights, _ = _fit(0, data, monkeypatch, eager=False)
    np.testing.assert_allclose(weights, keras_weights, rtol=1e-6)


class AtEpochBegin(keras.callbacks.Callback):
    """At each epoch's beginning, after the first: waits (up to 10 s) until the prefetch thread
    has copied a batch of that epoch, and remembers whether it had."""

    def __init__(self, copies, per_epoch, seconds=10):
        super().__init__()
        self.copies, self.per_epoch, self.ahead, self.seconds = copies, per_epoch, [], seconds

    def on_epoch_begin(self, epoch, logs=None):
        if epoch:
            self.ahead.append(_wait_for(lambda: len(self.copies) > epoch * self.per_epoch + 1,
                                        self.seconds))


class SaysItBeginsEarly(Plain):
    mgpu_begin_early = True  # its batches depend on their index only


@pytest.mark.backend
@pytest.mark.parametrize("data, shuffle, ahead", [
    ("arrays", False, True), ("arrays", True, False), (Plain, None, False),
    (SaysItBeginsEarly, None, True), (_shard_tf_data, None, BACKEND == "jax"),
    (_own_tf_data, None, False)],
    ids=["arrays in order", "shuffled arrays", "plain PyDataset", "PyDataset that says so",
         "shard of a tf.data", "a tf.data of its own"])
def test_the_next_epoch_is_copied_before_it_begins(monkeypatch, data, shuffle, ahead):
    """Only where nothing between epochs can change the next epoch's batches: arrays in their
    own order, and a PyDataset whose class says ``mgpu_begin_early = True``. A shuffled array's
    permutation comes from numpy's global generator, and another PyDataset's __getitem__ is the
    user's code (issue 58): those begin when Keras would. shard's tf.data decides its next
    epoch's order inside tf.data: begun early on JAX, the same batches (on TensorFlow Keras
    makes two tf.data iterators an epoch, so the feed waits to repeat them); any other tf.data
    waits for its epoch, as Keras's own feeding does."""
    if BACKEND == "torch":
        pytest.skip("torch: each epoch's DataLoader draws from torch's global generator as it "
                    "starts, so mgpu begins it when Keras would (no run-ahead)")
    copies = []
    engine_class = type(backends.get_engine_or_default())
    keras_transfer = engine_class.prefetch_transfer

    def counting_transfer(self):
        copy = keras_transfer(self)
        return lambda batch: copies.append(1) or copy(batch)
    monkeypatch.setattr(engine_class, "prefetch_transfer", counting_transfer)
    monkeypatch.setenv("MGPU_PREFETCH", "2")
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    model.fit(*_arrays(), batch_size=4, epochs=1, verbose=0)  # built: no build batch below
    copies.clear()
    timer = AtEpochBegin(copies, per_epoch=5, seconds=10 if ahead else 1)
    x, y = _arrays()
    args = (x, y) if data == "arrays" else (data(),)
    model.fit(*args, batch_size=4 if data == "arrays" else None, epochs=3, verbose=0,
              callbacks=[timer], **({} if shuffle is None else {"shuffle": shuffle}))
    assert timer.ahead == [ahead, ahead]
    time.sleep(0.3)
    assert len(copies) == 15  # nothing of a fourth epoch the fit will not run


def test_the_timeline_shows_the_threads_read_and_copy_of_every_batch(monkeypatch):
    from mgpu_launch import runtime
    from mgpu_launch.runtime import timeline
    for name in [n for n in __import__("os").environ if n.startswith(("MGPU_", "OMPI_", "PMI"))]:
        monkeypatch.delenv(name)
    runtime.init()
    try:
        timeline.ensure_recording(runtime.state)
        before = timeline.appended()

        def slow_source(number):
            for i in range(3):
                time.sleep(0.02)
                yield i
        feed = prefetch.EpochFeed(slow_source, lambda x: time.sleep(0.01) or x, depth=1)
        for _ in range(2):  # read as Keras does: each pass's 3 batches, never its end
            batches = feed.next_pass()
            assert [next(batches) for _ in range(3)] == [0, 1, 2]
        slices = timeline.since(before)
    finally:
        timeline.discard()
        runtime.shutdown()
    ours = [(name, duration) for _, name, category, _, duration, _, _ in slices
            if category == "prefetch"]
    assert [name for name, _ in ours] == ["batch read", "device copy"] * 6, ours
    assert all(d >= (20e6 if name == "batch read" else 10e6) * 0.9 for name, d in ours), ours
    # the consumer's side: one input wait per batch, the first pass's unread end included
    assert [s[1] for s in slices if s[2] == "input"] == ["input wait"] * 6


@pytest.mark.backend
def test_steps_per_epoch_shorter_than_the_data_keeps_keras_batches(monkeypatch):
    """Keras keeps one iterator across epochs here: a pass spans epochs (3 + 2 of 5 batches)."""
    def weights(depth):
        monkeypatch.setenv("MGPU_PREFETCH", str(depth))
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
        model.fit(*_arrays(), batch_size=4, epochs=4, steps_per_epoch=3, shuffle=True,
                  verbose=0)
        return np.concatenate([np.ravel(w) for w in model.get_weights()])
    np.testing.assert_allclose(weights(2), weights(0), rtol=1e-6)


# -- issue 58, item 7: data whose order depends on what runs between epochs ---------------------
class DrawsFromRandom(keras.utils.PyDataset):
    """Five batches, each shifted by a draw from Python's `random` (seeded when made): its
    order depends on every other draw of the program, e.g. a callback's between epochs."""

    def __init__(self):
        super().__init__()
        import random
        random.seed(11)
        self.data = Reshuffled()

    def __len__(self):
        return 5

    def __getitem__(self, index):
        import random
        x, y = self.data[index]
        return x + np.float32(random.random()), y


class DrawsBetweenEpochs(keras.callbacks.Callback):
    """The user's code between epochs: one draw from `random` and one from numpy's generator."""

    def on_epoch_end(self, epoch, logs=None):
        import random
        random.random()
        np.random.random()


@pytest.mark.backend
@pytest.mark.parametrize("data", ["arrays", DrawsFromRandom],
                         ids=["shuffled arrays", "PyDataset drawing from random"])
def test_draws_between_epochs_leave_keras_order(monkeypatch, data):
    """Keras makes each epoch's batches after the previous epoch's callbacks: a PyDataset's
    draws from `random` and a shuffled array's permutation (numpy's global generator) then
    come after the user's draws there. Begun early, the next epoch would see other numbers."""
    keras_seen = _fit(0, data, monkeypatch, eager=True, callbacks=[DrawsBetweenEpochs()])[0]
    assert len(keras_seen) == 15
    for _ in range(2):  # two runs, both Keras's order
        seen = _fit(2, data, monkeypatch, eager=True, callbacks=[DrawsBetweenEpochs()])[0]
        assert seen == keras_seen
