"""Issue 18.7/18.8/18.9: directories root uses in world-writable places.

The dev cluster's state directory (/var/tmp) and ring root (/dev/shm), and the
production ring root (/dev/shm/slurmguard), each pre-created by an
unprivileged user: root must refuse them (dev cluster) or take them back at
boot (tmpfiles.d) instead of writing where the user chose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from slurmguard_dev.devcluster.cluster import ClusterSpec, DevCluster, DevClusterError, secure_dir
from tests.fixtures.security import attacker, run_as  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tmp_path():
    """A private directory the attacker can reach (pytest's own is 0700 root's)."""
    d = Path(tempfile.mkdtemp(prefix="sg-dirs-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], timeout=60)


@pytest.fixture
def sticky(tmp_path):
    """A world-writable sticky directory like /var/tmp or /dev/shm."""
    d = tmp_path / "vartmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


def test_dev_cluster_state_dir_planted_by_a_user_is_refused(attacker, sticky, tmp_path):
    """Attack (18.8): a user who created /var/tmp/slurmguard-devcluster first chose where
    root wrote the prolog, the policy and the munge key."""
    planted = sticky / "slurmguard-devcluster"
    assert run_as(attacker, ["mkdir", "-m", "0755", str(planted)]).returncode == 0
    with pytest.raises(DevClusterError, match=f"belongs to uid {attacker.pw_uid}"):
        secure_dir(planted)
    c = DevCluster(ClusterSpec(state_dir=planted, nodes=1))
    if shutil.which("slurmctld") and shutil.which("munged"):
        with pytest.raises(DevClusterError, match="refusing to use it"):
            c.up()
        assert list(planted.iterdir()) == []  # root wrote nothing there
    # a symlink to a place of the user's choosing is not followed either
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = sticky / "slurmguard-link"
    assert run_as(attacker, ["ln", "-s", str(target), str(link)]).returncode == 0
    with pytest.raises(DevClusterError, match="is not a directory"):
        secure_dir(link)
    assert DevCluster(ClusterSpec(state_dir=link)).state_dir == link  # not resolved to target
    # a group/other-writable directory of our own is refused too
    loose = sticky / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(DevClusterError, match="mode 0777"):
        secure_dir(loose)


def test_secure_dir_creates_our_own(sticky):
    d = secure_dir(sticky / "fresh", 0o755)
    st = os.lstat(d)
    assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o755)
    assert secure_dir(d) == d  # idempotent


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="no systemd-tmpfiles")
def test_tmpfiles_takes_a_planted_ring_root_back(attacker, tmp_path):
    """Finding 18.9: any user could create /dev/shm/slurmguard first and so turn guarding
    off on that node (the plugin refuses a ring root that is not root's)."""
    shm = tmp_path / "dev" / "shm"
    shm.mkdir(parents=True)
    shm.chmod(0o1777)
    (tmp_path / "dev").chmod(0o755)
    planted = shm / "slurmguard"
    assert run_as(attacker, ["mkdir", "-m", "0777", str(planted)]).returncode == 0
    res = subprocess.run(
        [
            "systemd-tmpfiles",
            "--create",
            f"--root={tmp_path}",
            str(ROOT / "systemd" / "slurmguard-tmpfiles.conf"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    st = os.lstat(planted)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o755)
