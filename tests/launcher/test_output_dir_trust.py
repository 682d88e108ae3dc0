"""``mgpu-train --output-dir DIR`` and the launcher API's ``output_dir`` (issue 58, item 1): the
per-rank logs go only into a private folder, through no link. The attacks run as user nobody
against this (root) process."""

import io
import os
import stat

import pytest

from conftest import as_nobody, explain, launch, launch_ok, requires_mpirun, shared_folder
from mgpu_launch.runtime import folders
from mgpu_launcher import mpirun, relay

pytestmark = [requires_mpirun, pytest.mark.job]
NO_ENGINE = {"MGPU_ENGINE": "none"}
SAY = "import mgpu_launch as m; m.init(); print('said by', m.rank())"


def test_a_link_another_user_planted_in_an_open_folder_is_never_written_through():
    """The issue's reproduction: nobody makes a world-writable DIR and plants rank.0.log as a
    link to a root 0600 file; root's job is refused before it starts, naming the owner."""
    with shared_folder() as base:
        victim = os.path.join(base, "victim")
        with open(victim, "w") as f:
            f.write("root's own\n")
        os.chmod(victim, 0o600)
        as_nobody(f"mkdir -m 0777 {base}/od && ln -s {victim} {base}/od/rank.0.log")
        result = launch("-np", "2", "--output-dir", f"{base}/od", "-c", SAY, **NO_ENGINE)
        assert result.returncode == 2, explain(result)
        assert "--output-dir" in result.stderr and "belongs to another user" in result.stderr, \
            explain(result)
        assert "Use a folder of your own" in result.stderr, explain(result)
        assert "said by" not in result.stdout, explain(result)  # nothing ran
        with open(victim) as f:
            assert f.read() == "root's own\n"


def test_a_link_at_the_folder_itself_is_refused():
    with shared_folder() as base:
        elsewhere = os.path.join(base, "elsewhere")
        os.mkdir(elsewhere, 0o700)
        as_nobody(f"ln -s {elsewhere} {base}/od")
        result = launch("-np", "2", "--output-dir", f"{base}/od", "-c", SAY, **NO_ENGINE)
        assert result.returncode == 2, explain(result)
        assert "symbolic link" in result.stderr and "another user" in result.stderr, \
            explain(result)
        assert os.listdir(elsewhere) == []


def test_logs_are_private_and_a_link_of_an_earlier_run_is_replaced_not_followed(tmp_path):
    logs, victim = tmp_path / "logs", tmp_path / "victim"
    victim.write_text("keep\n")
    launch_ok("-np", "2", "--output-dir", str(logs), "-c", SAY, **NO_ENGINE)
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    for rank in range(2):
        log = logs / f"rank.{rank}.log"
        assert f"said by {rank}" in log.read_text()
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
    (logs / "rank.1.log").unlink()
    (logs / "rank.1.log").symlink_to(victim)  # even one of our own: replaced, not followed
    launch_ok("-np", "2", "--output-dir", str(logs), "-c", SAY, **NO_ENGINE)
    assert not (logs / "rank.1.log").is_symlink() and "said by 1" in (logs / "rank.1.log").read_text()
    assert victim.read_text() == "keep\n"


def test_the_launcher_api_relay_checks_its_folder_too():
    """``mgpu_launcher.api.Config(output_dir=...)`` reaches the relay without the command line's
    check: the relay refuses the folder itself."""
    with shared_folder() as base:
        as_nobody(f"mkdir -m 0777 {base}/od")
        with pytest.raises(folders.UnsafeFolder, match="belongs to another user"):
            relay.OutputRelay(mpirun.OPENMPI, False, f"{base}/od", io.StringIO(), io.StringIO())
