"""Nobody outside the job can steer it: the inspector's authenticated channel, owned folders."""

import json
import os
import pickle
import re
import socket
import stat
import struct
import sys
import threading
import time

import pytest

import faultkit
import mgpu_launch
from conftest import SCRIPTS, as_nobody, job_env, requires_mpirun, shared_folder
from mgpu_launch.runtime import auth, rendezvous, stall_channel
from mgpu_launcher import python_api as launch

# --- the boundary itself, in one process --------------------------------------------------


def _served(size=3):
    """A PositionServer on loopback and a poll thread; returns (server, positions, stop)."""
    server = stall_channel.PositionServer("127.0.0.1", 0, auth.new_key(), size)
    positions, stop = {}, threading.Event()

    def loop():
        while not stop.is_set():
            positions.update(server.poll(0.05))
        server.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return server, positions, lambda: (stop.set(), thread.join(5))


def _closed_by_server(sock, timeout=10.0):
    """True when the server closes `sock` within `timeout` s (whatever it sent before)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_rank_with_the_key_is_heard_and_a_forger_is_not():
    server, positions, stop = _served()
    try:
        channel = auth.connect("127.0.0.1", server.port, server.key, 2, timeout=10)
        channel.send({"rank": 2, "position": [7, 2, "epoch 1"]})
        with pytest.raises(ConnectionError, match="the listener closed the connection"):
            auth.connect("127.0.0.1", server.port, auth.new_key(), 1, timeout=10)
        deadline = time.monotonic() + 10
        while 2 not in positions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert positions == {2: (7, 2, "epoch 1")}
        # Well-formed lines without the key, and a key holder speaking for another rank.
        forger = socket.create_connection(("127.0.0.1", server.port))
        forger.sendall(b'{"rank": 1, "position": [100, 2, ""]}\n' * 3)
        assert _closed_by_server(forger)
        channel.send({"rank": 1, "position": [100, 2, ""]})
        assert _closed_by_server(channel.sock)
        assert positions == {2: (7, 2, "epoch 1")} and 1 not in server.connections
    finally:
        stop()


def test_signed_files_open_only_with_their_key_and_label():
    key = auth.new_key()
    blob = auth.sign(key, "result 1", b"data")
    assert auth.verify(key, "result 1", blob) == b"data"
    for other_key, label, data in ((key, "result 0", blob), (auth.new_key(), "result 1", blob),
                                   (key, "result 1", blob[:-1] + b"x")):
        with pytest.raises(auth.Rejected, match="result . does not carry this call's signature"):
            auth.verify(other_key, label, data)


# --- an attack on the inspector of a running job ------------------------------------------


def _open_files(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def _attack(address, report):
    """Every misuse of the issue, one after another; what happened goes into `report`."""
    def dial():
        return socket.create_connection(address, timeout=10)

    with dial() as sock:  # garbage
        sock.sendall(os.urandom(300) + b"\xff\xfe\n")
        report["garbage closed"] = _closed_by_server(sock)
    sock = dial()  # a reset
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    with dial() as sock:  # malformed JSON, then JSON of the wrong shape
        sock.sendall(b'{"rank": 1\n{"rank": [1], "position": 5}\n{"rank": 1}\n')
        report["malformed closed"] = _closed_by_server(sock)
    with dial() as sock:  # a well-formed position line for rank 1, once
        sock.sendall(json.dumps({"rank": 1, "position": [1000, 2, ""]}).encode() + b"\n")
        report["forged closed"] = _closed_by_server(sock)
    with dial() as sock:  # a hello with a made-up HMAC
        sock.sendall(b"mgpu-hello 1 " + b"ab" * 16 + b" " + b"cd" * 32 + b"\n")
        report["bad hello closed"] = _closed_by_server(sock)
    for _ in range(500):
        dial().close()
    sock, sent = dial(), 0  # an endless line
    try:
        while sent < 64 << 20:
            sock.sendall(b"x" * 65536)
            sent += 65536
    except OSError:
        pass
    finally:
        sock.close()
    report["endless line cut at"] = sent
    with dial() as sock:  # a connection that says nothing
        report["silent closed"] = _closed_by_server(sock, timeout=auth.HELLO_TIMEOUT_S + 10)


def _forge_until(address, stop):
    """Forged position lines for rank 1 with a growing step, until `stop` is set."""
    step = 10
    while not stop.wait(0.2):
        try:
            with socket.create_connection(address, timeout=5) as sock:
                for _ in range(5):
                    step += 1
                    sock.sendall(json.dumps({"rank": 1, "position": [step, 2, ""]}).encode()
                                 + b"\n")
        except OSError:
            pass


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_attacks_on_the_inspector_change_nothing(tmp_path):
    faultkit.require_backend("tensorflow")
    out, go = str(tmp_path), str(tmp_path / "go")
    with rendezvous.reserved_port() as port:
        pass  # a port free now, for rank 0's stall listener to bind
    address = (rendezvous.host_address(), port)  # what rank 0 binds on this one-host job
    proc = faultkit.start(out, "sleep", 5, KERAS_BACKEND="tensorflow", MGPU_STALL_WARNING_S="5",
                          MGPU_STALL_SHUTDOWN_S="12", MGPU_STALL_PORT=str(port),
                          FAULT_GO_FILE=go)
    report, stop = {}, threading.Event()

    def attacker():
        try:
            deadline = time.monotonic() + 180
            while not all(os.path.exists(f"{out}/ready.{r}.0") for r in (0, 1)):
                if time.monotonic() > deadline or proc.poll() is not None:
                    return
                time.sleep(0.1)
            pid = int(open(f"{out}/pid.0.0").read())
            time.sleep(1.0)
            report["before"] = (_open_files(pid), _rss_mb(pid))
            _attack(address, report)
            deadline = time.monotonic() + 15
            while _open_files(pid) > report["before"][0] and time.monotonic() < deadline:
                time.sleep(0.1)
            report["after"] = (_open_files(pid), _rss_mb(pid))
        finally:
            open(go, "w").close()
            _forge_until(address, stop)

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        run = faultkit.finish(proc, out, timeout=300)
    finally:
        stop.set()
        thread.join(15)
    assert "after" in report, f"the attack did not run: {report}\n{run.explain()}"
    assert all(report[k] for k in ("garbage closed", "malformed closed", "forged closed",
                                   "bad hello closed", "silent closed")), report
    assert report["endless line cut at"] < 16 << 20, report
    (files_before, rss_before), (files_after, rss_after) = report["before"], report["after"]
    assert files_after <= files_before, report
    assert rss_after - rss_before < 20, report
    assert "stall inspector stopped" not in run.stderr, run.explain()

    stalled_at = run.written("fault.0")
    assert stalled_at is not None, run.explain()
    warning = run.first("mgpu: stall: rank 1 has not entered step 6 for")
    assert warning is not None, run.explain()
    assert warning[0] - stalled_at <= 5 + 10, f"warned {warning[0] - stalled_at:.1f} s late"
    summary = run.stderr[run.stderr.index("mgpu-train: the job failed"):]
    assert "root cause: the job stalled: rank 1 has not entered step 6" in summary, run.explain()
    assert not faultkit.leftovers(out, wait=15), faultkit.leftovers(out)


# --- mgpu_launch.run's work folder ------------------------------------------------------------


class _Planted:
    """A pickle that, when loaded, leaves a marker file: proof that someone's code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_another_users_work_folder_or_symlink_is_refused(tmp_path):
    sys.path.insert(0, SCRIPTS)
    import run_fns
    with shared_folder() as base:  # like /tmp: everyone may create entries, only owners rename
        victim = tmp_path / "victim.txt"
        victim.write_text("precious")
        planted = pickle.dumps((_Planted(f"{base}/ran"), (), {}))
        with open(f"{base}/planted.pkl", "wb") as f:
            f.write(planted)
        as_nobody(f"""
            cd {base}
            mkdir -m 0777 open && cp planted.pkl open/payload.pkl
            ln -s {victim} open/result.0.pkl
            mkdir -m 0777 elsewhere && ln -s {base}/elsewhere link
            mkdir -m 0755 theirs
        """)
        refusals = {"open": "belongs to another user",
                    "link": r"\(that is .*\) is not private: it passes through the symbolic link",
                    "theirs": "belongs to another user"}
        for name, why in refusals.items():
            with pytest.raises(PermissionError, match=f"work_dir '{base}/{name}' {why}.*"
                                                      f"another user could swap"):
                mgpu_launch.run(run_fns.rank_and_size, args=(0,), np=2,
                                work_dir=f"{base}/{name}")
        assert not os.path.exists(f"{base}/ran")  # their payload was never loaded
        assert victim.read_text() == "precious"  # nothing written through their symlink
        assert open(f"{base}/open/payload.pkl", "rb").read() == planted
        assert os.listdir(f"{base}/elsewhere") == []


def test_a_folder_writable_by_others_is_refused_even_when_it_is_ones_own(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match=r"is writable by its group or by every user "
                                              r"\(mode 0777; fix with chmod go-w\)"):
        launch.own_folder(str(folder))
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    crowded.chmod(0o777)  # no sticky bit: anyone could rename a folder made in there
    with pytest.raises(PermissionError, match=r"the folder .*crowded' on its path is writable "
                                              r"by its group or by every user without the "
                                              r"sticky bit"):
        launch.own_folder(str(crowded / "work"))


@requires_mpirun
@pytest.mark.job
def test_a_work_folder_is_made_private_and_its_files_too(tmp_path, monkeypatch):
    for name, value in job_env(PYTHONPATH=SCRIPTS + os.pathsep +
                               job_env()["PYTHONPATH"]).items():
        monkeypatch.setenv(name, value)
    sys.path.insert(0, SCRIPTS)
    import run_fns
    work = tmp_path / "new" / "work"
    for offset in (5, 6):  # a second call replaces the first one's files
        every = mgpu_launch.run(run_fns.rank_and_size, args=(offset,), np=2, all_ranks=True,
                                work_dir=str(work), env={"MGPU_ENGINE": "none"})
        assert [r["value"] for r in every] == [offset, offset + 1]
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    files = sorted(os.listdir(work))
    assert files == ["payload.pkl", "result.0.pkl", "result.1.pkl"], files
    assert {stat.S_IMODE((work / name).stat().st_mode) for name in files} == {0o600}


def test_a_payload_without_the_calls_hmac_is_never_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    planted = pickle.dumps((_Planted(str(marker)), (), {}))
    (tmp_path / launch.PAYLOAD).write_bytes(auth.sign(auth.new_key(), "payload", planted))
    monkeypatch.setenv(launch.KEY_VARIABLE, auth.new_key().hex())
    with pytest.raises(RuntimeError, match="payload does not carry this call's signature.*"
                                           "not unpickled"):
        launch.run_rank(str(tmp_path))
    monkeypatch.delenv(launch.KEY_VARIABLE, raising=False)
    with pytest.raises(RuntimeError, match="MGPU_RUN_KEY is not set"):
        launch.run_rank(str(tmp_path))
    assert not marker.exists()
