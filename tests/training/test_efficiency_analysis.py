"""The efficiency report's analysis on made-up slices (no job): the communication share (the
gradient allreduce timed alone, taken out of each step's own time), the advice it gets, the
report's words, and how the ranks' timings are combined. The jobs that make each cause
dominate: test_efficiency.py."""

import os

import pytest

from mgpu_launch.training import efficiency, units
from mgpu_launch.training.efficiency_report import combined

MS = 1_000_000  # ns
STEPS = 6


def rank_slices(callbacks_ms: float, train_ms: float, steps: int = STEPS) -> list:
    """One rank's slices of a fit: each step's on_train_batch_begin (callbacks) then its train
    step, back to back (thread, name, category, start ns, duration ns, step, parent)."""
    slices, now = [], 0
    for step in range(1, steps + 1):
        slices.append((0, "on_train_batch_begin", "callbacks", now, callbacks_ms * MS, step, ""))
        now += callbacks_ms * MS
        slices.append((0, "train step", "step", now, train_ms * MS, step, ""))
        now += train_ms * MS
    return slices


def timed(seconds: float, overlaps: bool = False, every: int = 1) -> dict:
    """A measurement as efficiency_report.time_communication gives it (4 MiB of gradients)."""
    return {"seconds": seconds / every, "every": every, "bytes": 4_194_304,
            "overlaps": overlaps, "engine": "tensorflow", "compression": "none", "hint": ""}


def test_the_measured_allreduce_is_taken_out_of_each_step():
    ranks = [rank_slices(1, 10), rank_slices(1, 10)]
    figures = efficiency.analyse(ranks, 32, timed(0.006))
    # steps 2..5 analysed, 11 ms each: 6 ms of each is the allreduce, 4 ms compute
    assert figures["shares"]["comm"] == pytest.approx(6 / 11)
    assert figures["ranks"][0]["step"] == pytest.approx(4 * 4 * MS)
    assert figures["shares"]["input"] == figures["shares"]["wait"] == 0


def test_the_allreduce_takes_at_most_the_step_left_after_waiting():
    # rank 1 arrives 4 ms late each step: rank 0 waits 4 ms of its 14 ms step
    ranks = [rank_slices(1, 14), rank_slices(5, 10)]
    figures = efficiency.analyse(ranks, None, timed(0.050))
    per_step = [total["comm"] / 4 for total in figures["ranks"]]
    assert per_step == pytest.approx([10 * MS, 10 * MS])  # min(50 ms, 14 - 4) and min(50, 10)
    # waited: rank 0's 4 ms, and rank 1's extra 4 ms in callbacks (what rank 0 waited for)
    assert figures["shares"]["wait"] == pytest.approx(8 / 30)
    assert all(total["step"] == pytest.approx(0) for total in figures["ranks"])


def test_without_a_measurement_there_is_no_communication_share():
    ranks = [rank_slices(0.1, 10), rank_slices(0.1, 10)]
    for communication in (None, {"note": "a fit of fewer than 22 steps is not timed"}):
        figures = efficiency.analyse(ranks, 32, communication)
        assert figures["shares"]["comm"] == 0
        assert "(compute and gradient allreduce) dominates" in efficiency.advice(figures)
    text = efficiency.render(efficiency.analyse(ranks, 32, None))
    assert "communication" not in text  # one rank's view: no allreduce to speak of
    text = efficiency.render(figures)
    assert ("    communication                 -  not measured: a fit of fewer than 22 steps "
            "is not timed") in text.splitlines()


def test_one_rank_is_not_told_about_an_allreduce_it_does_not_run():
    figures = efficiency.analyse([rank_slices(0.1, 10)], 32, None)
    assert efficiency.advice(figures) == ("no cause above 5%: the step itself (compute) "
                                          "dominates")


def test_a_dominant_allreduce_gets_the_communication_advice():
    ranks = [rank_slices(1, 10)] * 2
    words = efficiency.advice(efficiency.analyse(ranks, 32, timed(0.008)))
    assert words == ("communication: the gradient allreduce dominates; fewer steps for the "
                     "same samples (raise the batch per rank), half the bytes ("
                     "DistributedOptimizer(..., compression=mgpu.Compression.fp16)) or one "
                     "reduction every N batches (backward_passes_per_step=N)")
    # what the fit already does is not advised again; the engine's own setting is
    communication = dict(timed(0.016, every=2), compression="fp16",
                         hint="try MGPU_TF_TRANSPORT=mpi")
    words = efficiency.advice(efficiency.analyse(ranks, 32, communication))
    assert words == ("communication: the gradient allreduce dominates; fewer steps for the "
                     "same samples (raise the batch per rank), a larger "
                     "backward_passes_per_step (now 2) or try MGPU_TF_TRANSPORT=mpi")


def test_communication_does_not_take_the_verdict_from_a_larger_cause():
    # 7 ms of 11 in the callbacks (the rest), the allreduce 3 of the 4 ms step
    figures = efficiency.analyse([rank_slices(7, 4)] * 2, 32, timed(0.003))
    assert figures["shares"]["comm"] == pytest.approx(3 / 11)
    assert efficiency.advice(figures).startswith("callbacks and Keras's loop")
    # measured, and everything lost under 5%: the compute is what is left
    figures = efficiency.analyse([rank_slices(0.1, 10)] * 2, 32, timed(0.0002))
    assert efficiency.advice(figures) == ("no cause above 5%: the step itself (compute) "
                                          "dominates")


def test_the_report_says_what_was_timed_and_how_far_it_is_exposed():
    ranks = [rank_slices(1, 10)] * 2
    lines = efficiency.render(efficiency.analyse(ranks, 32, timed(0.006))).splitlines()
    assert "  lost: 64% of the ranks' time" in lines  # 1 ms callbacks + 6 ms allreduce of 11
    assert ("    communication                55%  the gradient allreduce (4.19 MB) takes 6 ms "
            "alone; this engine reduces after the backward pass, so none of it overlaps") in lines
    text = efficiency.render(efficiency.analyse(ranks, 32, timed(0.006, overlaps=True)))
    assert "takes 6 ms alone, an upper bound: this engine overlaps it with the backward" in text
    # reduced once every 2 steps: half of it a step
    figures = efficiency.analyse(ranks, 32, timed(0.006, every=2))
    assert figures["shares"]["comm"] == pytest.approx(3 / 11)
    assert "takes 6 ms alone, once every 2 steps;" in efficiency.render(figures)
    communication = dict(timed(0.006), compression="fp16")
    text = efficiency.render(efficiency.analyse(ranks, 32, communication))
    assert "the gradient allreduce (4.19 MB, sent as fp16) takes 6 ms alone" in text


def test_the_ranks_timings_are_combined_into_one():
    assert combined([None]) is None
    median = combined([timed(0.004), timed(0.010), timed(0.005)])
    assert median["seconds"] == pytest.approx(0.005) and median["bytes"] == 4_194_304
    failed = {"note": "its timing failed on rank 1 (RuntimeError: lost)"}
    assert combined([timed(0.004), failed]) == failed


def test_times_sizes_and_rates_print_in_plain_units_never_in_exponent_notation():
    # A 1.06 s allreduce of 1.2 GB on a loaded box (the .3g format printed "1.06e+03 ms"), and
    # a throughput above 10000 samples/s (.4g printed "1.2e+04").
    ranks = [rank_slices(0.1, 1100)] * 2
    communication = dict(timed(1.0624), bytes=1_234_000_000)
    text = efficiency.render(efficiency.analyse(ranks, 32, communication))
    assert "the gradient allreduce (1.23 GB) takes 1.06 s alone" in text, text
    fast = efficiency.render(efficiency.analyse([rank_slices(0.01, 0.5)] * 2, 8, None))
    assert "throughput: 31373 samples/s in total over the fit; per rank: 15686, 15686" in fast, fast
    for value, words in ((0.006, "6 ms"), (0.0169, "16.9 ms"), (0.00085, "0.85 ms"),
                         (0.9996, "1 s"), (125.34, "125 s")):
        assert units.duration(value) == words
    assert "e+" not in text + fast


def epochs_slices(train_ms: float, late_ms: float = 0.0, steps: int = 24,
                  restart_ms: float = 0.0) -> list:
    """A small job's rank: 0.5 ms of callbacks (plus `late_ms`) and a `train_ms` step, with
    validation (50 ms) and on_epoch_end (20 ms) after every 6th step. `restart_ms`: the input
    at each epoch boundary, twice: the iterator's last `next` that finds the epoch's end
    (before the validation) and the next epoch's first batch waited for inside its step."""
    slices, now = [], 0
    for step in range(1, steps + 1):
        slices.append((0, "on_train_batch_begin", "callbacks", now, (0.5 + late_ms) * MS, step,
                       ""))
        now += (0.5 + late_ms) * MS
        first = step > 1 and step % 6 == 1
        wait = restart_ms if first else 0.0
        slices.append((0, "train step", "step", now, (train_ms + wait) * MS, step, ""))
        if wait:
            slices.append((0, "input wait", "input", now, wait * MS, step, "train step"))
        now += (train_ms + wait) * MS
        if step % 6 == 0 and restart_ms:
            slices.append((0, "next batch", "input", now, restart_ms * MS, step, ""))
            now += restart_ms * MS
        if step % 6 == 0:
            slices.append((0, "validation", "other", now, 50 * MS, step, ""))
            slices.append((0, "on_epoch_end", "callbacks", now + 50 * MS, 20 * MS, step, ""))
            now += 70 * MS
    return slices


def test_a_job_too_small_to_judge_gets_one_line_with_its_measured_fixed_costs():
    # A 2 ms step, 1 ms of it a 40 KB allreduce (latency): 1 ms of compute against 11 ms a
    # step of fixed costs (70 ms of validation and epoch end every 6 steps, the allreduce,
    # the callbacks). Steps 2-23 analysed: 3 epoch ends, 265 ms.
    small = dict(timed(0.001), bytes=40_000)
    text = efficiency.render(efficiency.analyse([epochs_slices(2)] * 2, 32, small))
    assert text == (
        "mgpu: efficiency of fit, steps 2-24 on 2 ranks (265 ms): not judged, the fit is too "
        "small: a step computes 1 ms, and fixed costs add 11 ms a step (validation and epoch "
        "ends 70 ms an epoch, the allreduce of 40 KB 1 ms, Keras's loop and callbacks 0.5 ms); "
        "a larger batch, model or epoch makes them small. Throughput: 5313 samples/s over the "
        "fit; 25600 in a median step (ThroughputCallback's samples_per_sec)."), text


def test_the_input_restarting_at_an_epoch_boundary_is_an_epoch_cost_not_input_wait():
    # 40 ms at each epoch's end (the iterator finds it) and 40 ms for the next epoch's first
    # batch: a fixed cost of each epoch, which a larger prefetch would not shorten. On a
    # loaded 2-core box this made tests/scripts/efficiency.py's small job "input" 43-66%.
    small = dict(timed(0.001), bytes=40_000)
    figures = efficiency.analyse([epochs_slices(2, restart_ms=40)] * 2, 32, small)
    assert figures["shares"]["input"] == 0, figures["shares"]
    text = efficiency.render(figures)
    assert "not judged, the fit is too small" in text, text
    assert "validation and epoch ends 150 ms an epoch" in text, text  # 50 + 20 + 2 x 40
    # a wait for a batch inside an epoch stays input wait
    slices = rank_slices(1, 10)
    enter = next(start for _, name, _, start, _, step, _ in slices
                 if name == "train step" and step == 3)
    slices.append((0, "input wait", "input", enter, 5 * MS, 3, "train step"))
    inside = efficiency.analyse([slices] * 2, 32, None)["shares"]
    assert inside["input"] == pytest.approx(5 / 44) and inside["epoch"] == 0, inside


def test_a_small_job_is_still_judged_when_a_real_cause_dominates_or_its_steps_outweigh():
    small = dict(timed(0.001), bytes=40_000)
    # rank 1 arrives 30 ms late every step: the others' wait is a cause, not a fixed cost
    late = efficiency.render(efficiency.analyse([epochs_slices(32), epochs_slices(2, 30)],
                                                32, small))
    assert "  advice: rank 1 arrives 30 ms a step after the others, in callbacks" in late, late
    # 1 ms of compute beside a 99 ms allreduce of 16.9 MB: an allreduce of many bytes is a
    # cause, even where the step computes less than the fixed costs
    large = efficiency.render(efficiency.analyse([epochs_slices(100)] * 2, 32,
                                                 dict(timed(0.099), bytes=16_900_000)))
    assert "  advice: communication: the gradient allreduce dominates" in large, large
    # a 150 ms step: its compute outweighs the same fixed costs, which are reported in full
    heavy = efficiency.analyse([epochs_slices(150)] * 2, 32, small)
    text = efficiency.render(heavy)
    assert "not judged" not in text and "  lost: " in text, text
    assert "the rest" in text and "(validation and epoch ends: 6%)" in text, text
    assert "in a median step" not in text  # the epoch ends are 6%: the two rates agree


def test_the_input_advice_fits_what_fit_was_given():
    # input dominates: the advice must not ask a user of mgpu.data.shard's tf.data for a
    # .prefetch that shard added already (it cannot see it), and must name it for a tf.data of
    # the user's own
    figures = {"shares": {"input": 0.3, "wait": 0.0, "comm": 0.0, "callbacks": 0.0,
                          "other": 0.0}, "late": None, "communication": None}
    sharded = efficiency.advice(dict(figures, input_kind="shard tf.data"))
    assert sharded.startswith("input: the step waits for its batches")
    assert "prefetched already" in sharded and ".prefetch(tf.data.AUTOTUNE)" not in sharded
    assert "mgpu.data.shard((x, y), batch_size=...)" in sharded
    assert ".prefetch(tf.data.AUTOTUNE)" in efficiency.advice(dict(figures, input_kind="tf.data"))
    assert "workers=4" in efficiency.advice(dict(figures, input_kind="PyDataset"))
    assert "workers=4" in efficiency.advice(figures)  # not known: every remedy


def test_what_fit_was_given_is_told_apart():
    tf = pytest.importorskip("tensorflow")
    import keras
    import numpy as np

    from mgpu_launch import data
    from mgpu_launch.training import sharded
    x = np.zeros((8, 2), "float32")
    own = tf.data.Dataset.from_tensor_slices(x)
    assert sharded.input_kind(data.shard(own, batch_size=2)) == "shard tf.data"
    assert sharded.input_kind(own.batch(2)) == "tf.data"
    assert sharded.input_kind(data.shard(x, batch_size=2)) == "PyDataset"
    assert sharded.input_kind((x, x)) == sharded.input_kind(x) == "arrays"
    assert sharded.input_kind(keras.utils.PyDataset()) == "PyDataset"


@pytest.mark.skipif(os.environ.get("KERAS_BACKEND", "tensorflow") != "torch",
                    reason="the torch engine's word on its eager step")
@pytest.mark.backend
def test_a_dominant_eager_torch_step_is_told_how_to_compile_it(capfd):
    """The figures carry the engine's word on the step (``step_hint``, as the report's
    on_train_end puts it there): a torch step that ran eagerly -- jit_compile off (this box's
    default), or compiled but fallen back -- dominates, and the advice names the compiled path
    (and the fallback's reason). Real fits of a tiny model; nothing is compiled (the fallback
    is found while tracing)."""
    import keras
    import numpy as np

    import mgpu_launch as mgpu
    from mgpu_launch import backends
    from mgpu_launch.training import optimizer_options

    class ReadsOnHost(keras.layers.Layer):  # float() of a tensor: it cannot be traced
        def call(self, x):
            return x / (1.0 + 0.0 * float(keras.ops.convert_to_numpy(keras.ops.max(x))))

        def compute_output_shape(self, shape):
            return shape

    def hint_after_fit(jit_compile, *extra):
        model = keras.Sequential([keras.Input((4,)), *extra, keras.layers.Dense(2)])
        model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse",
                      jit_compile=jit_compile)
        model.fit(np.ones((16, 4), "float32"), np.zeros((16, 2), "float32"), batch_size=4,
                  verbose=0)
        engine = backends.get_engine()
        return (engine.step_advice(model, optimizer_options.step_options(model)),
                engine.step_path(model))

    dominant = efficiency.analyse([rank_slices(0.1, 10)], 32, None)  # the step: 99%
    hint, path = hint_after_fit(False)
    assert (path.name, path.fallback) == ("eager", None)
    assert ("model.compile(jit_compile=True) (or MGPU_TORCH_COMPILE=1; on by default on a GPU) "
            "compiles the whole step") in hint, hint
    assert efficiency.advice(dict(dominant, step_hint=hint)) == (
        "no cause above 5%: the step itself (compute) dominates; " + hint)
    capfd.readouterr()
    hint, path = hint_after_fit(True, ReadsOnHost())
    line = [x for x in capfd.readouterr().err.splitlines() if "runs eagerly" in x]
    assert path.name == "eager" and path.fallback.startswith("tracing failed"), path
    assert hint.startswith(f"on torch its compiled step fell back to eager ({path.fallback})")
    assert len(line) == 1 and path.fallback in line[0], line  # the reason its one line gave
    assert efficiency.advice(dict(dominant, step_hint=hint)).endswith(hint)
