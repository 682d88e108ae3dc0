"""What an engine is: one small interface per concern the rest of mgpu_launch asks of it.

An engine is the backend's side of data-parallel training (one per Keras backend; the
dispatcher in ``backends/__init__.py`` picks it from ``keras.backend.backend()``). What the
layers above call on it falls into the concerns below, each an abstract class of a few
methods with no default: ``backends.Engine`` joins all but the last, and an engine missing a
method cannot be made (``TypeError`` at construction). What engines share is a named mixin of
``backends/shared.py`` that each engine lists in its own class statement;
the TensorFlow engine adds :class:`GraphCollectives`. The shared pieces, by interface:
Feeding ``KerasFeeding``; TrainStep ``KerasTrainStep``, ``HostBroadcast``; GradientReducer
``DenseReduction``; ProcessSetSupport ``GroupCheck``, ``HasProcessSets``, ``EveryRankOnly``;
InStepCollectives ``GatherBySum``; ReductionTiming ``DefaultReductionTiming``; HorovodQueries
``NoBuildInfo``; Lifecycle ``NoCommunicator`` (the fallback ``backends.KerasOnly`` only).

interface           asked by                                   implemented by
Lifecycle           mgpu.init() / shutdown()                   Engine; TF, JAX, torch
Feeding             the epoch-iterator patch, the prefetcher   Engine; TF, JAX, torch
TrainStep           the fit patches, the first-step sync       Engine; TF, JAX, torch
GradientReducer     DistributedOptimizer, tape, Horovod ops    Engine; TF, JAX, torch
ProcessSetSupport   the optimizer, Horovod's process sets      Engine; TF, torch, JAX
InStepCollectives   SyncBatchNormalization                     Engine; TF, JAX, torch
ReductionTiming     the efficiency report                      Engine; TF, JAX, torch
HorovodQueries      hvd.nccl_built(), cuda_built(), ...        Engine; TF
KerasPatches        training.patches (installed once)          Engine; TF, JAX, torch
GraphCollectives    mgpu_launch.tensorflow's ops, TF's jit     TensorFlowEngine only

Every method is called on every rank in the same order (most are collectives or prepare
one). ``tests/test_architecture.py`` fails when code outside ``backends/`` calls an engine
method that no interface here declares: duck-typed reach into one backend's engine is what
these classes replace. A caller that needs :class:`GraphCollectives` gets the engine through
``backends.graph_collectives()``, which says so when the backend has none.
"""

import abc
from typing import Any, List, Sequence

__all__ = ["Lifecycle", "Feeding", "TrainStep", "GradientReducer", "ProcessSetSupport",
           "InStepCollectives", "ReductionTiming", "HorovodQueries", "KerasPatches",
           "GraphCollectives",
           "INTERFACES"]


class Lifecycle(abc.ABC):
    """Set-up and tear-down of the backend's own communicator. ``name``: the backend's."""

    name: str = ""

    @abc.abstractmethod
    def setup(self, state) -> None:
        """At ``mgpu.init()`` on a multi-process job, before the model is built."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """At ``mgpu.shutdown()``."""


class Feeding(abc.ABC):
    """How batches reach the device (the epoch iterator's prefetcher)."""

    @abc.abstractmethod
    def computes_on_accelerator(self) -> bool:
        """Whether the backend computes on a GPU (device prefetch is then on by default)."""

    @abc.abstractmethod
    def prefetch_source(self, epoch_iterator, keras_get_iterator):
        """The batches to copy ahead from a thread, or None for Keras's own feeding."""

    @abc.abstractmethod
    def prefetch_transfer(self):
        """The copy the prefetch thread applies to each batch."""

    @abc.abstractmethod
    def runs_epochs_ahead(self) -> bool:
        """Whether the prefetch thread may begin the next epoch's batches before this epoch
        ends (where the data allows it) without changing what Keras's feeding gives."""

    @abc.abstractmethod
    def runs_sharded_tf_data_ahead(self) -> bool:
        """Whether a ``tf.data`` that ``mgpu.data.shard`` made may begin its next epoch while
        this one ends: only where Keras makes one iterator of it per epoch (JAX), since each
        iterator made draws the next reshuffle seed (TensorFlow's Keras makes two)."""


class TrainStep(abc.ABC):
    """The compiled train step: who builds it, what runs inside it, the first step's copy."""

    @abc.abstractmethod
    def owns_train_step(self) -> bool:
        """Whether :meth:`train_function` replaces Keras's (JAX: shard_map)."""

    @abc.abstractmethod
    def train_function(self, model):
        """Keras's one-step function for `model`, built by the engine."""

    @abc.abstractmethod
    def wrap_train_function(self, model, function, options):
        """Keras's train function as the engine runs it (torch: CUDA graphs); `options`: the
        model's optimizer's ``reduction.StepOptions``, handed down."""

    @abc.abstractmethod
    def localize(self, tree):
        """This process's part of every value the engine's step returned."""

    @abc.abstractmethod
    def tracing(self) -> bool:
        """Whether the caller runs inside a traced (symbolic) step now."""

    @abc.abstractmethod
    def cond_update(self, predicate, update, variables) -> None:
        """Run `update` (which assigns `variables`) where `predicate` holds, in the step."""

    @abc.abstractmethod
    def readable_on_host(self, variables) -> bool:
        """Whether `variables` have values the host can read now."""

    @abc.abstractmethod
    def step_path(self, model):
        """What `model`'s train step ran as so far: a ``reduction.StepPath`` (the engine's
        actual choice, a fallback included); for benchmarks and the efficiency report."""

    @abc.abstractmethod
    def step_advice(self, model, options) -> str:
        """A setting that makes `model`'s train step itself faster here ("" when none);
        `options`: as in :meth:`wrap_train_function`."""

    @abc.abstractmethod
    def broadcast_variables(self, variables: Sequence[Any], root_rank: int,
                            group=None) -> None:
        """Assign rank `root_rank`'s values to `variables` on every rank (of `group`)."""


class GradientReducer(abc.ABC):
    """Summing (or averaging) gradients across ranks, inside the step."""

    @abc.abstractmethod
    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        """A list of tensors reduced across ranks (of `group`), inside the compiled step."""

    @abc.abstractmethod
    def watch(self, variables, options) -> None:
        """At the optimizer's build: reduction may start during backward (torch)."""

    @abc.abstractmethod
    def reduce_gradients(self, grads, variables, options, group=None) -> List[Any]:
        """The optimizer's reduction of `grads` with ``GradientReduction`` `options`."""

    @abc.abstractmethod
    def densify(self, gradient):
        """A sparse gradient as a dense tensor."""

    @abc.abstractmethod
    def is_sparse(self, value) -> bool:
        """Whether `value` is a sparse gradient (TensorFlow's IndexedSlices)."""


class ProcessSetSupport(abc.ABC):
    """Collectives within a process set (``mgpu.ProcessSet``)."""

    @abc.abstractmethod
    def supports_process_sets(self) -> bool:
        """Whether the reductions take a process set's group."""

    @abc.abstractmethod
    def process_sets_reason(self) -> str:
        """Why this engine has no process sets, for the refusal's message."""

    @abc.abstractmethod
    def check_group(self, group, what: str) -> None:
        """Raise ValueError unless `group` is every rank or this engine takes sets."""


class InStepCollectives(abc.ABC):
    """Small differentiable collectives in the forward pass (synchronized BatchNorm)."""

    @abc.abstractmethod
    def reduces_in_step(self) -> bool:
        """Whether :meth:`sum_in_step` can run where the caller is now."""

    @abc.abstractmethod
    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        """A few small tensors summed across ranks, differentiably."""

    @abc.abstractmethod
    def gather_in_step(self, tensor):
        """Every rank's `tensor` stacked along a new first axis, differentiably."""


class ReductionTiming(abc.ABC):
    """What the gradient reduction costs alone (the efficiency report)."""

    @abc.abstractmethod
    def time_gradient_reduction(self, variables, options, *, repeats: int = 5) -> float:
        """Seconds one reduction of `variables`' gradients takes alone (a collective)."""

    @abc.abstractmethod
    def gradient_reduction_runner(self, variables, options):
        """A function running one reduction of zeros, prepared locally."""

    @abc.abstractmethod
    def compile_reduction(self, function, example):
        """`function` compiled as the step runs it."""

    @abc.abstractmethod
    def reduction_advice(self) -> str:
        """A setting that makes this engine's reduction faster here ("" when none)."""

    @abc.abstractmethod
    def overlaps_backward(self) -> bool:
        """Whether the reduction runs while the backward pass still computes."""

    @abc.abstractmethod
    def set_skip_allreduce(self, skip: bool) -> bool:
        """Leave the gradient allreduce out of the steps compiled from now on (`skip`), or put
        it back: mgpu-bench's profile, which times the step without it. Returns whether this
        engine can (False: nothing changed)."""


class HorovodQueries(abc.ABC):
    """What Horovod's ``nccl_built()``, ``cuda_built()``, ... report."""

    @abc.abstractmethod
    def build_info(self) -> dict:
        """``{"cuda": bool, "rocm": bool, "nccl": bool}`` of the backend's build."""


class KerasPatches(abc.ABC):
    """The backend's own replacements of Keras methods, as a value (no table elsewhere is keyed
    by a backend's name); ``mgpu_launch.training.patches`` installs them once, with the shared
    ones."""

    @abc.abstractmethod
    def keras_patches(self, hooks):
        """This backend's ``keras_patching.PatchSet``, its replacements built on `hooks` (a
        ``keras_patching.Hooks``: what the training layer hands down)."""


class GraphCollectives(abc.ABC):
    """In-graph collectives beyond the sum: Horovod's TensorFlow ops. TensorFlow only."""

    @abc.abstractmethod
    def compiles_collectives(self) -> bool:
        """Whether XLA can compile the step's collectives here."""

    @abc.abstractmethod
    def allgather(self, tensors, group=None):
        """Each tensor gathered along axis 0 from every rank (of `group`), in rank order."""

    @abc.abstractmethod
    def broadcast(self, tensor, root_rank: int, group=None):
        """Rank `root_rank`'s `tensor` on every rank (of `group`)."""

    @abc.abstractmethod
    def reduce(self, tensor, op: str, group=None):
        """`tensor` combined over the ranks: op "sum", "min", "max" or "product"."""


#: every interface, in the order of the module docstring's table
INTERFACES = (Lifecycle, Feeding, TrainStep, GradientReducer, ProcessSetSupport,
              InStepCollectives, ReductionTiming, HorovodQueries, KerasPatches,
              GraphCollectives)
