"""What Horovod's two TensorFlow namespaces share here (``mgpu_launch.keras`` for
``horovod.tensorflow.keras``, ``mgpu_launch.tensorflow`` for ``horovod.tensorflow``): the
global process set, the build queries, the reduction ops, and the one way a Horovod name or
argument that is not provided fails.

Every Horovod name this project does not provide raises :class:`HorovodNotSupported` (an
``AttributeError``, so ``hasattr`` stays False) from the namespace's ``__getattr__``, with
the reason and what to use instead; every Horovod argument that cannot be honoured raises
``ValueError`` through :func:`reject`. docs/horovod-migration.md lists both.
"""

from typing import Dict, List

from mgpu_launch import engines, runtime
from mgpu_launch.runtime import collectives, timeline
from mgpu_launch.runtime.collectives import Average, Max, Min, Product, Sum

#: Horovod's Adasum reduction. Not implemented here: passing it raises ValueError.
Adasum = "adasum"

#: Horovod names neither namespace provides -> why, and what to use instead.
NOT_PROVIDED: Dict[str, str] = {
    "ProcessSet": "only the global process set exists: run a separate job per group",
    "add_process_set": "only the global process set exists: run a separate job per group",
    "remove_process_set": "only the global process set exists: there is nothing to remove",
}


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


class GlobalProcessSet:
    """Horovod's ``hvd.global_process_set``: every process of the job (the only set here)."""

    process_set_id = 0

    @property
    def ranks(self) -> List[int]:
        return list(range(runtime.size()))

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def included(self) -> bool:
        return True

    def __repr__(self):
        return "ProcessSet(process_set_id=0, ranks=all)"


global_process_set = GlobalProcessSet()


def check_process_set(namespace: str, process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        reject(namespace, "process_set", process_set, "collectives always span every process "
               "of the job. Leave process_set out (or pass hvd.global_process_set).")


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
    """True on a multi-process job (its host collectives run over MPI)."""
    return runtime.is_multi_process()


def mpi_threads_supported() -> bool:
    """Whether MPI was started with MPI_THREAD_MULTIPLE (mpi4py's default)."""
    if not runtime.is_multi_process():
        return False
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: there is no Gloo controller (the launcher always uses mpirun)."""
    return False


def gloo_enabled() -> bool:
    """False: see :func:`gloo_built`."""
    return False


def _build(what: str) -> bool:
    return bool(engines.get_engine_or_default().build_info().get(what, False))


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
__all__ = QUERIES + OPS + ["HorovodNotSupported", "timeline_functions", "global_process_set", "namespace_getattr",
                           "reject", "check_op", "check_process_set", "NOT_PROVIDED"]


def local_layer_weights(local_layers) -> List:
    """The trainable weights of `local_layers` (one layer, a list of layers, or None): what
    Horovod's Partial* wrappers keep per rank."""
    if local_layers is None:
        return []
    layers = list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers]
    return [weight for layer in layers for weight in layer.trainable_weights]
