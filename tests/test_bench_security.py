"""mgpu-bench writes only where its user meant and reuses only results its user's own call
wrote (issue 51, item 1). The attacks run as user nobody against this (root) process."""

import hashlib
import json
import os
import platform
import subprocess
import sys

import pytest

from conftest import ROOT, as_nobody, explain, python_env, shared_folder
from mgpu_launch import bench
from mgpu_launch.bench import result_file, resume

ARGV = ["--cpu", "--gpus", "1", "--model", "mlp-tiny", "--steps", "5", "--backend", "jax"]
LABEL = "jax-mlp-tiny-float32-np1"


def _bench(*argv):
    return subprocess.run([sys.executable, "-m", "mgpu_launch.bench", *argv], cwd=ROOT,
                          env=python_env(), capture_output=True, text=True, timeout=120)


def _forged_result(variant="eager"):
    return {"rows": [{"model": "mlp-tiny", "data": "host", "prefetch": 2, "variant": variant,
                      "data_format": "channels_last", "batch_per_gpu": 32,
                      "img_per_sec": 1e9, "per_rank_img_per_sec": [1e9]}],
            "device": "cpu", "versions": {"python": "3"}}


def _header(out, digests=None):
    """The header an earlier --resume-able call would have written: everything in it is
    public (options, host name, no GPUs)."""
    header = {"date": "2026-11-27T00:00:00+00:00", "machine": platform.node(), "gpus": None,
              "options": bench.parse_args(ARGV + ["--out", out]).options}
    if digests is not None:
        header.update(invocation="ab" * 16, results=digests)
    return {"header": header, "rows": []}


def test_another_users_out_folder_with_planted_results_and_a_link_is_refused(tmp_path):
    victim = tmp_path / "victim.md"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    with shared_folder() as base:
        out = f"{base}/out"
        forged = _forged_result("x |\n\n# attacker's line")
        with open(f"{base}/result.json", "w") as f:
            json.dump(forged, f)
        digest = hashlib.sha256(open(f"{base}/result.json", "rb").read()).hexdigest()
        with open(f"{base}/results.json", "w") as f:
            json.dump(_header(out, {LABEL: digest}), f)
        as_nobody(f"""
            mkdir -m 0777 {out} {out}/logs
            cp {base}/results.json {out}/results.json
            cp {base}/result.json {out}/logs/{LABEL}.json
            ln -s {victim} {out}/results.md
            chmod 0666 {out}/results.json {out}/logs/{LABEL}.json
        """)
        run = _bench(*ARGV, "--out", out, "--resume")
        assert run.returncode == 2, explain(run)
        assert f"--out '{out}' belongs to another user" in run.stderr, explain(run)
        assert victim.read_text() == "precious\n"  # nothing written through their link
        assert "attacker" not in run.stdout
        # Nor a folder of one's own in a path another user may redirect (their link on it).
        as_nobody(f"mkdir -m 0700 {base}/theirs && ln -s {tmp_path} {base}/link")
        run = _bench(*ARGV, "--out", f"{base}/link/out", "--resume")
        assert run.returncode == 2 and "passes through the symbolic link" in run.stderr, \
            explain(run)
        assert not (tmp_path / "out").exists()


def test_resume_reuses_only_recorded_unchanged_results_and_checks_every_field(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True, mode=0o700)
    out.chmod(0o700)
    result = out / "logs" / f"{LABEL}.json"
    result.write_text(json.dumps(_forged_result()))
    digest = hashlib.sha256(result.read_bytes()).hexdigest()
    options = bench.parse_args(ARGV + ["--out", str(out)]).options
    # An older (or forged) header without the call's key and digests: refused.
    (out / "results.json").write_text(json.dumps(_header(str(out))))
    with pytest.raises(resume.ResumeError, match="does not record its options, its call's key"):
        resume.previous_header(str(out), options, platform.node(), None)
    (out / "results.json").write_text(json.dumps(_header(str(out), {LABEL: digest})))
    header = resume.previous_header(str(out), options, platform.node(), None)
    assert resume.reusable(header, LABEL, str(result))[1] == digest
    # Changed after the call recorded it: run again, not reused.
    result.write_text(json.dumps(_forged_result("other")))
    assert resume.reusable(header, LABEL, str(result)) is None
    # Every field that reaches results.md is checked, text for plain characters.
    for field, value, why in (("variant", "a |\n# b", "variant: expected a short plain text"),
                              ("img_per_sec", float("nan"), "NaN is not a number"),
                              ("data", "host\n", "data: expected one of"),
                              ("per_rank_img_per_sec", [-1], r"\[0\]: expected a finite"),
                              ("batch_per_gpu", True, "batch_per_gpu: expected an integer")):
        forged = _forged_result()
        forged["rows"][0][field] = value
        result.write_text(json.dumps(forged))
        with pytest.raises(result_file.BadResult, match=why):
            result_file.read(str(result))
    result.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(result_file.BadResult, match="nested deeper than 32 levels"):
        result_file.read(str(result))
    result.unlink()
    os.mkfifo(result)  # a FIFO would block a plain open() forever
    with pytest.raises(result_file.BadResult, match="is not a regular file"):
        result_file.read(str(result))
