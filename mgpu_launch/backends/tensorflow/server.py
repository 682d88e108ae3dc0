"""The gRPC server every rank of a TensorFlow job starts for TensorFlow's collective runtime:
the address the other ranks reach it at, and what it exposes (a start-up warning on multi-host
jobs; docs/security.md, "TensorFlow's gRPC server"). The server itself is started by
:meth:`mgpu_launch.backends.tensorflow.engine.TensorFlowEngine.setup`.
"""

from typing import Optional

from mgpu_launch.runtime.rendezvous import job_host_address
from mgpu_launch.config import settings


def grpc_exposure_warning(state, port: int) -> Optional[str]:
    """The start-up warning of a multi-host job's gRPC servers (rank 0 prints it), or None.

    TensorFlow's collective runtime needs a gRPC server in every rank, and TensorFlow binds it
    to ``0.0.0.0`` with no way to choose the address and no authentication
    (docs/security.md, "TensorFlow's gRPC server"). On one host the job's user chose the host;
    across hosts the server is reachable from every network the hosts are on.
    """
    if state.rank != 0 or state.local_size >= state.size:
        return None
    return (f"mgpu: warning: TensorFlow's collective runtime listens on every network "
            f"interface of every host of this job (gRPC, port {port} on rank 0's host, a free "
            f"port on the others), without authentication: whoever can reach those ports can "
            f"run TensorFlow operations in the ranks, with this job's user's rights (read and "
            f"write its files, tamper with the gradients, stop the job). TensorFlow offers no "
            f"way to bind one address. Run the job on a private network, or firewall the "
            f"ports to the job's hosts; on CPU, MGPU_TF_TRANSPORT=mpi starts no server. See "
            f"docs/security.md.")


def reachable_host(state) -> str:
    """Collective: an address the other ranks can reach this one at (MGPU_TF_HOST overrides)."""
    found = job_host_address(state)  # on every rank: it is a collective
    return settings.text("MGPU_TF_HOST") or found
