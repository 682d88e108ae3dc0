"""The timeline writes only where its user meant and merges only plain files (issue 51, item
2). The attacks run as user nobody against this (root) process, loopback-free, in seconds."""

import json
import os
import resource
import stat
import subprocess
import sys

import pytest

from conftest import ROOT, as_nobody, python_env, shared_folder
from mgpu_launch.runtime import folders, timeline, trace_files

TRACE = {"traceEvents": [{"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 1, "dur": 2}]}


def _merge(out, *inputs):
    """The merge command in its own process: bounded in time (a FIFO) and memory (/dev/zero)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    return subprocess.run([sys.executable, "-m", "mgpu_launch.runtime.trace_files", "merge",
                           out, *inputs], cwd=ROOT, env=python_env(), capture_output=True,
                          text=True, timeout=30, preexec_fn=limit)


def test_a_link_or_folder_of_another_user_on_the_timeline_path_is_refused(tmp_path):
    victim = tmp_path / "timeline.json"
    victim.write_text("precious")
    victim.chmod(0o600)
    with shared_folder() as base:
        as_nobody(f"ln -s {tmp_path} {base}/link && mkdir -m 0777 {base}/open")
        for path, why in ((f"{base}/link/timeline.json", "passes through the symbolic link"),
                          (f"{base}/open/timeline.json", "belongs to another user")):
            with pytest.raises(folders.UnsafeFolder, match=why):
                trace_files.write_document(path, TRACE)  # every trace and dump goes here
            with pytest.raises(folders.UnsafeFolder, match=why):  # checked at mgpu.init()
                timeline.start(path, state=None)  # MGPU_TIMELINE, --timeline, run(timeline=)
        assert victim.read_text() == "precious"
        assert os.listdir(f"{base}/open") == []
    own = tmp_path / "new" / "timeline.json"
    trace_files.write_document(str(own), TRACE)
    assert stat.S_IMODE(own.stat().st_mode) == 0o600
    assert stat.S_IMODE(own.parent.stat().st_mode) == 0o700


def test_merge_reads_regular_files_only_bounded_and_never_through_a_link(tmp_path):
    secret = tmp_path / "root-only.json"
    secret.write_text(json.dumps(TRACE))
    secret.chmod(0o600)
    with shared_folder() as base:
        as_nobody(f"""
            cd {base}
            ln -s {secret} link.json
            ln -s /dev/zero zero.json
            mkfifo fifo.json
            python3 -c "print('[' * 200000 + ']' * 200000)" > deep.json
        """)
        out = str(tmp_path / "merged.json")
        for name, why in (("link.json", "is a symbolic link"),
                          ("fifo.json", "is not a regular file"),
                          ("zero.json", "is a symbolic link"),
                          ("deep.json", "nested deeper than 32 levels")):
            run = _merge(out, f"{base}/{name}")
            assert run.returncode == 1 and why in run.stderr, (name, run.stderr[-2000:])
            assert not os.path.exists(out)
        run = _merge(out, "/dev/zero")
        assert run.returncode == 1 and "is not a regular file" in run.stderr, run.stderr[-2000:]
        run = _merge(out, str(secret))  # one's own file, named directly: merged, kept private
        assert run.returncode == 0, run.stderr
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
