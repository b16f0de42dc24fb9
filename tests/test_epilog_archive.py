"""Epilog: ring recognition, per-node archive + manifest, shared ring dirs, cleanup, pruning."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from slurmguard.clock import FakeClock
from slurmguard.config import PrologPolicy, parse_policy
from slurmguard.hook import ring
from slurmguard.nodecheck import archive, epilog
from slurmguard.nodecheck.archive import archive_job, prune
from tests.fixtures.prolog import RECORD_SIZE, ROOT, ring_bytes, write_ring

RING_SIZE_16 = 4096 + 16 * RECORD_SIZE


@pytest.fixture
def dirs(tmp_path):
    ring_root = tmp_path / "shm"
    ring_root.mkdir(mode=0o755)
    os.chmod(ring_root, 0o755)
    store = tmp_path / "traces"
    return ring_root, store


def pol(store, **kw) -> PrologPolicy:
    return PrologPolicy(trace_store=str(store), min_free_mb=0, **kw)


# ------------------------------------------------------------------ ring header
def _header(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return ring.read_header(fd, path.name)
    finally:
        os.close(fd)


def test_read_header_fields_and_exact_geometry(tmp_path):
    """The epilog uses hook.ring's one header reader: exact size, allocated, regular."""
    p = tmp_path / "r.ring"
    p.write_bytes(ring_bytes(node="node2", job_id=77, rank=5, local_rank=1, world_size=8, step_id=3))
    h = _header(p)
    assert (h.job_id, h.step_id, h.global_rank, h.local_rank, h.world_size) == (77, 3, 5, 1, 8)
    assert (h.node_name, h.source_name, h.capacity) == ("node2", "torch", 16)
    bad = tmp_path / "bad"
    bad.write_bytes(ring_bytes(node="n", job_id=1, magic=b"NOTARING"))
    with pytest.raises(ring.RingError, match="bad magic"):
        _header(bad)
    bad.write_bytes(b"")
    with pytest.raises(ring.RingError, match="bad magic"):
        _header(bad)
    bad.write_bytes(ring_bytes(node="n", job_id=1) + b"\0" * 64)  # one record too long
    with pytest.raises(ring.RingError, match=f"size {RING_SIZE_16 + 64} bytes, a ring of 16 records is"):
        _header(bad)
    bad.write_bytes(ring_bytes(node="n", job_id=1, capacity=24))  # not a power of two
    with pytest.raises(ring.RingError, match="bad capacity 24"):
        _header(bad)


def test_sparse_ring_claiming_a_huge_geometry_is_not_archived(dirs):
    """Attack (issue 18.6): a 4 KiB sparse file whose header claims 2^24 records was
    archived as gigabytes; now it is refused and removed, nothing is copied."""
    ring_root, store = dirs
    jd = ring_root / "61"
    jd.mkdir()
    cap = 1 << 24
    size = 4096 + cap * RECORD_SIZE
    header = bytearray(ring_bytes(node="node1", job_id=61, records=0)[:4096])
    header[20:24] = cap.to_bytes(4, "little")  # capacity, sg_ring.h offset 20
    with open(jd / "rank-0.step-0.torch.ring", "wb") as f:
        f.write(header)
        f.truncate(size)  # 1 GiB apparent, 4 KiB allocated
    res = archive_job(61, "node1", ring_root=ring_root, policy=pol(store))
    assert res.files == [] and res.archived_bytes == 0
    assert res.skipped[0].reason.startswith("sparse: ")
    assert res.ring_dir_removed and not jd.exists()


def test_fifo_and_many_entries_neither_block_nor_flood_the_epilog(dirs):
    """Attack (18.6): a FIFO named like a ring, and more files than max_ring_entries."""
    ring_root, store = dirs
    jd = ring_root / "62"
    jd.mkdir()
    os.mkfifo(jd / "a.ring")
    for i in range(300):
        (jd / f"junk-{i:04d}").write_bytes(b"")
    res = archive_job(62, "node1", ring_root=ring_root, policy=pol(store, max_ring_entries=50))
    assert res.unread == 251 and len(res.skipped) == 50
    assert res.ring_dir_removed and not jd.exists()
    # the flooded directory was moved aside at once and is deleted in the background
    assert "removed in the background" in res.errors[-1]
    deadline = time.monotonic() + 30
    while any(ring_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(ring_root.iterdir()) == []
    m = json.loads((store / "62" / "node1" / "manifest.json").read_text())
    assert m["unread_count"] == 251 and m["skipped_count"] == 50
    assert len(m["skipped"]) <= archive.MANIFEST_MAX_SKIPPED
    # the FIFO is opened without blocking; files nested in a subdirectory are not walked
    # inline either (the whole directory goes in the background)
    (jd / "deep" / "deeper").mkdir(parents=True)
    (jd / "deep" / "deeper" / "x").write_bytes(b"")
    os.mkfifo(jd / "b.ring")
    write_ring(jd / "rank-0.step-0.torch.ring", node="node1", job_id=62)
    res = archive_job(62, "node1", ring_root=ring_root, policy=pol(store))
    assert [(s.name, s.reason) for s in res.skipped] == [
        ("b.ring", "not a regular file"),
        ("deep", "a directory: removed unread"),
    ]
    assert [f.name for f in res.files] == ["rank-0.step-0.torch.ring"] and not jd.exists()


def test_lock_held_by_the_job_does_not_stall_or_keep_the_dir(dirs):
    """Attack (18.6): the user's other job holds an flock on the ring dir; the epilog
    waited 60 s and left the directory. Now: at most epilog_lock_timeout_s, then removed."""
    import fcntl

    ring_root, store = dirs
    write_ring(ring_root / "63" / "rank-0.step-0.torch.ring", node="node1", job_id=63)
    fd = os.open(ring_root / "63", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        res = archive_job(
            63,
            "node1",
            ring_root=ring_root,
            policy=pol(store, ring_root_shared=True, epilog_lock_timeout_s=0.3),
            job_nodes=["node1"],
        )
        took = time.monotonic() - t0
    finally:
        os.close(fd)
    assert took < 5 and "went on without the lock" in res.errors[0]
    assert [f.name for f in res.files] == ["rank-0.step-0.torch.ring"]
    assert res.ring_dir_removed and not (ring_root / "63").exists()
    # on a per-node ring root there is no lock at all
    write_ring(ring_root / "64" / "rank-0.step-0.torch.ring", node="node1", job_id=64)
    fd = os.open(ring_root / "64", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        res = archive_job(64, "node1", ring_root=ring_root, policy=pol(store), job_nodes=["node1"])
    finally:
        os.close(fd)
    assert res.errors == [] and res.ring_dir_removed


def test_ring_naming_another_node_is_this_nodes_unless_the_root_is_shared(dirs):
    """Attack (18.6): a ring naming another node of the job kept the directory forever
    on a real cluster (that node's epilog never sees this node's /dev/shm)."""
    ring_root, store = dirs
    write_ring(ring_root / "65" / "rank-0.step-0.torch.ring", node="node1", job_id=65)
    write_ring(ring_root / "65" / "rank-1.step-0.torch.ring", node="node2", job_id=65, rank=1)
    res = archive_job(65, "node1", ring_root=ring_root, policy=pol(store), job_nodes=["node1", "node2"])
    assert res.left_for == {} and len(res.files) == 2
    assert res.ring_dir_removed and not (ring_root / "65").exists()


# ------------------------------------------------------------------ archive
def test_archive_moves_own_rings_writes_manifest_removes_dir(dirs, tmp_path):
    ring_root, store = dirs
    secret = tmp_path / "secret"
    secret.write_bytes(ring_bytes(node="node1", job_id=41, rank=9))
    jd = ring_root / "41"
    for r in range(2):
        write_ring(jd / f"rank-{r}.step-0.torch.ring", node="node1", job_id=41, rank=r)
    (jd / "notes.txt").write_text("not a ring")
    (jd / "partial.ring").write_bytes(b"\0" * 4096)  # created, magic not stored yet
    os.symlink(secret, jd / "evil.ring")  # the job's user points a "ring" at root's files
    clock = FakeClock(1_800_000_000.0)
    res = archive_job(41, "node1", ring_root=ring_root, policy=pol(store), job_nodes=["node1"], clock=clock)
    assert res.errors == [] and res.ring_dir_removed and not jd.exists()
    dest = store / "41" / "node1"
    assert res.archive_dir == str(dest)
    assert sorted(p.name for p in dest.iterdir()) == [
        "manifest.json",
        "rank-0.step-0.torch.ring",
        "rank-1.step-0.torch.ring",
    ]
    assert (dest / "rank-1.step-0.torch.ring").read_bytes() == ring_bytes(node="node1", job_id=41, rank=1)
    m = json.loads((dest / "manifest.json").read_text())
    assert (m["job_id"], m["node"], m["restart_count"], m["format"]) == (41, "node1", 0, 1)
    assert m["archived_at"] == "2027-01-15T08:00:00Z" and m["archived_at_unix"] == 1_800_000_000.0
    assert [(f["name"], f["bytes"], f["global_rank"], f["node"]) for f in m["files"]] == [
        ("rank-0.step-0.torch.ring", RING_SIZE_16, 0, "node1"),
        ("rank-1.step-0.torch.ring", RING_SIZE_16, 1, "node1"),
    ]
    assert m["archived_bytes"] == 2 * RING_SIZE_16
    assert m["skipped"] == [
        {"name": "evil.ring", "reason": "symbolic link", "bytes": None},
        {"name": "notes.txt", "reason": "bad magic (not a ring, or not initialised yet)", "bytes": 10},
        {"name": "partial.ring", "reason": "bad magic (not a ring, or not initialised yet)", "bytes": 4096},
    ]
    assert m["skipped_count"] == 3 and m["left_for_other_nodes"] == {}
    assert secret.read_bytes() == ring_bytes(node="node1", job_id=41, rank=9)  # never followed
    assert oct(os.stat(dest).st_mode & 0o777) == oct(archive.DIR_MODE)


def test_no_ring_dir_is_nothing_to_do(dirs):
    ring_root, store = dirs
    res = archive_job(5, "node1", ring_root=ring_root, policy=pol(store))
    assert (res.files, res.errors, res.ring_dir_removed, res.archive_dir) == ([], [], False, None)
    assert not store.exists()
    res = archive_job(5, "node1", ring_root=ring_root / "absent", policy=pol(store))
    assert res.errors == []


def test_shared_ring_dir_each_node_takes_its_own(dirs):
    """Dev cluster: all slurmd share /dev/shm; a 3-node job runs three epilogs on one dir."""
    ring_root, store = dirs
    jd = ring_root / "9"
    nodes = ["node1", "node2", "node3"]
    for i, n in enumerate(nodes):
        for lr in range(2):
            write_ring(
                jd / f"rank-{2 * i + lr}.step-0.nccl.ring",
                node=n,
                job_id=9,
                rank=2 * i + lr,
                local_rank=lr,
                source=1,
            )
    write_ring(jd / "rank-99.step-0.torch.ring", node="elsewhere", job_id=9, rank=99)
    shared = pol(store, ring_root_shared=True)
    r2 = archive_job(9, "node2", ring_root=ring_root, policy=shared, job_nodes=nodes)
    # a ring naming a node outside the job is on this host: the first taker archives it
    assert [f.name for f in r2.files] == [
        "rank-2.step-0.nccl.ring",
        "rank-3.step-0.nccl.ring",
        "rank-99.step-0.torch.ring",
    ]
    assert r2.left_for == {"node1": 2, "node3": 2} and not r2.ring_dir_removed and jd.exists()
    r1 = archive_job(9, "node1", ring_root=ring_root, policy=shared, job_nodes=nodes)
    assert [f.name for f in r1.files] == ["rank-0.step-0.nccl.ring", "rank-1.step-0.nccl.ring"]
    assert r1.left_for == {"node3": 2} and jd.exists()
    r3 = archive_job(9, "node3", ring_root=ring_root, policy=shared, job_nodes=nodes)
    assert r3.left_for == {} and r3.ring_dir_removed and not jd.exists()
    assert sorted(p.name for p in (store / "9").iterdir()) == nodes
    m = json.loads((store / "9" / "node2" / "manifest.json").read_text())
    assert m["left_for_other_nodes"] == {"node1": 2, "node3": 2}
    assert [(f["source"], f["node"]) for f in m["files"]] == [
        ("nccl", "node2"),
        ("nccl", "node2"),
        ("torch", "elsewhere"),
    ]
    # a late epilog (slurmd retry) finds nothing and does not fail
    again = archive_job(9, "node1", ring_root=ring_root, policy=shared, job_nodes=nodes)
    assert (again.files, again.errors, again.archive_dir) == ([], [], None)


def _epilog_proc(args):
    ring_root, store, node, nodes = args
    res = archive_job(
        12,
        node,
        ring_root=ring_root,
        policy=pol(store, ring_root_shared=True, epilog_lock_timeout_s=30),
        job_nodes=nodes,
    )
    return [f.name for f in res.files], res.ring_dir_removed, res.errors


def test_concurrent_epilogs_archive_each_ring_once(dirs):
    ring_root, store = dirs
    nodes = [f"node{i}" for i in range(1, 5)]
    for i, n in enumerate(nodes):
        for lr in range(3):
            write_ring(
                ring_root / "12" / f"rank-{3 * i + lr}.step-0.torch.ring", node=n, job_id=12, rank=3 * i + lr
            )
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        out = pool.map(_epilog_proc, [(ring_root, store, n, nodes) for n in nodes])
    taken = sorted(name for names, _, _ in out for name in names)
    assert taken == sorted(f"rank-{r}.step-0.torch.ring" for r in range(12))
    assert all(errors == [] for _, _, errors in out)
    assert sum(removed for _, removed, _ in out) == 1
    assert not (ring_root / "12").exists()
    assert sorted(p.name for p in (store / "12").iterdir()) == nodes  # no staging left behind


def test_requeued_job_gets_its_own_archive(dirs):
    ring_root, store = dirs
    for restart in (0, 1):
        write_ring(ring_root / "30" / "rank-0.step-batch.torch.ring", node="node1", job_id=30)
        res = archive_job(30, "node1", ring_root=ring_root, policy=pol(store), restart_count=restart)
        assert res.errors == []
    # and an epilog run twice for the same run does not overwrite the first archive
    write_ring(ring_root / "30" / "rank-0.step-batch.torch.ring", node="node1", job_id=30)
    archive_job(30, "node1", ring_root=ring_root, policy=pol(store), restart_count=1)
    assert sorted(p.name for p in (store / "30").iterdir()) == [
        "node1",
        "node1.restart-1",
        "node1.restart-1.2",
    ]
    m = json.loads((store / "30" / "node1.restart-1" / "manifest.json").read_text())
    assert m["restart_count"] == 1


def test_archive_cap_and_free_space_drop_rings_but_still_clean(dirs):
    ring_root, store = dirs
    big = 4096 + 8192 * RECORD_SIZE  # 1 MiB + 4 KiB
    for r in range(3):
        write_ring(ring_root / "8" / f"rank-{r}.ring", node="node1", job_id=8, rank=r, capacity=8192)
    res = archive_job(
        8, "node1", ring_root=ring_root, policy=pol(store, max_archive_mb=2), job_nodes=["node1"]
    )
    assert [f.name for f in res.files] == ["rank-0.ring"]
    assert [(s.name, s.bytes) for s in res.skipped] == [("rank-1.ring", big), ("rank-2.ring", big)]
    assert "over prolog.max_archive_mb (2 MB)" in res.skipped[0].reason
    assert res.ring_dir_removed and not (ring_root / "8").exists()

    write_ring(ring_root / "10" / "rank-0.ring", node="node1", job_id=10)
    huge_free = PrologPolicy(trace_store=str(store), min_free_mb=10**9)
    res = archive_job(10, "node1", ring_root=ring_root, policy=huge_free)
    assert res.files == [] and "keeping prolog.min_free_mb=1000000000" in res.skipped[0].reason
    assert res.ring_dir_removed


def test_unwritable_trace_store_never_fails_and_still_frees_tmpfs(dirs, tmp_path):
    ring_root, _ = dirs
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    write_ring(ring_root / "3" / "rank-0.ring", node="node1", job_id=3)
    write_ring(ring_root / "3" / "rank-1.ring", node="node1", job_id=3, rank=1)
    res = archive_job(3, "node1", ring_root=ring_root, policy=pol(blocker / "traces"))
    assert res.files == [] and res.errors and "Not a directory" in res.errors[0]
    assert [s.name for s in res.skipped] == ["rank-0.ring", "rank-1.ring"]
    assert res.ring_dir_removed and not res.cleanup_failed


def test_ring_root_writable_by_others_is_refused(dirs):
    ring_root, store = dirs
    write_ring(ring_root / "4" / "rank-0.ring", node="node1", job_id=4)
    os.chmod(ring_root, 0o777)
    res = archive_job(4, "node1", ring_root=ring_root, policy=pol(store))
    assert "writable only by it" in res.errors[0] and (ring_root / "4").exists()
    assert res.files == []


def test_ring_dir_symlink_is_not_followed(dirs, tmp_path):
    ring_root, store = dirs
    target = tmp_path / "elsewhere"
    write_ring(target / "rank-0.ring", node="node1", job_id=6)
    os.symlink(target, ring_root / "6")
    res = archive_job(6, "node1", ring_root=ring_root, policy=pol(store))
    assert res.files == [] and "cannot open ring dir" in res.errors[0]
    assert (target / "rank-0.ring").exists()


def test_cleanup_failure_is_the_one_failing_case(dirs, monkeypatch):
    ring_root, store = dirs
    write_ring(ring_root / "2" / "rank-0.ring", node="node1", job_id=2)
    real_unlink = os.unlink

    def unlink(path, *a, dir_fd=None, **kw):
        if str(path).endswith(".ring") and dir_fd is not None:
            raise PermissionError(1, "Operation not permitted")
        return real_unlink(path, *a, dir_fd=dir_fd, **kw)

    monkeypatch.setattr(archive.os, "unlink", unlink)
    policy = parse_policy(
        f"agent:\n  ring_root: {ring_root}\nprolog:\n  trace_store: {store}\n  min_free_mb: 0\n"
    )
    err = io.StringIO()
    monkeypatch.setattr(archive.shutil, "rmtree", _failing_rmtree(archive.shutil.rmtree))
    code, res = epilog.run_epilog(policy, 2, "node1", {}, out=io.StringIO(), err=err)
    assert res.cleanup_failed and code == 1
    assert "cannot remove" in err.getvalue()
    assert [f.name for f in res.files] == ["rank-0.ring"]  # archived all the same
    lenient = parse_policy(
        f"agent:\n  ring_root: {ring_root}\nprolog:\n  trace_store: {store}\n"
        "  min_free_mb: 0\n  epilog_fail_on_cleanup_error: false\n"
    )
    code, _ = epilog.run_epilog(lenient, 2, "node1", {}, out=io.StringIO(), err=io.StringIO())
    assert code == 0


def _failing_rmtree(real):
    def rmtree(path, *a, dir_fd=None, **kw):
        if dir_fd is not None:
            raise PermissionError(1, "Operation not permitted")
        return real(path, *a, **kw)

    return rmtree


# ------------------------------------------------------------------ prune
def test_prune_removes_old_job_archives_only(tmp_path):
    store = tmp_path / "traces"
    now = 1_800_000_000.0
    for job, age_days in (("100", 40), ("101", 29), ("102", 31)):
        d = store / job / "node1"
        d.mkdir(parents=True)
        os.utime(store / job, (now - age_days * 86400, now - age_days * 86400))
    (store / "notajob").mkdir()
    os.utime(store / "notajob", (0, 0))
    os.symlink(store / "100", store / "999")
    clock = FakeClock(now)
    assert prune(store, 30.0, clock=clock) == ["100", "102"]
    assert sorted(p.name for p in store.iterdir()) == [".last-prune", "101", "999", "notajob"]
    # throttled: at most once an hour unless forced
    (store / "101").mkdir(exist_ok=True)
    os.utime(store / "101", (0, 0))
    clock.advance(60)
    assert prune(store, 30.0, clock=clock) == []
    clock.advance(3600)
    assert prune(store, 30.0, clock=clock) == ["101"]
    assert prune(tmp_path / "absent", 30.0, clock=clock, force=True) == []


# ------------------------------------------------------------------ epilog entry
def test_epilog_main_uses_slurm_environment(dirs, tmp_path, capsys):
    ring_root, store = dirs
    write_ring(ring_root / "55" / "rank-0.step-0.torch.ring", node="node2", job_id=55)
    write_ring(ring_root / "55" / "rank-1.step-0.torch.ring", node="node3", job_id=55, rank=1)
    p = tmp_path / "p.yaml"
    p.write_text(
        f"agent:\n  ring_root: {ring_root}\nprolog:\n  trace_store: {store}\n  min_free_mb: 0\n"
        "  ring_root_shared: true\n"
    )
    env = {
        "SLURM_JOB_ID": "55",
        "SLURMD_NODENAME": "node2",
        "SLURM_NODELIST": "node[2-3]",
        "SLURM_JOB_RESTART_COUNT": "0",
        "SLURMGUARD_POLICY": str(p),
    }
    assert epilog.main([], env=env) == 0
    out = capsys.readouterr().out
    assert f"archived 1 ring(s), {RING_SIZE_16} bytes, to {store / '55' / 'node2'}" in out
    assert "ring dir kept (rings left for node3: 1)" in out
    assert epilog.main([], env={**env, "SLURMD_NODENAME": "node3"}) == 0
    assert "ring dir removed" in capsys.readouterr().out
    assert not (ring_root / "55").exists()


def test_epilog_main_without_job_id_or_with_bad_policy_passes(tmp_path, capsys):
    assert epilog.main([], env={}) == 0
    assert "no job id" in capsys.readouterr().err
    bad = tmp_path / "p.yaml"
    bad.write_text("prolog:\n  trace_store: [1\n")
    assert epilog.main([], env={"SLURM_JOB_ID": "1", "SLURMGUARD_POLICY": str(bad)}) == 0
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "invalid YAML" in err and "rings left in place" in err


def test_epilog_wrapper_end_to_end(dirs, tmp_path):
    ring_root, store = dirs
    write_ring(ring_root / "77" / "rank-0.step-0.torch.ring", node="node1", job_id=77)
    p = tmp_path / "p.yaml"
    p.write_text(f"agent:\n  ring_root: {ring_root}\nprolog:\n  trace_store: {store}\n  min_free_mb: 0\n")
    env = {
        "SLURM_JOB_ID": "77",
        "SLURMD_NODENAME": "node1",
        "SLURMGUARD_POLICY": str(p),
        "SLURMGUARD_PYTHON": sys.executable,
        "SLURMGUARD_ENV_FILE": "/nonexistent",
    }
    res = subprocess.run(
        [str(ROOT / "prolog_epilog" / "slurmguard-epilog")],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert (store / "77" / "node1" / "manifest.json").is_file()
    assert not (ring_root / "77").exists()
