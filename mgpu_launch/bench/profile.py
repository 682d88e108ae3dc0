"""mgpu-bench ``--profile``: where each rank's step time goes, rank by rank.

Throughput rows say *how much* scaling is lost; this says *where*. The profile runs ``fit``
again with every step waited for (the loss read back at each step end), and records on each
rank when a step was dispatched and when it finished, on one wall clock. Per step, the last
rank to dispatch is the one the collective waits for. Per rank, medians over the steps of:

- ``input_ms``: host time between the end of one step and the dispatch of the next (Keras's
  loop, the next batch from the iterator or the prefetch queue, callbacks);
- ``wait_ms``: time from this rank's dispatch until the last rank's (a straggler shows up as
  the rank with ~0 while the others wait);
- ``step_ms``: from the last rank's dispatch to this rank's finish: compute plus the exposed
  collective;
- ``compute_ms`` (JAX, TensorFlow): dispatch to finish with the gradient allreduce left out of the
  compiled step (``MGPU_PROFILE_SKIP_ALLREDUCE``'s switch), so ``comm_ms = step_ms -
  compute_ms`` is the communication that backward did not hide.

Waiting at every step removes the overlap of host and device work, so the profile explains the
throughput rows; it does not replace them. Ranks on several hosts need synchronised clocks
(``wait_ms`` compares dispatch times across ranks).
"""

import statistics
import time
from typing import Dict, List

import mgpu_launch as mgpu


def make_callback(keras, warmup_steps: int):
    """A Keras callback that waits for every step and records (dispatch, finish, gap) times."""

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps: List[tuple] = []
            self._begin = self._last_end = None

        def on_train_batch_begin(self, step, logs=None):
            self._begin = time.time()

        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # waits for the device
            end = time.time()
            if step >= warmup_steps and self._last_end is not None:
                self.steps.append((self._begin, end, self._begin - self._last_end))
            self._last_end = end

    return StepClock()


def breakdown(steps: List[tuple], gather=None) -> List[Dict[str, float]]:
    """Per rank medians (ms) of input, wait and step time; collective over every rank.

    Args:
        steps: this rank's ``(dispatch, finish, gap)`` per profiled step (same count on every
            rank: the steps of one ``fit``).
        gather: every rank's `steps` from this one's, in rank order (default
            ``mgpu.allgather_object``; the one-process mirrored row passes ``lambda s: [s]``).

    Returns:
        One dict per rank, in rank order: ``input_ms``, ``wait_ms``, ``step_ms`` and
        ``own_ms`` (dispatch to finish of this rank alone: the compute time when the step has
        no collective, whose ranks then drift apart).
    """
    everyone = (gather or mgpu.allgather_object)(steps)
    count = min(len(s) for s in everyone)
    last = [max(rank[i][0] for rank in everyone) for i in range(count)]  # the last to dispatch
    result = []
    for mine in everyone:
        result.append({
            "input_ms": round(1e3 * statistics.median(s[2] for s in mine[:count]), 2),
            "wait_ms": round(1e3 * statistics.median(last[i] - mine[i][0] for i in range(count)), 2),
            "step_ms": round(1e3 * statistics.median(mine[i][1] - last[i] for i in range(count)), 2),
            "own_ms": round(1e3 * statistics.median(s[1] - s[0] for s in mine[:count]), 2),
        })
    return result


def skip_allreduce(model, skip: bool) -> bool:
    """Leave the gradient allreduce out of `model`'s next compiled step (the JAX and
    TensorFlow engines; torch's overlaps the backward pass, which this would not measure).

    Returns:
        Whether the engine supports it; when it does, the train function is rebuilt.
    """
    from mgpu_launch import backends
    engine = backends.get_engine()
    if mgpu.size() == 1 or not engine.set_skip_allreduce(skip):
        return False
    model.train_function = None  # Keras rebuilds (and recompiles) it at the next fit
    return True
