"""Prolog checks: runner bounds, GPU checks on fake NVML, IB link on fake sysfs, Gres parsing."""

from __future__ import annotations

import copy
import json
import time

import pytest

from slurmguard.errors import ConfigError
from slurmguard.nodecheck.checks import Progress, run_checks
from slurmguard.nodecheck.gpu import GpuCountCheck, GpuHealthCheck
from slurmguard.nodecheck.nic import NicLinkCheck
from slurmguard.nodecheck.slurmconf import expected_gpus, parse_gres_gpus
from slurmguard.telemetry.fake_nvml import FakeNvml
from tests.fixtures.prolog import NVML_H100, NoDriverNvml, NvmlWithRemap, fake_ib


def h100(n: int = 8) -> list[dict]:
    return copy.deepcopy(json.loads(NVML_H100.read_text())["devices"][:n])


def run(check, **kw):
    return run_checks(
        [check], budget_s=kw.get("budget_s", 5.0), check_timeout_s=kw.get("check_timeout_s", 5.0)
    )[0]


# ------------------------------------------------------------------ runner
class _Sleeper:
    def __init__(self, name, seconds, result=()):
        self.name, self.seconds, self.result = name, seconds, list(result)

    def run(self, progress: Progress):
        progress.at("sleeping")
        time.sleep(self.seconds)
        return self.result


class _Boom:
    name = "boom"

    def run(self, progress):
        raise RuntimeError("bug in a check")


def test_runner_runs_checks_concurrently_and_keeps_order():
    t0 = time.monotonic()
    res = run_checks(
        [_Sleeper("a", 0.3), _Sleeper("b", 0.3, ["b broke"]), _Sleeper("c", 0.3)],
        budget_s=5,
        check_timeout_s=5,
    )
    wall = time.monotonic() - t0
    assert [r.name for r in res] == ["a", "b", "c"]
    assert [r.ok for r in res] == [True, False, True]
    assert res[1].failures == ("b broke",)
    assert wall < 0.85  # concurrent: about one check's time, not three


def test_runner_times_out_a_hung_check_naming_its_step():
    t0 = time.monotonic()
    res = run_checks([_Sleeper("slow", 3.0), _Sleeper("fast", 0.0)], budget_s=5, check_timeout_s=0.3)
    assert time.monotonic() - t0 < 1.5
    assert res[0].timed_out and res[0].failures == ("no answer within 0.3 s (stuck in sleeping)",)
    assert res[1].ok


def test_runner_total_budget_caps_each_check():
    res = run_checks([_Sleeper("slow", 3.0)], budget_s=0.2, check_timeout_s=5)
    assert res[0].failures == ("no answer within 0.2 s (stuck in sleeping)",)


def test_runner_separates_internal_errors_from_failures():
    r = run_checks([_Boom()], budget_s=1, check_timeout_s=1)[0]
    assert not r.ok and r.failures == () and r.internal_error == "RuntimeError: bug in a check"


# ------------------------------------------------------------------ gpu_count
def test_gpu_count_healthy_h100x8():
    nv = FakeNvml(h100())
    assert run(GpuCountCheck(8, lambda: nv)).ok
    assert nv._init == 0  # init and shutdown balanced


def test_gpu_count_more_than_expected_passes_fewer_fails():
    assert run(GpuCountCheck(4, lambda: FakeNvml(h100()))).ok
    r = run(GpuCountCheck(8, lambda: FakeNvml(h100(7))))
    assert r.failures == ("7 usable GPU(s), 8 expected (NVML counts 7)",)


def test_gpu_count_lost_gpu_is_not_usable():
    devs = h100()
    devs[3]["lost"] = True
    # a lost GPU still enumerates; its handle works, but gpu_health fails it (below)
    assert run(GpuCountCheck(8, lambda: FakeNvml(devs))).ok


def test_gpu_count_no_driver():
    assert run(GpuCountCheck(0, lambda: NoDriverNvml())).ok
    r = run(GpuCountCheck(8, lambda: NoDriverNvml()))
    assert r.failures == ("NVML unavailable (NVML Shared Library Not Found); expected 8 GPU(s)",)


def test_gpu_count_hung_nvml_init_is_a_failure_within_the_budget():
    nv = FakeNvml(h100(), hang={"nvmlInit"})
    try:
        t0 = time.monotonic()
        r = run(GpuCountCheck(8, lambda: nv), check_timeout_s=0.4)
        assert time.monotonic() - t0 < 1.5
        assert r.timed_out and r.failures == ("no answer within 0.4 s (stuck in nvmlInit)",)
    finally:
        nv.release()


# ------------------------------------------------------------------ gpu_health
def health(nv, **kw):
    return GpuHealthCheck(
        "node1",
        expected=kw.pop("expected", 8),
        loader=lambda: nv,
        call_timeout_s=kw.pop("call_timeout_s", 1.0),
        **kw,
    )


def test_gpu_health_healthy_h100x8():
    nv = NvmlWithRemap(h100())
    r = run(health(nv))
    assert r.ok, r.failures
    assert nv._init == 0


def test_gpu_health_lost_gpu():
    devs = h100()
    devs[5]["lost"] = True
    r = run(health(NvmlWithRemap(devs)))
    assert "GPU 5: NVML_ERROR_GPU_IS_LOST" in r.failures
    assert "gpu5: GPU is lost (fell off the bus)" in r.failures
    assert all("gpu5" in f or "GPU 5" in f for f in r.failures)


def test_gpu_health_ecc_dbe_since_driver_load():
    devs = h100()
    devs[2]["ecc"]["volatile_uncorrected"] = 3
    r = run(health(NvmlWithRemap(devs)))
    assert r.failures == ("gpu2: 3 uncorrectable ECC error(s) since driver load (tolerated: 0)",)
    assert run(health(NvmlWithRemap(devs), max_ecc_dbe=3)).ok


def test_gpu_health_hardware_xid_fails_application_xid_passes():
    r = run(health(NvmlWithRemap(h100(), pending_xids={1: 79})))
    assert r.failures == ("gpu1: XID 79",)
    assert run(health(NvmlWithRemap(h100(), pending_xids={1: 13}))).ok  # app error (graphics exception)


def test_gpu_health_nvlink_down():
    devs = h100()
    devs[6]["nvlink"][4]["active"] = False
    r = run(health(NvmlWithRemap(devs)))
    assert r.failures == ("gpu6: 1 NVLink link(s) down",)


def test_gpu_health_row_remap_pending_and_failed():
    devs = h100()
    devs[0]["remapped_rows"] = {"correctable": 0, "uncorrectable": 1, "pending": True}
    devs[4]["remapped_rows"] = {"uncorrectable": 8, "failure": True}
    devs[7]["remapped_rows"] = {"correctable": 2}
    r = run(health(NvmlWithRemap(devs)))
    assert r.failures == (
        "gpu0: row remapping pending (GPU reset required)",
        "gpu4: row remapping failed (uncorrectable memory, replace the GPU)",
    )


def test_gpu_health_no_driver_only_ok_when_no_gpus_expected():
    assert run(health(NoDriverNvml(), expected=0)).ok
    r = run(health(NoDriverNvml(), expected=8))
    assert r.failures == ("NVML unavailable: NVML Shared Library Not Found",)


def test_gpu_health_hung_gpu_call_names_the_gpu_and_stays_in_budget():
    nv = NvmlWithRemap(h100(2), hang={"nvmlDeviceGetTemperature", "nvmlDeviceGetRemappedRows"})
    try:
        t0 = time.monotonic()
        r = run(health(nv, call_timeout_s=0.2), check_timeout_s=3.0)
        assert time.monotonic() - t0 < 2.0
        assert not r.timed_out
        assert r.failures[0] == "GPU 0: call did not return within 0.2 s"
        assert r.failures[1] == "GPU 1: an earlier call is still hung"
    finally:
        nv.release()


# ------------------------------------------------------------------ nic_link
def nic(root, **kw):
    return NicLinkCheck("node1", root, call_timeout_s=1.0, **kw)


def test_nic_all_active(tmp_path):
    fake_ib(tmp_path, {"mlx5_0:1": {}, "mlx5_1:1": {}})
    assert run(nic(tmp_path, min_ports=2, min_rate_gbps=400)).ok


def test_nic_port_down_fails_with_phys_state(tmp_path):
    fake_ib(tmp_path, {"mlx5_0:1": {}, "mlx5_1:1": {"state": "1: DOWN", "phys_state": "3: Disabled"}})
    r = run(nic(tmp_path))
    assert r.failures == ("mlx5_1:1: link down (port not ACTIVE, phys_state 3: Disabled)",)


def test_nic_port_patterns_leave_out_unused_ports(tmp_path):
    fake_ib(tmp_path, {"mlx5_0:1": {}, "mlx5_bond_0:1": {"state": "1: DOWN", "phys_state": "2: Polling"}})
    assert run(nic(tmp_path, ports=("mlx5_[0-9]:1",))).ok
    assert not run(nic(tmp_path)).ok


def test_nic_degraded_rate_and_port_count(tmp_path):
    fake_ib(
        tmp_path,
        {
            "mlx5_0:1": {},
            "mlx5_1:1": {"rate": "200 Gb/sec (4X HDR)"},
            "mlx5_2:1": {"state": "2: INIT", "phys_state": "5: LinkUp"},
        },
    )
    r = run(nic(tmp_path, min_rate_gbps=400, min_ports=3))
    assert r.failures == (
        "mlx5_2:1: link down (port not ACTIVE, phys_state 5: LinkUp)",
        "mlx5_1:1: link at 200 Gb/s, below 400 Gb/s",
        "2 ACTIVE port(s), 3 required (3 selected port(s) under " + str(tmp_path) + ")",
    )


def test_nic_no_infiniband(tmp_path):
    assert run(nic(tmp_path / "absent")).ok
    r = run(nic(tmp_path / "absent", min_ports=1))
    assert r.failures == (f"0 ACTIVE port(s), 1 required (no selected port under {tmp_path / 'absent'})",)


def test_nic_unreadable_state_is_a_failure(tmp_path):
    fake_ib(tmp_path, {"mlx5_0:1": {"state": "garbage"}})
    r = run(nic(tmp_path))
    assert len(r.failures) == 1 and "unparsable" in r.failures[0]


def test_nic_recorded_fixture_tree():
    from tests.fixtures.prolog import ROOT

    root = ROOT / "tests/fixtures/telemetry/sysfs/class/infiniband"
    r = run(nic(root))
    assert r.failures == ("mlx5_1:1: link down (port not ACTIVE, phys_state 3: Disabled)",)


# ------------------------------------------------------------------ slurm.conf Gres
@pytest.mark.parametrize(
    "gres,n",
    [
        ("gpu:8", 8),
        ("gpu:h100:8", 8),
        ("gpu:a100:4,gpu:h100:4", 8),
        ("gpu:h100:8,nvme:1", 8),
        ("nvme:1", 0),
        ("", 0),
        ("(null)", 0),
        ("gpu", 1),
        ("gpu:tesla", 1),
        ("gpu:no_consume:2", 2),
        ("gpu:1K", 1024),
        ("gpu:h100:4(S:0-1)", 4),
    ],
)
def test_parse_gres(gres, n):
    assert parse_gres_gpus(gres) == n


def test_expected_gpus_from_slurm_conf(tmp_path):
    (tmp_path / "nodes.conf").write_text(
        "NodeName=DEFAULT Gres=gpu:h100:8 CPUs=64\n"
        "NodeName=gpu[001-004] RealMemory=1000   # comment\n"
        "NodeName=cpu01 Gres=nvme:1\n"
        "NodeName=DEFAULT Gres=gpu:4\n"
        "NodeName=gpu[005-006],small1\n"
    )
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n# NodeName=gpu001 Gres=gpu:1\nInclude nodes.conf\n")
    assert expected_gpus(conf, "gpu003") == 8
    assert expected_gpus(conf, "cpu01") == 0
    assert expected_gpus(conf, "gpu006") == 4
    assert expected_gpus(conf, "small1") == 4
    with pytest.raises(ConfigError, match="node 'nope' has no NodeName line"):
        expected_gpus(conf, "nope")


def test_expected_gpus_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.conf: slurm.conf not found"):
        expected_gpus(tmp_path / "missing.conf", "n1")
    bad = tmp_path / "slurm.conf"
    bad.write_text("NodeName=n[1-2 Gres=gpu:2\n")
    with pytest.raises(ConfigError, match=r"slurm.conf:1: NodeName: unbalanced"):
        expected_gpus(bad, "n1")
    bad.write_text("NodeName=n1 Gres=gpu:h100:x:y\n")
    with pytest.raises(ConfigError, match=r"slurm.conf:1: Gres: cannot read a GPU count"):
        expected_gpus(bad, "n1")


def test_devcluster_conf_has_no_gres(tmp_path):
    from slurmguard_dev.devcluster.conf import ConfPaths, render_slurm_conf

    text = render_slurm_conf(
        cluster_name="c",
        control_host="h",
        ctld_port=1,
        node_ports={"node1": 2},
        partition="debug",
        cpus_per_node=2,
        memory_mb=100,
        paths=ConfPaths(tmp_path, tmp_path, tmp_path, None, None, None),
    )
    (tmp_path / "slurm.conf").write_text(text)
    assert expected_gpus(tmp_path / "slurm.conf", "node1") == 0
