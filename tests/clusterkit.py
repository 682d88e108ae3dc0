"""The namespace clusters of scripts/cluster.sh as the cluster tests see them (the ``cluster`` and
``mpi_operator_cluster`` fixtures of conftest.py build one of each per test session and tear
them down).

``cluster``: node1 and node2, network + UTS + mount namespaces joined by a bridge, each with its
own sshd (root); ``mpi_operator_cluster``: an MPIJob's launcher and two worker pods whose only
process is a non-root sshd (scripts/cluster_mpi_operator.sh). Their nodes share this machine's
process ids (no PID namespace), so a test can signal the ranks directly; node1 and node2 also
share its file system (as nodes share NFS), the pods only their /mnt volume.
"""

import os
import pathlib
import subprocess
import sys
import time

from conftest import ROOT, job_env, lean_ranks, python_env, require_job_marker

CLUSTER_SH = os.path.join(ROOT, "scripts", "cluster.sh")
#: rank -> node with -H node1:2,node2:2 (Open MPI fills each host's slots in order)
NODE_OF = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}


class Cluster:
    """A running scripts/cluster.sh cluster: run commands on its nodes, list their processes."""

    #: every node; mgpu-train runs on the first
    nodes = ("node1", "node2")

    def __init__(self, directory):
        self.directory = str(directory)

    def command(self, node, *argv):
        return [CLUSTER_SH, "exec", self.directory, node, *argv]

    def _mgpu_train(self, argv, env):
        """(the command that runs ``mgpu-train argv...`` on the first node, its environment)"""
        return (self.command(self.nodes[0], sys.executable, "-m", "mgpu_launcher", *argv),
                job_env(**env))

    def mgpu_train(self, *argv, timeout=300, **env):
        """Run ``mgpu-train argv...`` on the first node; returns the CompletedProcess."""
        command, environ = self._mgpu_train(argv, env)
        return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True,
                              timeout=timeout)

    def start_mgpu_train(self, *argv, **env):
        """Start ``mgpu-train argv...`` on the first node without waiting; returns the Popen."""
        command, environ = self._mgpu_train(argv, env)
        return subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def leftovers(self):
        """Every process still running on any node, besides its first (``ps`` lines)."""
        found = []
        for node in self.nodes:
            pids = subprocess.run([CLUSTER_SH, "pids", self.directory, node], check=True,
                                  capture_output=True, text=True, timeout=30).stdout.split()
            if pids:
                ps = subprocess.run(["ps", "-o", "pid,user,args", "-p", ",".join(pids)],
                                    capture_output=True, text=True, timeout=30).stdout
                found += [f"{node}: {line}" for line in ps.splitlines()[1:]]
        return found

    def wait_until_empty(self, seconds=15):
        deadline = time.monotonic() + seconds
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


class MpiOperatorCluster(Cluster):
    """The pods of the MPIJob ``mgpu-digits`` (slotsPerWorker 2) that scripts/cluster.sh up DIR
    mpi-operator plays: mgpu-train runs in the launcher pod as its container would (uid 10001,
    only the image's and the operator's environment, cwd /home/mgpu); the workers run only sshd.
    """

    nodes = ("launcher", "worker-0", "worker-1")
    JOB = "mgpu-digits"
    #: where every pod mounts the shared volume (DIR/shared here)
    VOLUME = "/mnt"

    @staticmethod
    def up_env():
        """The environment of ``cluster.sh up``: the pods' PATH and PYTHONPATH (this Python and
        checkout stand in for the image's /opt/venv; the ranks skip the optional packages they
        never use, as every test's do: conftest.lean_ranks), and this Python's folders, which
        the pods' non-root user must be able to reach."""
        env = lean_ranks(python_env())
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/sbin",
                                       "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        env["MGPU_CLUSTER_EXPOSE"] = os.pathsep.join(
            {os.path.realpath(path) for path in (sys.prefix, sys.base_prefix, sys.executable)}
            | {os.path.realpath(path) for path in env["PYTHONPATH"].split(os.pathsep) if path})
        return env

    def fqdn(self, node):
        """A pod's name in the operator's hostfile and discover_hosts.sh."""
        return f"{self.JOB}-{node}.{self.JOB}.default.svc"

    def _mgpu_train(self, argv, env):
        # `env` is what the MPIJob's container spec would add (cluster.sh exec starts the
        # command with the pod's environment alone)
        require_job_marker()
        return (self.command(self.nodes[0], "env", *[f"{k}={v}" for k, v in env.items()],
                             sys.executable, "-m", "mgpu_launcher", *argv), job_env())

    def volume_folder(self, name):
        """A new folder on the pods' shared volume: (its path here, its path in the pods)."""
        here = pathlib.Path(self.directory, "shared", name)
        here.mkdir()
        os.chown(here, 10001, 10001)
        return here, f"{self.VOLUME}/{name}"

    def pod_path(self, node, path):
        """`path` in that pod's own file system, seen from here (through its first process)."""
        pid = pathlib.Path(self.directory, f"{node}.pid").read_text().strip()
        return pathlib.Path(f"/proc/{pid}/root", path.lstrip("/"))

    def running(self, node):
        return pathlib.Path(self.directory, f"{node}.pid").exists()

    def stop(self, node):
        """The pod is deleted: every process in it is SIGKILLed (its sshd, prted, ranks)."""
        subprocess.run([CLUSTER_SH, "stop", self.directory, node], check=True, timeout=60)

    def start(self, node):
        """Its replacement starts (the same name and address); returns once the launcher
        reaches its sshd (scripts/cluster.sh waits at most 20 s)."""
        subprocess.run([CLUSTER_SH, "start", self.directory, node], check=True, timeout=60)

    def discover(self, *workers):
        """Rewrite the launcher's /etc/mpi/discover_hosts.sh as the operator does for these
        running workers (v0.8.2: ``echo NAME`` per worker, no slots), in one rename."""
        script = pathlib.Path(self.directory, "mpi", "discover_hosts.sh")
        new = script.with_name(".discover_hosts.sh.new")
        new.write_text("#!/bin/sh\n" + "".join(f"echo {self.fqdn(w)}\n" for w in workers))
        new.chmod(0o555)
        new.replace(script)
