"""What Horovod's two TensorFlow namespaces share here (``mgpu_launch.keras`` for
``horovod.tensorflow.keras``, ``mgpu_launch.tensorflow`` for ``horovod.tensorflow``): the
process sets (``mgpu_launch.runtime.process_sets``) and Horovod's switch for dynamic ones,
the build queries, the reduction ops, and the one way a Horovod name or argument that is not
provided fails.

Every Horovod name this project does not provide raises :class:`HorovodNotSupported` (an
``AttributeError``, so ``hasattr`` stays False) from the namespace's ``__getattr__``, with
the reason and what to use instead; every Horovod argument that cannot be honoured raises
``ValueError`` through :func:`reject`. docs/horovod-migration.md lists both.
"""

import os
from typing import Dict, List, Sequence

from mgpu_launch import backends, runtime
from mgpu_launch.training import bootstrap
from mgpu_launch.runtime import collectives, process_sets, timeline
from mgpu_launch.runtime.collectives import Average, Max, Min, Product, Sum
from mgpu_launch.runtime.process_sets import (ProcessSet, add_process_set, global_process_set,
                                              remove_process_set)
from mgpu_launch.config import settings

#: Horovod's Adasum reduction. Not implemented here: passing it raises ValueError.
Adasum = "adasum"

#: Horovod names neither namespace provides -> why, and what to use instead.
NOT_PROVIDED: Dict[str, str] = {}
PROCESS_SET_NAMES = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class HorovodNotSupported(AttributeError):
    """A Horovod name that mgpu_launch does not provide (the message says what to use)."""


def namespace_getattr(module_name: str, why_missing: Dict[str, str]):
    """A module ``__getattr__`` raising :class:`HorovodNotSupported` for `why_missing`'s names
    (and :data:`NOT_PROVIDED`'s), a plain AttributeError for anything else."""
    reasons = {**NOT_PROVIDED, **why_missing}

    def __getattr__(name):
        if name in reasons:
            raise HorovodNotSupported(
                f"{module_name} does not provide Horovod's {name!r}: {reasons[name]}. See "
                f"docs/horovod-migration.md.")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def reject(namespace: str, argument: str, value, fix: str):
    """Raise the ValueError every refused Horovod argument gets."""
    raise ValueError(f"{argument}={value!r} is not supported by {namespace}: {fix}")


def check_op(namespace: str, op, average=None):
    """Horovod's op (with its deprecated `average` flag) as a ReduceOp; Adasum refused."""
    if average is not None and op is not None:
        raise ValueError("pass op=hvd.Average or op=hvd.Sum, not both op and the deprecated "
                         "average=")
    if isinstance(op, str) and op.lower() == Adasum:
        reject(namespace, "op", "hvd.Adasum", "Adasum is not implemented. Use op=hvd.Average "
               "(the default) with a learning rate scaled by hvd.size(), or op=hvd.Sum.")
    if op is None:
        return Average if average is None or average else Sum
    return collectives.ReduceOp(op) if isinstance(op, str) else op


def init_runtime(namespace: str, comm, process_sets, keras_2: Sequence[str] = ()) -> None:
    """``hvd.init(comm, process_sets)``: ``mgpu.init(process_sets)``, with Horovod's switch.

    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the environment allows ``add_process_set`` later, as
    ``MGPU_DYNAMIC_PROCESS_SETS=1`` does (which wins when both are set).
    """
    if comm is not None:
        reject(namespace, "comm", comm, "the job is every process the launcher started. Call "
               "hvd.init() and start the processes with mgpu-train -np N; for groups of "
               "processes, pass process_sets=[hvd.ProcessSet(ranks), ...].")
    if isinstance(process_sets, ProcessSet):
        reject(namespace, "process_sets", process_sets, "pass a list of process sets, "
               "e.g. process_sets=[hvd.ProcessSet([0, 2])], or 'dynamic'.")
    horovod = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower()
    if horovod in ("1", "true", "yes", "on") and not settings.is_set("MGPU_DYNAMIC_PROCESS_SETS"):
        # Horovod's variable, read once here: the runtime reads only MGPU_* variables
        os.environ["MGPU_DYNAMIC_PROCESS_SETS"] = "1"
    bootstrap.init(process_sets=process_sets, keras_2=keras_2)


def process_set_group(namespace: str, process_set, what: str, engine_needed: bool = False,
                      member: bool = True):
    """The registered group of Horovod's `process_set` argument (None: every rank).

    Args:
        namespace: the public path, for the message.
        process_set: ``hvd.global_process_set``, a registered ``hvd.ProcessSet`` or None.
        what: the calling function, for the message.
        engine_needed: the call reduces through the backend's engine (in-graph collectives,
            gradients): a backend whose engine has no process sets refuses other sets.
        member: require this rank to be in the set.

    Raises:
        ValueError: `process_set` is no registered set, or the engine cannot use it.
        mgpu_launch.runtime.process_sets.NotInProcessSetError: this rank is not in it.
    """
    group = process_sets.group_of(process_set, what, member)
    if engine_needed and group.process_set_id and runtime.is_multi_process():
        engine = backends.get_engine()
        if not engine.supports_process_sets():
            reject(namespace, "process_set", process_set, f"the {engine.name} engine reduces "
                   f"over every process of the job only ({engine.process_sets_reason()}). "
                   f"Use the host collectives, or the TensorFlow backend.")
    return group


def timeline_functions(namespace: str):
    """Horovod's ``start_timeline`` / ``stop_timeline`` for `namespace`, on
    ``mgpu_launch.runtime.timeline`` (one trace of every rank, written by rank 0)."""

    def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
        """Record every rank's step phases and host collectives for a trace at `file_path`
        (Horovod's ``hvd.start_timeline``; the same as ``MGPU_TIMELINE=file_path``).

        Collective: call it on every rank. Rank 0 writes the file at :func:`stop_timeline`
        (or at exit): one Chrome/Perfetto trace, one track per rank.

        Args:
            file_path: the trace file.
            mark_cycles: must be False: there are no Horovod cycles to mark (the trace marks
                every step instead).

        Raises:
            ValueError: `mark_cycles` is true, or `file_path` is empty.

        Example:
            >>> hvd.start_timeline("timeline.json")
        """
        if mark_cycles:
            reject(namespace, "mark_cycles", mark_cycles, "there are no negotiation cycles; "
                   "the trace marks every training step. Leave mark_cycles out.")
        timeline.start(file_path, runtime.state)

    def stop_timeline() -> None:
        """Write the trace :func:`start_timeline` began (rank 0) and stop recording
        (collective: call it on every rank). Without a running timeline it does nothing."""
        timeline.stop()

    return start_timeline, stop_timeline


# -- what this build can do (Horovod's *_built() / *_enabled() queries) --------------------------
def mpi_built() -> bool:
    """True: the ranks talk over MPI (mpi4py) for the job's set-up and host collectives."""
    return True


def mpi_enabled() -> bool:
    """True on a multi-process job whose host collectives run over MPI (its transport)."""
    return runtime.is_multi_process() and runtime.state.transport.name == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI was started with MPI_THREAD_MULTIPLE (mpi4py's default): whether two
    threads may use the job's transport at once."""
    return mpi_enabled() and runtime.state.transport.thread_safe()


def gloo_built() -> bool:
    """False: there is no Gloo controller (the launcher always uses mpirun)."""
    return False


def gloo_enabled() -> bool:
    """False: see :func:`gloo_built`."""
    return False


def _build(what: str) -> bool:
    return bool(backends.get_engine_or_default().build_info().get(what, False))


def nccl_built() -> bool:
    """Whether the backend's engine can reduce over NCCL here (TF: a CUDA build of TensorFlow
    and a transport other than ``MGPU_TF_TRANSPORT=mpi`` / ``MGPU_TF_COLLECTIVE=ring``)."""
    return _build("nccl")


def cuda_built() -> bool:
    """Whether the backend was built with CUDA."""
    return _build("cuda")


def rocm_built() -> bool:
    """Whether the backend was built with ROCm."""
    return _build("rocm")


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: Intel oneCCL is not supported."""
    return False


QUERIES = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built"]
OPS = ["Average", "Sum", "Min", "Max", "Product", "Adasum"]
__all__ = QUERIES + OPS + PROCESS_SET_NAMES + [
    "HorovodNotSupported", "timeline_functions", "namespace_getattr", "reject", "check_op",
    "init_runtime", "process_set_group", "NOT_PROVIDED"]


def local_layer_weights(local_layers) -> List:
    """The trainable weights of `local_layers` (one layer, a list of layers, or None): what
    Horovod's Partial* wrappers keep per rank."""
    if local_layers is None:
        return []
    layers = list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers]
    return [weight for layer in layers for weight in layer.trainable_weights]
