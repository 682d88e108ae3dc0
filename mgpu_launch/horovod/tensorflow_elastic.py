"""Horovod's ``horovod.tensorflow.elastic`` names for custom TensorFlow loops, on mgpu-launch's
restart-based elastic training (every commit also on disk, as ``mgpu_launch.keras.elastic``'s).

    import mgpu_launch.tensorflow as hvd        # was: import horovod.tensorflow as hvd

    @hvd.elastic.run
    def train(state):
        for batch, (images, labels) in enumerate(dataset.skip(state.batch)):
            state.batch = batch
            training_step(images, labels)        # a tf.function with DistributedGradientTape
            if state.batch % 10 == 0:
                state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

``TensorFlowKerasState`` is ``mgpu_launch.keras.elastic.KerasState`` for a model that is not
compiled: the optimizer passed is committed and restored with it. ``TensorFlowState`` is the
state of a list of variables (``tf.Variable`` or Keras variables) and attributes, and
``ObjectState`` (``mgpu_launch.horovod.object_state``) that of attributes alone; their commits
are files of their own (``mgpu_launch.horovod.elastic_store``), kept as the Keras ones are.
``run`` is the Keras one: it loads the last commit when the job starts (after a failure or a
resize mgpu-train restarts every process), runs the reset callbacks when the commit was
written by a job of another size, and then, as Horovod's, calls ``state.sync()`` so that every
rank starts from rank 0's variables and attributes. The differences from Horovod's in-memory
rollback are ``mgpu_launch.keras.elastic``'s (docs/fault-tolerance.md, "The Horovod names").

``TensorFlowState(session=...)`` is refused: TF1 sessions do not exist with Keras 3.
"""

from typing import List, Optional

import numpy as np

from mgpu_launch import backends
from mgpu_launch.horovod.elastic import KerasState, run
from mgpu_launch.horovod.object_state import ObjectState

__all__ = ["TensorFlowKerasState", "TensorFlowState", "ObjectState", "run"]


class TensorFlowKerasState(KerasState):
    """Horovod's ``TensorFlowKerasState``: a Keras model, its optimizer and attributes, for a
    custom training loop (the model need not be compiled).

    Args:
        model: the Keras model (built: its variables exist).
        optimizer: the optimizer the loop applies gradients with (default:
            ``model.optimizer``). An uncompiled model gets it as ``model.optimizer``, so that
            a commit saves its slots with the weights.
        backend: Horovod's Keras backend module; ignored.
        backup_dir, **kwargs: as for ``mgpu_launch.keras.elastic.KerasState``.

    Raises:
        ValueError: neither `optimizer` nor ``model.optimizer``; an attribute name of the
            state's own.

    Example:
        >>> state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0, epoch=0)
    """

    def __init__(self, model, optimizer=None, backend=None, backup_dir=None, **kwargs):
        if optimizer is None and getattr(model, "optimizer", None) is None:
            raise ValueError("TensorFlowKerasState: the model has no optimizer and none was "
                             "passed; give the one your loop applies gradients with: "
                             "TensorFlowKerasState(model, optimizer, batch=0)")
        if getattr(model, "optimizer", None) is None:
            model.optimizer = optimizer  # what Keras saves with the weights
        super().__init__(model, optimizer=optimizer, backup_dir=backup_dir, **kwargs)


class TensorFlowState(ObjectState):
    """Horovod's ``TensorFlowState`` for a TF2 custom loop: a list of variables and attributes.

    A commit saves the variables' values with the attributes (rank 0 writes them to disk, as
    every state here does); :meth:`restore` assigns the snapshot back; :meth:`sync` gives every
    rank rank 0's variables and attributes.

    Args:
        variables: the variables to track (``tf.Variable`` or Keras variables), e.g.
            ``model.variables + optimizer.variables`` (build the optimizer first, so that its
            slots exist: ``optimizer.build(model.trainable_variables)``).
        session: must be None: TF1 sessions do not exist with Keras 3 (TF2 runs eagerly).
        backup_dir, **kwargs: as for :class:`ObjectState` (the attributes, JSON values).

    Raises:
        ValueError: a `session` is passed, or no `variables` (Horovod's default is TF1's
            global-variable collection, which TF2 does not keep); an attribute's name is the
            state's own.
        TypeError: an item of `variables` is not a variable (no ``assign`` / ``numpy``).

    Example:
        >>> optimizer.build(model.trainable_variables)
        >>> state = hvd.elastic.TensorFlowState(model.variables + optimizer.variables,
        ...                                     batch=0, epoch=0)
    """

    RESERVED = frozenset({"backup_dir", "variables", "session"})

    def __init__(self, variables=None, session=None, backup_dir: Optional[str] = None,
                 **kwargs):
        if session is not None:
            raise ValueError(
                f"TensorFlowState: session={session!r} is a TF1 session; with Keras 3 "
                f"TensorFlow runs eagerly (TF2) and there are no sessions to read variables "
                f"through. Leave session out and pass the variables: "
                f"TensorFlowState(model.variables + optimizer.variables, batch=0)")
        if variables is None:
            raise ValueError(
                "TensorFlowState: variables=None tracks TF1's global-variable collection in "
                "Horovod, which TF2 does not keep (it would track nothing). Pass the list: "
                "TensorFlowState(model.variables + optimizer.variables, batch=0)")
        variables = list(variables)
        for index, variable in enumerate(variables):
            if not (callable(getattr(variable, "assign", None))
                    and callable(getattr(variable, "numpy", None))):
                raise TypeError(f"TensorFlowState: variables[{index}] is a "
                                f"{type(variable).__name__}, not a variable (it needs assign() "
                                f"and numpy()); pass tf.Variable or Keras variables")
        self.variables = variables
        self.session = None
        super().__init__(backup_dir=backup_dir, **kwargs)

    def _arrays(self) -> List[np.ndarray]:
        return [np.asarray(variable.numpy()) for variable in self.variables]

    def _variable_names(self) -> List[str]:
        return [str(getattr(variable, "path", None) or getattr(variable, "name", "?"))
                for variable in self.variables]

    def _assign(self, arrays: List[np.ndarray]) -> None:
        for variable, value in zip(self.variables, arrays, strict=True):
            variable.assign(value)

    def _broadcast_variables(self) -> None:
        backends.get_engine().broadcast_variables(self.variables, 0)
