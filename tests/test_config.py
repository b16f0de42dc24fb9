import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmguard.cli import cli
from slurmguard.config import Policy, database_url, load_policy, parse_policy
from slurmguard.errors import ConfigError
from slurmguard.whatif_policy import WhatIfPolicy

ROOT = Path(__file__).resolve().parents[1]


def test_repository_policy_matches_builtin_defaults():
    # policies.yaml documents the defaults: the two must never drift apart.
    assert load_policy(ROOT / "policies.yaml") == Policy()


def test_sections_without_a_file_are_the_defaults_and_with_one_change_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMGUARD_POLICY", raising=False)
    monkeypatch.setattr("slurmguard.policyfile.SYSTEM_POLICY", tmp_path / "absent.yaml")
    # built-in defaults, constructed without a validator, equal the validated ones (repr: also
    # the types of the values, 3 is not 3.0; whatif is a dataclass, the others pydantic models)
    for name in Policy.model_fields:
        got = getattr(load_policy(None, sections=(name,)), name)
        validated = getattr(Policy.model_validate({name: {}}), name)
        assert got == getattr(Policy(), name) == validated and repr(got) == repr(validated)
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


# ------------------------------------------------------------------ the whatif section
# WhatIfPolicy is a stdlib dataclass (slurmguard.whatif_policy, so that `slurmguard whatif`
# does not import pydantic): pydantic must still apply every bound and refuse unknown keys.

# per kind of bound pydantic takes, how far past the limit a value is refused
PAST = {"gt": 0, "lt": 0, "ge": -1e-9, "le": 1e-9}


@pytest.mark.parametrize("f", dataclasses.fields(WhatIfPolicy), ids=lambda f: f.name)
def test_every_whatif_bound_is_applied(f):
    assert f.metadata, f"whatif.{f.name}: no bounds"
    for kind, limit in f.metadata.items():
        assert kind in PAST, f"whatif.{f.name}: {kind!r} is not a bound; pydantic would ignore it"
        outside = limit + (PAST[kind] if f.type == "float" else 1 if kind == "le" else -1)
        with pytest.raises(ConfigError) as exc:
            parse_policy(f"whatif:\n  {f.name}: {outside}\n", "p.yaml")
        assert str(exc.value).startswith(f"p.yaml:2: whatif.{f.name}: Input should be"), exc.value
        if kind in ("ge", "le"):
            assert getattr(parse_policy(f"whatif:\n  {f.name}: {limit}\n").whatif, f.name) == limit


def test_whatif_section_errors_name_the_key():
    with pytest.raises(ConfigError) as exc:
        parse_policy("whatif:\n  top_worker_percent: 0\n", "p.yaml")
    assert str(exc.value) == "p.yaml:2: whatif.top_worker_percent: Input should be greater than 0"
    with pytest.raises(ConfigError) as exc:
        parse_policy("whatif:\n  memory_mb: 64\n  nonsense: 1\n", "p.yaml")
    assert str(exc.value) == "p.yaml:3: whatif.nonsense: unknown key"
    with pytest.raises(ConfigError, match=r"^p.yaml:2: whatif.memory_mb: Input should be a valid integer"):
        parse_policy("whatif:\n  memory_mb: lots\n", "p.yaml")
    with pytest.raises(ConfigError, match=r"^p.yaml:1: whatif: Input should be a dictionary"):
        parse_policy("whatif: [1]\n", "p.yaml")
    # validated values are the dataclass's own, frozen
    w = parse_policy("whatif:\n  memory_mb: 64\n  top_worker_percent: 5\n").whatif
    assert w == WhatIfPolicy(memory_mb=64, top_worker_percent=5.0) and isinstance(w.top_worker_percent, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.memory_mb = 32
