"""A one-host job listens on no wildcard address (docs/security.md, "Listeners").

A real 2-rank ``mgpu-train`` job on the backend under test waits after ``mgpu.init()``
(tests/scripts/fail.py hang); ``ss -ltnp`` then lists every listening TCP socket of its processes
(mpirun/prterun and the ranks, found by their pids), and none may be bound to ``0.0.0.0``,
``[::]`` or ``*`` (IPv6 and IPv4 at once). Two exceptions are allowed because the code that
binds them offers no address to bind, and docs/security.md names both:

* ``prterun``'s out-of-band listeners (PRRTE's oob_tcp_listener.c binds INADDR_ANY and
  in6addr_any whatever the MCA parameters say);
* TensorFlow's gRPC server with the default transport (grpc_server_lib.cc listens on
  ``0.0.0.0:port``): the TensorFlow job runs with ``MGPU_TF_TRANSPORT=mpi`` (no server), and
  a second job with the default transport checks that the gRPC ports are the only other
  wildcard listeners.
"""

import glob
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Set, Tuple

import pytest

from conftest import ROOT, SCRIPTS, job_env, requires_mpirun

pytestmark = [pytest.mark.job, pytest.mark.backend, requires_mpirun]

FAIL = os.path.join(SCRIPTS, "fail.py")
WILDCARDS = ("0.0.0.0", "[::]", "*", "[::ffff:0.0.0.0]")
_USER = re.compile(r'\("([^"]*)",pid=(\d+),fd=\d+\)')


def _descendants(root: int) -> Dict[int, str]:
    """pid -> command name of `root` and every process below it (ps, right now)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    children: Dict[int, List[Tuple[int, str]]] = {}
    names = {}
    for row in rows:
        pid, ppid, name = row.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), name))
        names[int(pid)] = name
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        found[pid] = names.get(pid, "?")
        todo += [child for child, _ in children.get(pid, [])]
    return found


def _listeners(pids: Set[int]) -> List[Tuple[str, int, str, int]]:
    """(command, pid, bound address, port) of every listening TCP socket of `pids` (ss)."""
    rows = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    found = []
    for row in rows:
        fields = row.split()
        address, _, port = fields[3].rpartition(":")
        for name, pid in _USER.findall(row):
            if int(pid) in pids:
                found.append((name, int(pid), address, int(port)))
    return found


def _alive(pids) -> List[str]:
    """``ps`` lines of those of `pids` still running (not zombies)."""
    rows = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True).stdout.splitlines()
    return [row for row in rows if row.split()[1][0] not in "ZX"]


def _listeners_of_a_waiting_job(tmp_path, backend: str, **env) -> Tuple[list, Dict, str]:
    """Start a 2-rank job that waits after mgpu.init(), list its listeners, end it.

    Returns (listeners, {pid: command} of the job's processes, the job's output). Fails the
    test, after ending the job, when it does not come up in time or leaves a process behind.
    """
    prefix = str(tmp_path / "pid")
    log = open(tmp_path / "job.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mgpu_launcher", "-np", "2", FAIL, "hang", "99", prefix],
        cwd=ROOT, env=job_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="0", **env),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    processes: Dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while len(glob.glob(prefix + ".*")) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"the job did not reach its wait (exit {proc.poll()}):\n"
                            f"{log.read()[-6000:]}")
            time.sleep(0.2)
        processes = _descendants(proc.pid)
        listening = _listeners(set(processes))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # mgpu-train stops every rank
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while processes and _alive(processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(processes) if processes else []
        for row in left:
            os.kill(int(row.split()[0]), signal.SIGKILL)
        log.seek(0)
        output = log.read()
        log.close()
    assert not left, f"processes of the job still running after it was stopped: {left}"
    return listening, processes, output


def _wildcards(listening, processes, allowed_ports=()) -> List[Tuple[str, int, str, int]]:
    """The listeners bound to every interface, less the two allowed (module docstring)."""
    mpirun = {pid for pid, name in processes.items() if name in ("prterun", "mpirun")}
    return [entry for entry in listening if entry[2] in WILDCARDS
            and entry[1] not in mpirun and entry[3] not in allowed_ports]


def _require(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"KERAS_BACKEND={backend}: {backend} is not installed")


def test_a_one_host_job_binds_no_listener_to_every_interface(tmp_path, backend):
    _require(backend)
    env = {"MGPU_TF_TRANSPORT": "mpi"} if backend == "tensorflow" else {}
    listening, processes, output = _listeners_of_a_waiting_job(tmp_path, backend, **env)
    ranks = [pid for pid, name in processes.items() if name.startswith("python")]
    assert any(entry[1] in ranks for entry in listening), (
        f"no rank listens at all (not even the stall inspector): is ss seeing the job?\n"
        f"{listening}\n{processes}")
    wide = _wildcards(listening, processes)
    assert not wide, (f"listeners on every interface (command, pid, address, port): {wide}\n"
                      f"all listeners: {listening}\n{output[-3000:]}")


def test_tensorflow_grpc_server_is_the_one_wildcard_listener_of_its_transport(tmp_path,
                                                                               backend):
    """The default TF transport: TensorFlow's gRPC server binds 0.0.0.0 (hard-coded), which
    docs/security.md says; everything else of the job is still bound to the job's address.
    Fails when TensorFlow changes that, so that the docs change with it."""
    if backend != "tensorflow":
        pytest.skip("the TensorFlow engine's gRPC server")
    _require(backend)
    # the servers' "Started server with target" lines: start-up noise the launcher drops
    listening, processes, output = _listeners_of_a_waiting_job(tmp_path, backend,
                                                               MGPU_STARTUP_NOISE="1")
    grpc_ports = {int(port) for port in re.findall(r"grpc://[^:\s]+:(\d+)", output)}
    assert len(grpc_ports) == 2, f"expected both ranks' gRPC servers in the log:\n{output}"
    grpc = [entry for entry in listening if entry[3] in grpc_ports]
    assert grpc and all(entry[2] in WILDCARDS for entry in grpc), (
        f"TensorFlow's gRPC server now binds {grpc}: update docs/security.md's listener "
        f"table and the TensorFlow engine")
    wide = _wildcards(listening, processes, allowed_ports=grpc_ports)
    assert not wide, (f"listeners on every interface besides TensorFlow's gRPC server: {wide}\n"
                      f"all listeners: {listening}")
    # the job's ServerDef names the job's (loopback) address, and still (ss above) every
    # interface: a one-host job says so (issue 58, item 6)
    assert output.count("TensorFlow's collective runtime listens on every network interface "
                        "of this host") == 1, output[-3000:]
