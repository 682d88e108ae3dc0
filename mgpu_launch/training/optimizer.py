"""DistributedOptimizer: wraps any Keras optimizer and averages gradients across ranks.

A real ``keras.optimizers.Optimizer`` that composes an ``inner_optimizer`` (the shape of Keras's
own ``LossScaleOptimizer``): ``apply(grads)`` reduces the gradients through the backend engine
— inside the compiled train step — then lets the inner optimizer update the variables.
"""

from typing import Any, List, Optional

import keras
from keras import ops

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.runtime import collectives, process_sets
from mgpu_launch.runtime.collectives import ReduceOp
from mgpu_launch.backends.compression import Compression, Compressor
from mgpu_launch.training import patches
from mgpu_launch.training import optimizer_sync
from mgpu_launch.training.optimizer_options import DistributedOptions
from mgpu_launch.training.optimizer_step import (Accumulation, _MultipliedSchedule, apply_inner,
                                                 innermost)
from mgpu_launch.training.optimizer_sync import check_same_variables  # noqa: F401  (re-export)


@keras.saving.register_keras_serializable(package="mgpu_launch")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """An optimizer whose updates use gradients averaged (or summed) over all ranks.

    Args:
        optimizer: the ``keras.optimizers.Optimizer`` to wrap (e.g. ``SGD``, ``Adam``, or a
            ``LossScaleOptimizer`` — see the mixed-precision note).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the dtype the
            gradients travel in; they are cast back after the allreduce.
        op: ``mgpu.Average`` (default) or ``mgpu.Sum``.
        backward_passes_per_step: accumulate this many local gradients before one allreduce
            and one update (a larger effective batch at the same memory). A
            ``LearningRateSchedule`` is called with the number of backward passes, as with
            Keras's ``gradient_accumulation_steps``; what ``iterations`` counts is
            `iterations_count`'s.
        average_aggregated_gradients: divide the accumulated gradients by
            ``backward_passes_per_step`` (True, default) or keep their sum.
        gradient_predivide_factor: with ``op=Average``, divide by this factor before the sum
            and by ``size / factor`` after it (Horovod's option, for fp16 range).
        sparse_as_dense: TensorFlow's sparse gradients (``tf.IndexedSlices`` of an
            ``Embedding``): False (default, as Horovod) gathers every rank's slices, so the
            inner optimizer sees what one process would (exact, e.g. for Adam); True sums them
            as dense tensors (cheaper when a batch touches a large share of the table, see
            docs/training-recipe.md). Other backends have dense gradients only.
        cuda_graph: torch backend on GPUs: capture the whole train step in one CUDA graph and
            replay it (True), keep it eager (False), or follow ``MGPU_TORCH_CUDA_GRAPH=1``
            (None, default). Falls back to eager with one warning when the step cannot be
            captured; see docs/torch-cuda-graphs.md. Ignored by the other backends.
        iterations_count: what ``iterations`` counts with ``backward_passes_per_step > 1``:
            ``"updates"`` (default; Keras's ``gradient_accumulation_steps`` convention) or
            ``"passes"``, every backward pass (Horovod's: ``iterations == step + 1`` after each
            one; ``mgpu_launch.keras`` / ``mgpu_launch.tensorflow``'s DistributedOptimizer
            passes it). Schedules, the LR callbacks and backups are right under either;
            with one pass per step both count the same.
        process_set: None (every rank) or a registered ``mgpu.ProcessSet``: the gradients
            are averaged (summed) over its members only, and its first rank's weights are
            copied to the other members at the first step. On a rank outside the set the
            gradients stay local (Horovod's meaning) and nothing is copied. Within a set the
            backend's engine must take process sets (TensorFlow, torch). Saved with the model
            as its ranks: a loaded model reduces within the registered set of those ranks.
        scale_local_gradients: divide the gradients of variables registered with
            :meth:`register_local_var` by the set's size (True, default; Horovod's option).
        name: the optimizer's name.

    The options are kept as one frozen value, ``options`` (a
    :class:`~mgpu_launch.training.optimizer_options.DistributedOptions`); each is also a
    read-only attribute of the same name. ``get_config`` writes them all.

    Mixed precision: with the ``mixed_float16`` policy, wrap the loss-scaling optimizer and
    tell ``compile`` not to add another one:
    ``DistributedOptimizer(LossScaleOptimizer(opt))`` and ``compile(..., auto_scale_loss=False)``.
    The loss scaler then checks the *reduced* gradients, so every rank agrees on skipping a step.
    On JAX the loss scaler runs its own stateless update inside the compiled step.
    A ``LossScaleOptimizer`` wrapped *around* this one would check each rank's local gradients
    and could make ranks disagree (and hang); that case is refused with an error.

    At the first step every rank receives rank 0's trainable weights, after the ranks check that
    they hold the same variables (count, shapes, dtypes); a mismatch raises
    ``mgpu.MismatchError`` on every rank. ``callbacks.BroadcastGlobalVariablesCallback`` also
    copies non-trainable weights and optimizer state (needed after loading them on one rank).
    When the variables only come into existence inside TensorFlow's traced step (a lazily built
    subclassed model), the copy happens inside the first step instead.

    With a ``LearningRateSchedule`` as the wrapped optimizer's rate, ``lr_multiplier`` is a
    variable its output is multiplied by; the LR warm-up / schedule callbacks set it.

    Example:
        >>> opt = mgpu.DistributedOptimizer(keras.optimizers.SGD(mgpu.scale_lr(0.01), momentum=0.9))
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """

    def __init__(self, optimizer, compression=Compression.none, op: ReduceOp = collectives.Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = True,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 cuda_graph: Optional[bool] = None, iterations_count: str = "updates",
                 process_set=None, scale_local_gradients: bool = True,
                 name: Optional[str] = None, **kwargs):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer; got "
                             f"{optimizer!r} ({type(optimizer).__name__}). Pass e.g. "
                             f"keras.optimizers.SGD(0.01).")
        if kwargs:
            raise ValueError(f"DistributedOptimizer does not take {sorted(kwargs)}: set them "
                             f"on the wrapped optimizer instead.")
        options = DistributedOptions(
            compression=compression, op=op, backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
            cuda_graph=cuda_graph, iterations_count=iterations_count, process_set=process_set,
            scale_local_gradients=scale_local_gradients)
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self._wrapped_by_loss_scaler = False
        self.inner_optimizer = optimizer
        #: every option, one frozen value (read through the properties below)
        self.options = options
        #: ids of variables kept per rank (register_local_var): not reduced, not synced
        self._local_ids = set()
        #: with a LearningRateSchedule: a variable its output is multiplied by (LR callbacks)
        self.lr_multiplier = None
        #: the first step's copy of the root's weights (optimizer_sync), made at build
        self._root_sync: Optional[optimizer_sync.RootSync] = None
        self._accumulation: Optional[Accumulation] = None
        self._schedule: Optional[_MultipliedSchedule] = None
        scheduled = innermost(optimizer)  # under a LossScaleOptimizer: the optimizer it wraps
        rate = keras_internals.raw_learning_rate(scheduled)
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            with keras.name_scope(self.name, caller=self):
                self.lr_multiplier = self.add_variable(shape=(), initializer="ones",
                                                       name="lr_multiplier")
            # Horovod's iterations count the passes already: the schedule takes them as they are.
            self._schedule = _MultipliedSchedule(rate, self.lr_multiplier,
                                                 self.backward_passes_per_step
                                                 if options.iterations_count == "updates"
                                                 else 1)
            keras_internals.swap_learning_rate(scheduled, self._schedule)
        # Device prefetch of fit's batches (MGPU_PREFETCH), the ranks' agreement check before
        # the first step, and (JAX) the engine's train step: all patches of Keras internals,
        # installed by mgpu.init(); here only for a script that never called it (one function).
        patches.install()
        self._init_done = True

    @classmethod
    def wrapping(cls, optimizer, options: DistributedOptions, name: Optional[str] = None):
        """A DistributedOptimizer around `optimizer` with `options` (every one of them: a
        wrapper made again, e.g. by ``hvd.load_model``, loses none)."""
        keywords = {field: getattr(options, field) for field in options.to_config()}
        return cls(optimizer, name=name, **keywords)

    # -- the options, read-only ------------------------------------------------------------
    compression: Compressor = property(lambda self: self.options.compression)
    op: ReduceOp = property(lambda self: self.options.op)
    backward_passes_per_step: int = property(lambda self: self.options.backward_passes_per_step)
    average_aggregated_gradients: bool = property(
        lambda self: self.options.average_aggregated_gradients)
    gradient_predivide_factor: float = property(
        lambda self: self.options.gradient_predivide_factor)
    sparse_as_dense: bool = property(lambda self: self.options.sparse_as_dense)
    cuda_graph: Optional[bool] = property(lambda self: self.options.cuda_graph)
    iterations_count: str = property(lambda self: self.options.iterations_count)
    #: the process set the gradients are reduced in (None: every rank)
    process_set = property(lambda self: self.options.process_set)
    scale_local_gradients: bool = property(lambda self: self.options.scale_local_gradients)

    def __setattr__(self, name, value):
        # A LossScaleOptimizer wrapped around us resets our loss_scale_factor after __init__.
        if name == "loss_scale_factor" and getattr(self, "_init_done", False):
            super().__setattr__("_wrapped_by_loss_scaler", True)
        super().__setattr__(name, value)

    # -- building: rank 0's state everywhere, variables checked ----------------------------
    def build(self, var_list):
        if self._wrapped_by_loss_scaler:
            raise ValueError(
                "a LossScaleOptimizer wraps this DistributedOptimizer (compile() adds one under "
                "the mixed_float16 policy): it would check each rank's local gradients and ranks "
                "could disagree on skipping a step. Use DistributedOptimizer("
                "keras.optimizers.LossScaleOptimizer(opt)) and compile(..., "
                "auto_scale_loss=False).")
        self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self._accumulation = Accumulation(
                self, var_list, self.backward_passes_per_step, self.average_aggregated_gradients,
                self.iterations if self.iterations_count == "passes" else None)
            if self._schedule is not None:
                self._schedule.pass_counter = self._accumulation.pass_counter
        self._in_step_synced = self.add_variable(shape=(), dtype="int", initializer="zeros",
                                                 name="in_step_synced")
        super().build(var_list)
        group = self._group()
        if group is not None and runtime.is_multi_process():
            backends.get_engine().check_group(group, "DistributedOptimizer(process_set=...)")
        if (self.backward_passes_per_step == 1 and runtime.is_multi_process()
                and group is None):  # a backend that reduces during backward: every rank
            backends.get_engine().watch(var_list, self.options.reduction)
        self._root_sync = optimizer_sync.RootSync(self.process_set, self.shared_variables,
                                                  self._in_step_synced)
        self._sync_from_root()

    def _sync_from_root(self):
        """Once: the root's weights everywhere (``optimizer_sync.RootSync.from_root``)."""
        self._root_sync.from_root(keras_internals.built_variables(self))

    def _group(self) -> Optional[process_sets.Group]:
        """The registered set the gradients are reduced in; None for every rank."""
        return optimizer_sync.reduction_group(self.process_set)

    @property
    def variables(self):
        return keras_internals.own_variables(self) + self.inner_optimizer.variables

    # -- the step ---------------------------------------------------------------------------
    def register_local_var(self, var) -> None:
        """Keep `var` per rank (Horovod's name): its gradient is not reduced (only divided by
        ``size()`` while ``scale_local_gradients``, as Horovod does, since the learning rate is
        scaled by it) and rank 0's value is not copied to it. Call before the first step."""
        self._local_ids.add(id(var))

    def shared_variables(self, variables) -> list:
        """`variables` without those kept per rank (:meth:`register_local_var`)."""
        return [v for v in variables if id(v) not in self._local_ids]

    def _reduce(self, grads: List[Any], variables) -> List[Any]:
        if not runtime.is_multi_process():
            return grads
        group = self._group()
        size = runtime.size() if group is None else group.size
        variables = list(variables)
        shared = [i for i, v in enumerate(variables) if id(v) not in self._local_ids]
        reduced = [g if id(v) not in self._local_ids or g is None or not self.scale_local_gradients
                   else ops.divide(g, size) for g, v in zip(grads, variables)]
        if group is not None and runtime.rank() not in group.ranks:
            return reduced  # outside the optimizer's set: local gradients, as Horovod's
        within = {} if group is None else {"group": group}
        summed = backends.get_engine().reduce_gradients(
            [grads[i] for i in shared], [variables[i] for i in shared], self.options.reduction,
            **within)
        for i, gradient in zip(shared, summed):
            reduced[i] = gradient
        return reduced

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._sync_from_root()
        variables = trainable_variables or keras_internals.built_variables(self)
        if self._root_sync.in_step:
            self._root_sync.broadcast_in_step(variables)

        def reduce_and_apply(local):
            apply_inner(self.inner_optimizer, self._reduce(local, variables),
                        trainable_variables, self._schedule)

        if self._accumulation is None:
            reduce_and_apply(list(grads))
        else:
            self._accumulation.step(list(grads), backends.get_engine_or_default().cond_update,
                                    reduce_and_apply, list(variables) + self.variables)

    # -- forwarded to the inner optimizer ---------------------------------------------------
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- saving: files hold the inner optimizer, so plain Keras loads them ------------------
    def __dir__(self):
        # Keras's saving walks dir(): hiding the inner optimizer keeps it from being written a
        # second time, under a path plain Keras would not read, by save_own_variables below.
        return [name for name in super().__dir__() if name != "inner_optimizer"]

    def save_own_variables(self, store):
        """Write the inner optimizer's variables only, in its order (what plain Keras reads).

        Our own variables are not saved: the in-step sync flag must start at 0 in a new job,
        the LR callbacks set ``lr_multiplier`` again at every batch, and with
        ``backward_passes_per_step > 1`` a partly accumulated gradient is dropped.
        """
        self.inner_optimizer.save_own_variables(store)

    def load_own_variables(self, store):
        inner = self.inner_optimizer
        keys, expected = len(store.keys()), len(inner.variables)
        if expected and keys == len(keras_internals.own_variables(self)) + expected:
            # A file from mgpu_launch 0.1, which saved our variables first, then the inner's.
            for index, variable in enumerate(inner.variables):
                variable.assign(store[str(keys - expected + index)])
            return
        inner.load_own_variables(store)

    def inner_config(self) -> dict:
        """The inner optimizer, serialized as Keras does, plus our settings under "mgpu_launch".

        This is what ``model.save`` writes for the model's optimizer (the compile-config patch
        in ``training/patches/objects.py``): plain ``keras.models.load_model`` builds the inner
        optimizer and ignores the extra key; ``mgpu.load_model`` reads it back to re-wrap.
        """
        settings = self.get_config()
        config = settings.pop("optimizer")
        config["mgpu_launch"] = {"class_name": "DistributedOptimizer", "config": settings}
        return config

    def _serialized_inner(self) -> dict:
        scheduled = innermost(self.inner_optimizer)
        schedule = keras_internals.raw_learning_rate(scheduled)
        if isinstance(schedule, _MultipliedSchedule):  # save the user's schedule, not ours
            keras_internals.swap_learning_rate(scheduled, schedule.schedule)
        try:
            return keras.saving.serialize_keras_object(self.inner_optimizer)
        finally:
            keras_internals.swap_learning_rate(scheduled, schedule)

    def get_config(self):
        return {"name": self.name, "optimizer": self._serialized_inner(),
                **self.options.to_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"),
                                                      custom_objects=custom_objects)
        return cls.from_settings(inner, config)

    @classmethod
    def from_settings(cls, optimizer, settings: dict):
        """A DistributedOptimizer around `optimizer` with the `settings` :meth:`get_config`
        wrote (without its "optimizer"): its name and every option.

        Raises:
            ValueError: a setting that is no option, or a bad value.
        """
        settings = dict(settings)
        name = settings.pop("name", None)
        return cls.wrapping(optimizer, DistributedOptions.from_config(settings), name=name)


def scale_lr(base_lr: float) -> float:
    """The learning rate for ``size()`` workers: ``base_lr * size()`` (Goyal et al.).

    Example:
        >>> keras.optimizers.SGD(mgpu.scale_lr(0.01))   # 0.04 on 4 processes
    """
    return base_lr * runtime.size()
