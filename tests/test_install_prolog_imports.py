"""The node-side hooks stay light: the prolog and epilog never load numpy & co.

slurmd starts the prolog before every job with a budget of seconds; numpy alone
costs a few hundred milliseconds of imports (and pandas, scipy, torch far more),
and a node install need not have them. Each check runs in a fresh interpreter,
since this test process has long imported them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "pandas", "scipy", "torch", "pyarrow", "matplotlib")

_REPORT = f"""
import json, sys
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def _heavy_loaded(code: str, tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env["PYTHONPATH"] = str(ROOT)
    # as the wrapper runs it: cwd /, no user site
    res = subprocess.run(
        [sys.executable, "-s", "-c", code + _REPORT],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_prolog_and_epilog_import_no_heavy_module(tmp_path):
    assert _heavy_loaded("import slurmguard.nodecheck.prolog, slurmguard.nodecheck.epilog", tmp_path) == []


def test_a_full_prolog_run_with_gpus_and_nics_loads_no_heavy_module(tmp_path):
    # every check runs on data: 8 recorded H100s (gpu_health judges them with
    # detect.peers.hard_failures) and two active IB ports
    code = f"""
import io, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from slurmguard.config import parse_policy
from slurmguard.nodecheck.prolog import run_prolog
from slurmguard.telemetry.fake_nvml import FakeNvml
from tests.fixtures.prolog import NVML_H100, fake_ib
ib = fake_ib(Path({str(tmp_path)!r}) / "ib", {{"mlx5_0:1": {{}}, "mlx5_1:1": {{}}}})
pol = parse_policy("prolog:\\n  expected_gpus: 8\\n  ib_sysfs_root: " + str(ib) + "\\n", "t.yaml")
out = io.StringIO()
rc = run_prolog(pol, "node7", {{}}, err=out, out=out, loader=lambda: FakeNvml.from_fixture(NVML_H100))
assert rc == 0 and "gpu_health: ok" in out.getvalue() and "nic_link: ok" in out.getvalue(), (rc, out.getvalue())
"""
    assert _heavy_loaded(code, tmp_path) == []
