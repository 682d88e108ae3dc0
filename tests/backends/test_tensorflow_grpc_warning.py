"""Rank 0 of a multi-host TensorFlow job warns once that the gRPC servers listen on every
interface (issue 51, item 6; docs/security.md, "TensorFlow's gRPC server")."""

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
    assert grpc_exposure_warning(_state(0, 4, 4), 29500) is None  # one host
