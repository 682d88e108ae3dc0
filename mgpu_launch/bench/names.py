"""How mgpu-bench names what it runs: the ``--backend`` names, and the name each row carries.

A row's backend says what ran, so a reader can pair rows (Keras-torch against native torch,
eager against compiled):

===================  ===========================================================================
``tensorflow``       Keras on TensorFlow under mgpu (Keras's default ``jit_compile``: XLA on GPUs)
``jax``              Keras on JAX under mgpu
``torch``            Keras on torch under mgpu, its default step (compiled on a GPU, eager on
                     CPU: ``MGPU_TORCH_COMPILE``, docs/torch-compile.md)
``torch+cudagraph``  the same step captured in a CUDA graph (``MGPU_TORCH_CUDA_GRAPH=1``; a row
                     whose capture failed and ran eagerly is ``torch+cudagraph-fell-back``)
``torch+compile``    Keras on torch compiled: ``model.compile(jit_compile=True)`` with
                     ``MGPU_TORCH_COMPILE=1``: mgpu's compiled step
                     (``mgpu_launch/backends/torch/compiled.py``), on any device
``native``           the model written in plain torch, eager, DDP at 2+ processes (``native.py``)
``native+compile``   the same with ``torch.compile`` of the whole step (forward, loss, backward,
                     optimizer step)
``mirrored``         Keras on TensorFlow + ``tf.distribute.MirroredStrategy``, one process
===================  ===========================================================================

``--cuda-graph 0,1`` on a ``torch`` job still gives a ``torch`` and a ``torch+cudagraph`` row
from one job (one model, one process start), as before these names.
"""

from typing import Optional

BACKENDS = ("tensorflow", "jax", "torch", "torch+cudagraph", "torch+compile", "native",
            "native+compile", "mirrored")
#: backend name -> the Keras backend its job runs (None: no Keras, the native torch rows)
KERAS_BACKEND = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch",
                 "torch+cudagraph": "torch", "torch+compile": "torch", "native": None,
                 "native+compile": None, "mirrored": "tensorflow"}
#: the reference rows, as the tables name them; the others are "Keras <backend>"
REFERENCES = {"native": "native torch", "native+compile": "native torch.compile",
              "mirrored": "Keras + tf.distribute.MirroredStrategy"}


def keras_backend(backend: str) -> Optional[str]:
    """The ``KERAS_BACKEND`` of `backend`'s job; None for the native torch rows."""
    return KERAS_BACKEND[backend]


def is_native(backend: str) -> bool:
    """Whether `backend` is a native torch row (no Keras, no mgpu in the step)."""
    return backend.startswith("native")


def compiles(backend: str) -> bool:
    """Whether `backend`'s step is compiled by ``torch.compile`` (``+compile``)."""
    return backend.endswith("+compile")


def row_backend(backend: str, row: dict) -> str:
    """The name a row of `backend`'s job carries: ``+cudagraph`` added to a ``torch`` row whose
    step was captured (``--cuda-graph 1``), ``-fell-back`` when its capture failed."""
    if not row.get("cuda_graph"):
        return backend
    replayed = (row.get("cuda_graph_steps") or {}).get("replayed", 0)
    captured = backend if backend.endswith("+cudagraph") else backend + "+cudagraph"
    return captured if replayed else captured + "-fell-back"


def display(backend: str) -> str:
    """`backend` as the tables' row labels say it."""
    return REFERENCES.get(backend, f"Keras {backend}")
