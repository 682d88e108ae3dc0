"""Rank 0 of a TensorFlow job warns once that the gRPC servers listen on every interface, on
several hosts (issue 51, item 6) and on one (issue 58, item 6: TensorFlow binds every interface
there too; tests/runtime/test_listeners.py sees it with ss); docs/security.md, "TensorFlow's gRPC
server"."""

import types

from mgpu_launch.backends.tensorflow.server import grpc_exposure_warning


def _state(rank, size, local_size):
    return types.SimpleNamespace(rank=rank, size=size, local_size=local_size)


def test_only_rank_0_of_a_multi_host_job_warns_with_what_is_exposed_and_the_mitigation():
    text = grpc_exposure_warning(_state(0, 4, 2), 29500)
    assert text.startswith("mgpu: warning: TensorFlow's collective runtime listens on every "
                           "network interface of every host of this job (gRPC, port 29500")
    for words in ("without authentication", "run TensorFlow operations in the ranks",
                  "no way to bind one address", "private network", "MGPU_TF_TRANSPORT=mpi",
                  "docs/security.md"):
        assert words in text, words
    assert grpc_exposure_warning(_state(1, 4, 2), 29500) is None  # once per job: rank 0


def test_a_one_host_job_warns_too_naming_the_hosts_other_users():
    text = grpc_exposure_warning(_state(0, 4, 4), 29500)
    assert text.startswith("mgpu: warning: TensorFlow's collective runtime listens on every "
                           "network interface of this host, although every rank runs here "
                           "(gRPC, port 29500")
    for words in ("every other user of this host", "without authentication",
                  "MGPU_TF_TRANSPORT=mpi", "keep other users off the host", "docs/security.md"):
        assert words in text, words
    assert grpc_exposure_warning(_state(1, 4, 4), 29500) is None
