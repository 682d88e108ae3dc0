"""Checks, before the first step, that every rank's ``fit`` will run the same steps.

Every training step is a collective. If one rank has more batches per epoch than another, it
waits forever in the allreduce the others never join; if ranks validate at different epochs,
``MetricAverageCallback`` averages different things. Keras cannot see this: each process only
knows its own data. So on a multi-process job, ``fit`` of a model compiled with a
``DistributedOptimizer`` gets one more callback, last in the list, whose ``on_train_begin``
shares over MPI what each rank is about to do:

- steps per epoch (``steps_per_epoch``, or the length of the data), the number of epochs and
  the epoch it starts at (after ``BackupAndRestore`` has set it);
- whether it validates, how often (``validation_freq``) and on how many batches.

Any difference is a ``MismatchError`` on every rank at once, naming the values per rank. Data
of unknown length (a generator, a filtered tf.data pipeline) without ``steps_per_epoch`` cannot
be checked: rank 0 prints a warning saying to pass ``steps_per_epoch``. Added by the ``fit``
patch that every ``DistributedOptimizer`` installs (``mgpu_launch.training.patches``); other
models' ``fit`` is untouched.
"""

import math
import warnings
from typing import Any, Dict, Optional

import keras

from mgpu_launch import keras_internals, runtime
from mgpu_launch.runtime import collectives


def add_agreement_check(arguments: Dict[str, Any]) -> None:
    """Append an :class:`AgreementCheck` to the callbacks of a ``fit`` call.

    Called by the ``fit`` patch in ``mgpu_launch.training.patches`` (multi-process jobs, models
    compiled with a DistributedOptimizer) with fit's bound arguments, which it updates.
    """
    check = AgreementCheck(_validation_facts(arguments), arguments.get("initial_epoch", 0))
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(check)
    else:
        arguments["callbacks"] = list(callbacks or []) + [check]


def _batches(data: Any, batch_size: Optional[int]) -> Optional[int]:
    """Batches in `data` as fit would see them; None when unknown."""
    if isinstance(data, keras.utils.PyDataset):
        return len(data)
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "cardinality"):
        count = int(data.cardinality())
        return count if count >= 0 else None
    if isinstance(data, (tuple, list, dict)) or hasattr(data, "shape"):
        leaves = keras.tree.flatten(data)
        if leaves and hasattr(leaves[0], "shape") and len(leaves[0].shape):
            return math.ceil(int(leaves[0].shape[0]) / (batch_size or 32))
    return None


def _validation_facts(arguments: Dict[str, Any]) -> Dict[str, Any]:
    data, split = arguments.get("validation_data"), arguments.get("validation_split") or 0.0
    if data is None and not split:
        return {"validates": False}
    facts = {"validates": True, "validation_freq": arguments.get("validation_freq", 1)}
    if arguments.get("validation_steps"):
        facts["validation batches"] = arguments["validation_steps"]
    elif split:
        samples = len(keras.tree.flatten(arguments.get("x"))[0])
        size = arguments.get("validation_batch_size") or arguments.get("batch_size") or 32
        facts["validation batches"] = math.ceil(samples * split / size)
    else:
        facts["validation batches"] = _batches(
            data, arguments.get("validation_batch_size") or arguments.get("batch_size"))
    return facts


class AgreementCheck(keras.callbacks.Callback):
    """The callback ``fit`` gets on a multi-process job (see the module docstring).

    Args:
        validation: this rank's validation facts (whether, how often, how many batches).
        initial_epoch: fit's ``initial_epoch`` argument.
    """

    def __init__(self, validation: Dict[str, Any], initial_epoch: int = 0):
        super().__init__()
        self.validation = validation
        self.initial_epoch = initial_epoch

    def on_train_begin(self, logs=None):
        facts = {"steps per epoch": self.params.get("steps"),
                 "epochs": self.params.get("epochs"),
                 "first epoch": (keras_internals.initial_epoch(self.model)
                                 or self.initial_epoch),
                 **self.validation}
        everyone = collectives.allgather_object(facts)
        differing = {name: [rank_facts.get(name) for rank_facts in everyone]
                     for name in sorted({name for rank_facts in everyone for name in rank_facts})
                     if len({repr(rank_facts.get(name)) for rank_facts in everyone}) > 1}
        if differing:
            listed = "; ".join(f"{name}: {values}" for name, values in differing.items())
            raise collectives.MismatchError(
                f"model.fit would run differently on the ranks (values by rank) — {listed}. "
                f"Every step is a collective, so the job would hang. Give every rank the same "
                f"number of batches: mgpu.data.shard(...) splits a data set evenly, or pass the "
                f"same steps_per_epoch / validation_steps everywhere.")
        if facts["steps per epoch"] is None and runtime.is_chief():
            warnings.warn(
                "mgpu_launch cannot check that every rank runs the same number of steps: the "
                "training data's length is unknown. If one rank runs out first, the others "
                "wait forever; pass steps_per_epoch= to fit.", stacklevel=2)
