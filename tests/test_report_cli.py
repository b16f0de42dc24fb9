"""`slurmguard triage report`, `slurmguard incidents`, `slurmguard node show` end to end."""

from __future__ import annotations

import json

import pytest

from slurmguard.cli import main


@pytest.fixture
def sg(report_fleet, capsys):
    store = report_fleet[0]
    url = store.engine.url.render_as_string(hide_password=False)

    def run(*args: str, policy: str | None = None) -> tuple[int, str, str]:
        argv = ["--db", url, *(["--policy", policy] if policy else []), *args]
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return int(code or 0), out.out, out.err

    return run


def test_report_table_offline(sg, report_fleet):
    fleet = report_fleet[3]
    code, out, err = sg("triage", "report", "--offline")
    assert code == 0, err
    assert "reasons: from the audit log" in out
    for story in ("suspect", "draining", "quarantined", "remediation", "terminal"):
        assert fleet.first(story) in out
    assert "next rung: reboot" in out and "Fleet figures" in out


def test_report_with_slurm_unreachable_still_renders(sg, tmp_path):
    policy = tmp_path / "policies.yaml"
    policy.write_text("slurm:\n  bin_dir: /nonexistent-slurm-bin\n")
    code, out, err = sg("triage", "report", "--format", "json", policy=str(policy))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["slurm"]["reachable"] is False and doc["slurm"]["checked"] is True
    assert "is slurm-client installed" in doc["slurm"]["error"]
    assert doc["slurm"]["reason_source"] == "audit" and doc["nodes"]


def test_report_json_html_and_filters(sg, report_fleet, tmp_path):
    fleet = report_fleet[3]
    code, out, _ = sg("triage", "report", "--offline", "--format", "json", "--state", "terminal,remediation")
    assert code == 0
    assert {n["state"] for n in json.loads(out)["nodes"]} == {"terminal", "remediation"}
    code, out, _ = sg("triage", "report", "--offline", "--format", "json", "--node", fleet.first("draining"))
    assert [n["name"] for n in json.loads(out)["nodes"]] == [fleet.first("draining")]
    html = tmp_path / "r.html"
    code, out, err = sg("triage", "report", "--offline", "--format", "html", "-o", str(html))
    assert code == 0, err
    assert html.read_text().startswith("<!DOCTYPE html>") and "wrote" in out
    code, out, _ = sg("triage", "schema")
    assert json.loads(out)["properties"]["schema_version"]["const"] == "1"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("triage", "report", "--offline", "--node", "gpu9999"),
            "node gpu9999: not in the slurmguard database",
        ),
        (("triage", "report", "--offline", "--state", "sick"), "--state 'sick': unknown lifecycle"),
        (("triage", "report", "--offline", "--since", "last tuesday"), "--since 'last tuesday'"),
        (("triage", "report", "--offline", "--partition", "cpu"), "--partition 'cpu': no such"),
        (("node", "show", "gpu9999", "--offline"), "node gpu9999: not in the slurmguard database"),
        (("incidents", "--status", "bogus"), "--status 'bogus': unknown incident status"),
        (("incidents", "--node", "gpu9999"), "node gpu9999: not in the slurmguard database"),
    ],
)
def test_bad_input_is_one_line(sg, args, message):
    code, _out, err = sg(*args)
    assert code == 2
    assert err.strip().startswith("slurmguard: error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_database_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--db", f"sqlite:///{tmp_path / 'none.db'}", "triage", "report", "--offline"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "db upgrade" in err and "Traceback" not in err


def test_incidents(sg, report_fleet):
    code, out, err = sg("incidents", "--format", "json")
    assert code == 0, err
    incs = json.loads(out)["incidents"]
    assert len(incs) == 14
    assert all(i["detection_delay_s"] == 480.0 for i in incs)
    assert {i["tier"] for i in incs} == {"verify", "drain", "requeue"}
    assert all(i["affected_jobs"] == [i["job_id"]] for i in incs)
    code, out, _ = sg("incidents", "--node", report_fleet[3].first("terminal"))
    assert code == 0 and "requeue" in out and "8m" in out and "1 incident" in out


def test_node_show(sg, report_fleet):
    name = report_fleet[3].first("terminal")
    code, out, err = sg("node", "show", name, "--offline", "--format", "json")
    assert code == 0, err
    h = json.loads(out)
    assert h["state"] == "terminal" and h["next_action"]["code"] == "replace"
    assert [t["to"] for t in h["transitions"]][:3] == ["healthy", "draining", "quarantined"]
    assert h["transitions"][-1]["to"] == "terminal"
    actions = [a["action"] for a in h["actions"]]
    assert actions[:2] == ["drain", "requeue"] and actions.count("submit") == 3
    assert len(h["incidents"]) == 1 and len(h["sweeps"]) == 3
    assert all(s["verdict"] == "fail" and s["metrics"]["gemm_bfloat16/gpu3"] < 600 for s in h["sweeps"])
    assert [a["rung"] for a in h["triage"]] == ["resweep"] * 3 + ["terminal"]
    code, out, err = sg("node", "show", name, "--offline")
    assert code == 0, err
    for title in ("Lifecycle (", "Actions (audit log) (", "Incidents (1)", "Sweeps (3)", "Triage (4)"):
        assert title in out
    assert "gemm_bfloat16/gpu3=" in out
