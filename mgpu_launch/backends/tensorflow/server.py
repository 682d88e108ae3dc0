"""The gRPC server every rank of a TensorFlow job starts for TensorFlow's collective runtime:
the address the other ranks reach it at, and what it exposes (a start-up warning on multi-host
jobs; docs/security.md, "TensorFlow's gRPC server"). The server itself is started by
:meth:`mgpu_launch.backends.tensorflow.engine.TensorFlowEngine.setup`.
"""

from typing import Optional

from mgpu_launch.runtime.rendezvous import job_host_address
from mgpu_launch.config import settings


def grpc_exposure_warning(state, port: int) -> Optional[str]:
    """The start-up warning about the job's gRPC servers (rank 0 prints it), or None.

    TensorFlow's collective runtime needs a gRPC server in every rank, and TensorFlow binds it
    to ``0.0.0.0`` with no way to choose the address and no authentication
    (docs/security.md, "TensorFlow's gRPC server"): a loopback address in the ``ServerDef`` of
    a one-host job still listens on every interface (``ss -ltnp``, issue 58). So a one-host
    job warns too: there the other users of the host, and every network the host is on, reach
    the servers; across hosts, every network of every host.
    """
    if state.rank != 0:
        return None
    one_host = state.local_size >= state.size
    where = ("this host, although every rank runs here" if one_host else
             "every host of this job")
    others = "each other rank" if one_host else "the others"
    who = ("every other user of this host, and whoever can reach it over a network," if one_host
           else "whoever can reach those ports")
    fix = ("keep other users off the host and firewall the ports" if one_host else
           "run the job on a private network, or firewall the ports to the job's hosts")
    return (f"mgpu: warning: TensorFlow's collective runtime listens on every network "
            f"interface of {where} (gRPC, port {port} on rank 0's host, a free port for "
            f"{others}), without authentication: {who} can run TensorFlow operations in the "
            f"ranks, with this job's user's rights (read and write its files, tamper with the "
            f"gradients, stop the job). TensorFlow offers no way to bind one address. On CPU, "
            f"MGPU_TF_TRANSPORT=mpi starts no server; otherwise {fix}. See docs/security.md.")


def reachable_host(state) -> str:
    """Collective: an address the other ranks can reach this one at (MGPU_TF_HOST overrides)."""
    found = job_host_address(state)  # on every rank: it is a collective
    return settings.text("MGPU_TF_HOST") or found
