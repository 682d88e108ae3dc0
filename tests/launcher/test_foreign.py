"""The variables mgpu-train gives scripts written for other launchers (mgpu_launcher.foreign):
which ones, with what values, what is left alone, and the hints after a failure. In-process,
no job; the jobs that run real scripts with them are in tests/test_foreign_scripts.py."""

import os
import socket

import pytest

from mgpu_launch.config import environments
from mgpu_launcher import api, cli, foreign

TWO_LOCAL = environments.Placement(rank=1, size=2, local_rank=1, local_size=2, source="openmpi")
SINGLE = environments.SINGLE_PROCESS


def test_a_job_of_one_process_gets_loopback_and_a_held_port():
    environ = {}
    exported = foreign.export(SINGLE, environ)
    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    assert host == "127.0.0.1" and exported == environ
    assert environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == f"127.0.0.1:{port}"
    assert (environ["KERAS_DISTRIBUTION_NUM_PROCESSES"], environ["KERAS_DISTRIBUTION_PROCESS_ID"],
            environ["WORLD_SIZE"], environ["RANK"], environ["LOCAL_RANK"],
            environ["LOCAL_WORLD_SIZE"], environ["GROUP_RANK"],
            environ["GROUP_WORLD_SIZE"]) == ("1", "0", "1", "0", "0", "1", "0", "1")
    assert "TORCHELASTIC_RUN_ID" not in environ  # no elastic agent runs
    # The port is held (no other socket gets it from the kernel), yet a server binds it.
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    server.close()


def test_the_launchers_coordinator_is_used_and_every_rank_gets_its_own_ids():
    environ = {"MGPU_COORDINATOR": "127.0.0.1:4000"}
    foreign.export(TWO_LOCAL, environ)
    assert environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "127.0.0.1:4000,127.0.0.1:4000"
    assert (environ["KERAS_DISTRIBUTION_NUM_PROCESSES"],
            environ["KERAS_DISTRIBUTION_PROCESS_ID"]) == ("2", "1")
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("127.0.0.1", "4000")
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"],
            environ["LOCAL_WORLD_SIZE"]) == ("1", "2", "1", "2")
    assert (environ["GROUP_RANK"], environ["GROUP_WORLD_SIZE"]) == ("0", "1")  # one host
    assert environ["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:4000"  # not JAX's [::]:4000


@pytest.mark.parametrize("environ, expected", [
    ({"MGPU_BIND_ADDRESS": "0.0.0.0"}, "0.0.0.0:4000"),
    ({"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.2:5"}, "10.0.0.2:5"),  # the user's, untouched
    ({"MGPU_COORDINATOR": "node1:4000"}, None),  # a name: JAX's default
])
def test_where_jax_binds(environ, expected):
    environ = {"MGPU_COORDINATOR": "127.0.0.1:4000", **environ}
    foreign.export(TWO_LOCAL, environ)
    assert environ.get("JAX_COORDINATOR_BIND_ADDRESS") == expected


def test_the_addresses_name_each_ranks_host_when_known():
    placement = environments.Placement(rank=0, size=3, local_rank=0, local_size=1,
                                       source="openmpi")
    found = foreign.keras_variables(placement, "10.0.0.1:4000", ["node1", "node2", "node3"])
    assert found["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "10.0.0.1:4000,node2:4000,node3:4000"


def test_a_users_own_choices_are_left_alone():
    environ = {"MGPU_COORDINATOR": "127.0.0.1:4000", "MASTER_ADDR": "node7",
               "MASTER_PORT": "29500", "KERAS_DISTRIBUTION_JOB_ADDRESSES": "node7:1234"}
    foreign.export(TWO_LOCAL, environ)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("node7", "29500")
    assert environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "node7:1234"
    assert "KERAS_DISTRIBUTION_PROCESS_ID" not in environ
    assert environ["RANK"] == "1"  # the ranks' own ids always come from the placement


def test_nothing_is_touched_under_torchrun():
    placement = environments.Placement(rank=1, size=2, local_rank=1, local_size=2,
                                       source="torchrun")
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert foreign.export(placement, environ) == {}
    assert environ == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_without_mpi_across_the_job_rank_0_warns_and_no_coordinator_is_made_up():
    """srun --mpi=none: no PMIx, so MPI would give singletons; nothing to agree over."""
    placement = environments.Placement(rank=0, size=2, local_rank=0, local_size=1,
                                       source="slurm")
    said = []
    environ = {}
    foreign.export(placement, environ, warn=said.append)
    assert "MASTER_ADDR" not in environ and "KERAS_DISTRIBUTION_JOB_ADDRESSES" not in environ
    assert environ["RANK"] == "0" and environ["WORLD_SIZE"] == "2"
    assert "GROUP_RANK" not in environ  # two hosts, and which one is ours is not known
    assert len(said) == 1 and "srun --mpi=pmix" in said[0] and "MGPU_COORDINATOR" in said[0]


def test_the_launcher_holds_one_coordinator_for_a_one_host_job(tmp_path, monkeypatch):
    monkeypatch.delenv("MGPU_COORDINATOR", raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    first = api.build_job(cli.parse_args(["-np", "2", str(script)]))[2]["MGPU_COORDINATOR"]
    again = api.build_job(cli.parse_args(["-np", "2", str(script)]))[2]["MGPU_COORDINATOR"]
    assert first == again and first.startswith("127.0.0.1:")  # every attempt: the same port
    command, _, env = api.build_job(cli.parse_args(["-np", "2", "-H", "localhost:1,node2:1",
                                                    str(script)]))
    assert "MGPU_COORDINATOR" not in env  # rank 0's host is not this one: the ranks agree
    monkeypatch.setenv("MGPU_COORDINATOR", "10.0.0.1:29500")
    env = api.build_job(cli.parse_args(["-np", "2", str(script)]))[2]
    assert env["MGPU_COORDINATOR"] == "10.0.0.1:29500"  # the user's wins


@pytest.mark.parametrize("text, environ, expected", [
    ("The provided job_addresses ['a:1', 'a:1'] has 2 jobs, but num_processes is 3",
     {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, "initialize() without num_processes"),
    ("CUDA error: invalid device ordinal",
     {"MGPU_GPU": "1", "CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "1"}, "--no-pin"),
    ("CUDA error: invalid device ordinal", {"LOCAL_RANK": "1"}, None),  # not pinned by us
    ("something else", {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "MGPU_GPU": "1"}, None),
    # what the guide across the cluster's nodes raised with Debian's /etc/hosts (test_cluster)
    ("UNKNOWN: Gloo context initialization failed: [external/gloo/gloo/transport/tcp/pair.cc"
     ":152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:22432", {},
     "map its name (hostname) to its network address"),
    ("Gloo context initialization failed: remote=[10.213.0.2]:22432", {}, None),  # not ours
])
def test_hints_only_for_the_failures_these_variables_cause(text, environ, expected):
    hint = foreign.hint_for(ValueError(text), environ)
    assert (hint is None) if expected is None else (expected in hint)


def test_a_job_started_from_a_rank_does_not_inherit_that_ranks_variables(tmp_path, monkeypatch):
    """mgpu_launch.run() called in a script that mgpu-train runs: its ranks get their own."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "MGPU_COORDINATOR",
                 "KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        monkeypatch.delenv(name, raising=False)
    environ = dict(os.environ)
    exported = foreign.export(SINGLE, environ)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "5")  # changed since: not ours any more, kept
    script = tmp_path / "train.py"
    script.write_text("")
    env = api.build_job(cli.parse_args(["-np", "2", str(script)]))[2]
    assert "MASTER_ADDR" not in env and "KERAS_DISTRIBUTION_JOB_ADDRESSES" not in env
    assert env["RANK"] == "5"


@pytest.mark.parametrize("backend, visible, expected", [
    ("jax", "0,1", "1"),  # JAX sees both GPUs: the rank's own is named for jax.distributed
    ("torch", "0,1", None),  # torch sees only its GPU (CUDA_VISIBLE_DEVICES=1)
    ("jax", None, None),  # no GPU: nothing pinned
])
def test_a_jax_rank_takes_only_its_pinned_gpu(backend, visible, expected):
    from mgpu_launch.config import devices

    environ = {"KERAS_BACKEND": backend}
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    else:
        environ["CUDA_VISIBLE_DEVICES"] = ""
    from mgpu_launcher import worker
    devices.pin_gpu(1, 2, environ, by_visible_devices=worker.pins_by_visible_devices(environ))
    foreign.export_jax_device(environ)
    assert environ.get("JAX_LOCAL_DEVICE_IDS") == expected
