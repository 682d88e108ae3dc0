"""A ``DistributedOptimizer``'s options as one frozen value.

Every option lives in :class:`DistributedOptions`: the optimizer holds one (``.options``), its
config is ``options.to_config()`` and its constructor takes them back, the engines get the
reduction part (``options.reduction``, an ``backends.reduction.GradientReduction``), and a
wrapper made again around the same inner optimizer (``hvd.load_model`` with another
compression) copies the whole value with :meth:`DistributedOptions.replace`, so no option can
be forgotten on the way.
"""

import dataclasses
from typing import Any, Optional

from mgpu_launch.backends.reduction import GradientReduction, StepOptions
from mgpu_launch.runtime import collectives, process_sets
from mgpu_launch.runtime.collectives import ReduceOp
from mgpu_launch.backends.compression import Compression, Compressor

__all__ = ["DistributedOptions", "distributed_optimizer", "of_model", "step_options"]


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """What a ``DistributedOptimizer`` was asked to do; checked once, when made.

    The fields are ``mgpu.DistributedOptimizer``'s arguments of the same names (its docstring
    says what each does), plus ``scale_local_gradients`` (Horovod's: divide the gradients of
    variables registered with ``register_local_var`` by the set's size; default True) and
    ``shard_optimizer_state`` (ZeRO stage 1: ``mgpu_launch.training.sharding``).
    ``compression`` and ``op`` may be given by name (``"fp16"``, ``"sum"``); they are kept as
    the codec and the ``ReduceOp``.

    Raises:
        ValueError: an option out of range; the message names it, what it got and the fix.

    Example:
        >>> options = DistributedOptions(op=mgpu.Sum, backward_passes_per_step=2)
        >>> DistributedOptions.from_config(options.to_config()) == options
        True
    """

    compression: Compressor = Compression.none
    op: ReduceOp = collectives.Average
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = True
    gradient_predivide_factor: float = 1.0
    sparse_as_dense: bool = False
    cuda_graph: Optional[bool] = None
    iterations_count: str = "updates"
    process_set: Any = None
    scale_local_gradients: bool = True
    shard_optimizer_state: bool = False

    def __post_init__(self):
        op = ReduceOp(self.op) if isinstance(self.op, str) else self.op
        if op not in (collectives.Average, collectives.Sum):
            raise ValueError(f"op={self.op!r}: expected mgpu.Average or mgpu.Sum")
        if int(self.backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step={self.backward_passes_per_step!r}: "
                             f"expected an integer >= 1")
        factor = self.gradient_predivide_factor
        if factor <= 0 or (factor != 1.0 and op is not collectives.Average):
            raise ValueError(f"gradient_predivide_factor={factor!r}: expected a positive "
                             f"number, and only with op=mgpu.Average")
        if self.cuda_graph not in (None, True, False):
            raise ValueError(f"cuda_graph={self.cuda_graph!r}: expected True, False or None "
                             f"(None follows MGPU_TORCH_CUDA_GRAPH)")
        if self.iterations_count not in ("updates", "passes"):
            raise ValueError(f"iterations_count={self.iterations_count!r}: expected "
                             f"'updates' (Keras's convention) or 'passes' (Horovod's)")
        process_set = self.process_set
        if process_set is process_sets.global_process_set:
            process_set = None  # every rank: the same reduction, and saved the same way
        if process_set is not None and not isinstance(process_set, process_sets.ProcessSet):
            raise ValueError(f"process_set={process_set!r}: expected None or an "
                             f"mgpu.ProcessSet (registered with init(process_sets=[...]) or "
                             f"add_process_set)")
        if self.shard_optimizer_state and process_set is not None:
            raise ValueError(f"shard_optimizer_state=True with process_set={process_set!r}: "
                             f"the state is sharded over every rank only; use "
                             f"process_set=None or shard_optimizer_state=False")
        normal = {"compression": Compression.get(self.compression), "op": op,
                  "backward_passes_per_step": int(self.backward_passes_per_step),
                  "average_aggregated_gradients": bool(self.average_aggregated_gradients),
                  "gradient_predivide_factor": float(factor),
                  "sparse_as_dense": bool(self.sparse_as_dense), "process_set": process_set,
                  "scale_local_gradients": bool(self.scale_local_gradients),
                  "shard_optimizer_state": bool(self.shard_optimizer_state)}
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def reduction(self) -> GradientReduction:
        """What the engines need of these options: the average or sum, the predivide factor
        as a prescale and postscale, the wire compression, the sparse gradients' treatment."""
        factor = self.gradient_predivide_factor
        return GradientReduction(average=self.op is collectives.Average, prescale=1.0 / factor,
                                 postscale=factor, compression=self.compression,
                                 sparse_as_dense=self.sparse_as_dense)

    def step_options(self) -> StepOptions:
        """What the engine's train step needs of these options (handed down to it)."""
        return StepOptions(cuda_graph=self.cuda_graph,
                           backward_passes_per_step=int(self.backward_passes_per_step),
                           within_a_set=self.process_set is not None)

    def replace(self, **changes) -> "DistributedOptions":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_config(self) -> dict:
        """The options as JSON values (what a saved model holds): the codec's name, the op's
        value, a process set as its ranks (None for every rank)."""
        config = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        config["compression"] = self.compression.name
        config["op"] = self.op.value
        config["process_set"] = None if self.process_set is None else list(self.process_set.ranks)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DistributedOptions":
        """The options :meth:`to_config` wrote (a file from before a field existed gets its
        default). A process set comes back as the registered set of its ranks; when none is
        registered, as an unregistered one, which the first step refuses with the fix.

        Raises:
            ValueError: an unknown key (the message lists the known ones), or a bad value.
        """
        config = dict(config)
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"DistributedOptimizer does not take {unknown}: set them on the "
                             f"wrapped optimizer instead (its options are {sorted(known)}).")
        if isinstance(config.get("process_set"), (list, tuple)):
            config["process_set"] = process_sets.with_ranks(config["process_set"])
        return cls(**config)


def distributed_optimizer(model):
    """`model`'s DistributedOptimizer, also under a LossScaleOptimizer (None: it has none).

    Found by its options' type: importing the optimizer's class here would close an import
    circle (it imports the patches that ask this). The one place that reads ``options`` off
    a Keras optimizer (tests/test_architecture.py checks that no other does)."""
    optimizer = getattr(model, "optimizer", None)
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if isinstance(getattr(candidate, "options", None), DistributedOptions):
            return candidate
    return None


def of_model(model) -> Optional[DistributedOptions]:
    """The options of `model`'s DistributedOptimizer (None: it has none)."""
    optimizer = distributed_optimizer(model)
    return None if optimizer is None else optimizer.options


def step_options(model) -> StepOptions:
    """What `model`'s train step is asked to do (the defaults without a DistributedOptimizer)."""
    options = of_model(model)
    return StepOptions() if options is None else options.step_options()
