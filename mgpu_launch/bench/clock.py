"""How mgpu-bench times a row: the throughput windows, the user's wait before steady speed,
and the train function's own time.

Two waits are recorded for every row, Keras's and native's alike, on the slowest rank, each
with the loss read back (so the device's work is in it):

- ``first_step_s``: the wall time of the fit's first train step;
- ``warmup_s``: the wall time from the start of the fit's first step to the end of the first
  step that ran the row's step path as every later step does (``ready_step``, counted from 1):
  its tracing, compiling and capturing done. JAX's and TensorFlow's Keras steps compile at
  the first call, so there ``warmup_s`` is ``first_step_s``; the torch engine's compiled step
  runs its first step eagerly and traces and compiles at the second, a captured step replays
  after its warm-up steps (``Engine.step_path`` says when); a native row is ready at the end of
  the last step in which ``torch.compile`` compiled a graph (dynamo's count of graphs rose).
  Rows that reuse a train function another row compiled are ready at their first step.
"""

import statistics
import time


def make_window_timer(keras, args, total: int, report, ready=lambda: True):
    """The throughput clock of every Keras row: the loss is read back (waiting for the device)
    when the warm-up ends and every ``args.window`` steps after it; ``.stamps`` are the times.
    With ``steps_per_execution`` k, Keras calls it once per k steps: the window and warm-up
    must then be multiples of k (:func:`timing_for`). `ready`: whether the step that just ran
    ran the row's steady path (``Engine.step_path(model).ready``): ``.warmup`` is the time to
    the end of the first such step, ``.ready_step`` its number."""

    class WindowTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.stamps = []
            self.begun = self.first_step = None  # the first step's wall time (compilation in)
            self.warmup = self.ready_step = None  # to the end of the first steady-path step

        def on_train_batch_begin(self, step, logs=None):
            if self.begun is None:
                self.begun = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            first = self.first_step is None
            if first:
                float(logs["loss"])  # waits for the device
                self.first_step = time.perf_counter() - self.begun
            if self.warmup is None and ready():
                float(logs["loss"])
                # ready at the first step: its warm-up IS that step (not the time ready() took)
                self.warmup = (self.first_step if first
                               else time.perf_counter() - self.begun)
                self.ready_step = step + 1
            done = step + 1 - args.warmup_steps  # windows start when the warm-up ends
            if done >= 0 and done % args.window == 0:
                float(logs["loss"])  # waits for the device
                self.stamps.append(time.perf_counter())
                if done == 0 or step + 1 == total:
                    report(f"  step {step + 1}/{total}")

    return WindowTimer()


def timing_for(args, steps_per_execution: int):
    """`args` with the warm-up, window and timed steps rounded up to multiples of
    `steps_per_execution` (Keras reports to callbacks once per execution)."""
    import argparse

    def up(count: int) -> int:
        return -(-count // steps_per_execution) * steps_per_execution
    return argparse.Namespace(**dict(vars(args), warmup_steps=up(args.warmup_steps),
                                     window=up(args.window), steps=up(args.steps)))


def median_rate(stamps, window: int, samples_per_step: int) -> float:
    """Samples per second of the median window between consecutive `stamps`."""
    return statistics.median(window * samples_per_step / (t1 - t0)
                             for t0, t1 in zip(stamps, stamps[1:]))


def waits(first_step: float, warmup, ready_step, gather) -> dict:
    """A row's wait fields, each the slowest rank's (`gather`: every rank's value of one
    object): ``first_step_s``, ``warmup_s`` and ``ready_step`` (both None when the step path
    did not settle within the fit on some rank)."""
    ranks = gather((first_step, warmup, ready_step))
    settled = all(w is not None for _, w, _ in ranks)
    return {"first_step_s": round(max(f for f, _, _ in ranks), 2),
            "warmup_s": round(max(w for _, w, _ in ranks), 2) if settled else None,
            "ready_step": max(r for _, _, r in ranks) if settled else None}


class StepTimer:
    """Per step: wall time inside Keras's train function, and (torch on GPU) the device time
    between CUDA events recorded around it -- where a step's time goes."""

    def __init__(self, backend: str):
        self.cuda = False
        if backend == "torch":
            import torch
            self.cuda = torch.cuda.is_available()
        self.reset()

    def reset(self):
        self.host, self.events = [], []

    def wrap(self, function):
        def timed(*args):  # torch: (data); JAX: (state, data)
            started = time.perf_counter()
            if self.cuda:
                import torch
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                begin.record()
            logs = function(*args)
            if self.cuda:
                end.record()
                self.events.append((begin, end))
            self.host.append(time.perf_counter() - started)
            return logs
        return timed

    def medians(self):
        """(host ms, device ms or None), medians over the second half of the steps."""
        host = self.host[len(self.host) // 2:]
        host_ms = round(1000 * statistics.median(host), 2) if host else None
        if not self.events:
            return host_ms, None
        import torch
        torch.cuda.synchronize()
        events = self.events[len(self.events) // 2:]
        return host_ms, round(statistics.median(b.elapsed_time(e) for b, e in events), 2)
