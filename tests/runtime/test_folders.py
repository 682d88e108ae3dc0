"""The folders mgpu writes into and reads back from: another user can neither own nor redirect
them (mgpu_launch/runtime/folders.py). The attacks run as user nobody against this (root)
process."""

import os
import stat

import pytest

from conftest import as_nobody, shared_folder
from mgpu_launch.runtime import folders
from mgpu_launcher import python_api as launch


def test_a_folder_another_user_made_is_refused_with_what_is_wrong_and_the_fix():
    with shared_folder() as base:
        as_nobody(f"mkdir -m 0700 {base}/theirs")
        with pytest.raises(PermissionError, match=(
                rf"^backup_dir '{base}/theirs' belongs to another user \(uid 65534; you are "
                rf"uid 0\)\. Use a folder of your own that only you may write in")):
            folders.private_folder(f"{base}/theirs", "backup_dir")


def test_a_link_another_user_owns_higher_up_the_path_is_refused(tmp_path):
    # Issue 37, item 5: run() checked only the work folder's immediate parent, so a link of
    # theirs further up decided where root wrote (here: into a private folder of root's).
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with shared_folder() as base:
        as_nobody(f"ln -s {private} {base}/up")
        with pytest.raises(PermissionError, match=(
                rf"mgpu_launch.run: work_dir '{base}/up/work' \(that is '{private}/work'\) is "
                rf"not private: it passes through the symbolic link '{base}/up' \(to "
                rf"'{private}'\), which belongs to another user \(uid 65534; you are uid 0\), "
                rf"who could point it elsewhere, so another user could swap the function")):
            launch.own_folder(f"{base}/up/work")
        assert os.listdir(private) == []


def test_a_folder_on_the_path_that_others_may_write_in_needs_the_sticky_bit(tmp_path):
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for mode in (0o777, 0o775):  # every user, or the group: either may rename what is in it
        crowded.chmod(mode)
        with pytest.raises(folders.UnsafeFolder, match=(
                rf"the folder '{crowded}' on its path is writable by its group or by every "
                rf"user without the sticky bit \(mode 0{mode:o}\)")):
            folders.private_folder(str(crowded / "deeper" / "backup"))
        assert os.listdir(crowded) == []
    crowded.chmod(0o1777)  # as /tmp: nobody renames entries that are not theirs
    made = folders.private_folder(str(crowded / "deeper" / "backup"))
    assert made == str(crowded / "deeper" / "backup")
    assert stat.S_IMODE(os.stat(crowded / "deeper").st_mode) == 0o700


def test_a_folder_its_group_may_write_in_is_refused_and_ones_own_link_is_followed(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(folders.UnsafeFolder, match=r"is writable by its group or by every user "
                                                   r"\(mode 0770; fix with chmod go-w\)"):
        folders.private_folder(str(shared), "backup_dir")
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(real)  # ours: the path stays ours to change
    assert folders.private_folder(str(tmp_path / "link"), create=False) == str(real)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        folders.private_folder(str(tmp_path / "absent"), create=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        folders.private_folder(str(tmp_path / "file"))
    with pytest.raises(NotADirectoryError, match="Not a directory"):
        folders.private_folder(str(tmp_path / "file" / "backup"))


def test_create_new_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(FileExistsError):
        folders.create_new(str(tmp_path / "planted"), b"overwritten")
    assert victim.read_text() == "precious"
    folders.create_new(str(tmp_path / "new"), b"data")
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o600
