from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmguard.cli import cli
from slurmguard.config import Policy, database_url, load_policy, parse_policy
from slurmguard.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_repository_policy_matches_builtin_defaults():
    # policies.yaml documents the defaults: the two must never drift apart.
    assert load_policy(ROOT / "policies.yaml") == Policy()


def test_sections_without_a_file_are_the_defaults_and_with_one_change_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMGUARD_POLICY", raising=False)
    monkeypatch.setattr("slurmguard.config.SYSTEM_POLICY", tmp_path / "absent.yaml")
    # built-in defaults, constructed without a validator, equal the validated ones
    for name, field in Policy.model_fields.items():
        got = getattr(load_policy(None, sections=(name,)), name)
        assert got == getattr(Policy(), name) and got.model_dump() == field.annotation().model_dump()
    part = load_policy(None, sections=("whatif",))
    with pytest.raises(AttributeError, match="section 'controller' was not loaded"):
        _ = part.controller
    with pytest.raises(ValueError, match="not policy sections: nope"):
        load_policy(None, sections=("nope",))
    # with a file, the whole file is validated as for any command: same policy, same errors
    f = tmp_path / "p.yaml"
    f.write_text("whatif:\n  memory_mb: 64\ncontroller:\n  listen_port: 8700\n")
    assert load_policy(f, trusted=False, sections=("whatif",)) == load_policy(f, trusted=False)
    assert load_policy(f, trusted=False, sections=("whatif",)).whatif.memory_mb == 64
    f.write_text("detection: {period: {min_period: 1}}\nwhatif:\n  memory_mb: 8\ncontroler: {}\n")
    with pytest.raises(ConfigError) as full:
        load_policy(f, trusted=False)
    with pytest.raises(ConfigError) as part_exc:
        load_policy(f, trusted=False, sections=("whatif",))
    assert str(part_exc.value) == str(full.value)
    assert f"{f}:3: whatif.memory_mb: Input should be greater than or equal to 16" in str(full.value)
    assert f"{f}:4: controler: unknown key" in str(full.value)


def test_unknown_key_names_file_key_and_line():
    text = "response:\n  tiers:\n    moderate_slowdown: 0.1\n    sevre_slowdown: 0.3\n"
    with pytest.raises(ConfigError) as exc:
        parse_policy(text, "p.yaml")
    msg = str(exc.value)
    assert msg == "p.yaml:4: response.tiers.sevre_slowdown: unknown key"
    assert "\n" not in msg


def test_bad_value_and_cross_field_rule():
    with pytest.raises(ConfigError, match=r"p.yaml:3: detection.bocd.hazard: Input should be less than 1"):
        parse_policy("detection:\n  bocd:\n    hazard: 2\n", "p.yaml")
    with pytest.raises(ConfigError, match="severe_slowdown must be greater"):
        parse_policy("response:\n  tiers:\n    moderate_slowdown: 0.3\n    severe_slowdown: 0.2\n", "p.yaml")


def test_yaml_syntax_error_and_duplicate_key_have_lines():
    with pytest.raises(ConfigError, match=r"^p.yaml:3: invalid YAML"):
        parse_policy("safety:\n  dry_run: [\n", "p.yaml")
    with pytest.raises(
        ConfigError, match=r"p.yaml:3: invalid YAML: duplicate key 'dry_run' \(first at line 2\)"
    ):
        parse_policy("safety:\n  dry_run: true\n  dry_run: false\n", "p.yaml")


def test_triage_ladder_must_end_terminal():
    with pytest.raises(ConfigError, match="triage.ladder"):
        parse_policy("triage:\n  ladder: [resweep, reboot]\n", "p.yaml")


def test_db_url_precedence(monkeypatch):
    p = parse_policy("database:\n  url: sqlite:///from-file.db\n")
    monkeypatch.delenv("SLURMGUARD_DB", raising=False)
    assert database_url(p) == "sqlite:///from-file.db"
    monkeypatch.setenv("SLURMGUARD_DB", "sqlite:///from-env.db")
    assert database_url(p) == "sqlite:///from-env.db"
    assert database_url(p, "sqlite:///from-flag.db") == "sqlite:///from-flag.db"


def test_policy_check_cli(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent:\n  telemetry_source: magic\n")
    res = CliRunner().invoke(cli, ["policy", "check", str(bad)])
    assert res.exit_code != 0
    good = tmp_path / "good.yaml"
    good.write_text("safety:\n  dry_run: true\n")
    res = CliRunner().invoke(cli, ["policy", "check", str(good)])
    assert res.exit_code == 0, res.output
