"""The 2-node cluster of scripts/cluster.sh as the cluster tests see it (the ``cluster`` fixture
of conftest.py builds one per test session and tears it down).

node1 and node2 are network + UTS + mount namespaces joined by a bridge, each with its own sshd;
they share this machine's file system (as nodes share NFS) and its process ids (no PID
namespace), so a test can read the ranks' files and signal them directly.
"""

import os
import subprocess
import sys
import time

from conftest import ROOT, job_env

CLUSTER_SH = os.path.join(ROOT, "scripts", "cluster.sh")
#: rank -> node with -H node1:2,node2:2 (Open MPI fills each host's slots in order)
NODE_OF = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}


class Cluster:
    """A running scripts/cluster.sh cluster: run commands on its nodes, list their processes."""

    def __init__(self, directory):
        self.directory = str(directory)

    def command(self, node, *argv):
        return [CLUSTER_SH, "exec", self.directory, node, *argv]

    def mgpu_train(self, *argv, timeout=300, **env):
        """Run ``mgpu-train argv...`` on node1; returns the CompletedProcess."""
        return subprocess.run(self.command("node1", sys.executable, "-m", "mgpu_launcher", *argv),
                              cwd=ROOT, env=job_env(**env), capture_output=True, text=True,
                              timeout=timeout)

    def start_mgpu_train(self, *argv, **env):
        """Start ``mgpu-train argv...`` on node1 without waiting; returns the Popen."""
        return subprocess.Popen(self.command("node1", sys.executable, "-m", "mgpu_launcher",
                                             *argv),
                                cwd=ROOT, env=job_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def leftovers(self):
        """Every process still running on either node, besides its sshd (``ps`` lines)."""
        found = []
        for node in ("node1", "node2"):
            pids = subprocess.run([CLUSTER_SH, "pids", self.directory, node], check=True,
                                  capture_output=True, text=True, timeout=30).stdout.split()
            if pids:
                ps = subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(pids)],
                                    capture_output=True, text=True, timeout=30).stdout
                found += [f"{node}: {line}" for line in ps.splitlines()[1:]]
        return found

    def wait_until_empty(self, seconds=15):
        deadline = time.monotonic() + seconds
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left
