import re

import pytest

from slurmguard.errors import InputError
from slurmguard_dev.sweepfaults import NodeFault, extra_delay, load_faults


def test_inline_env_beats_file_and_is_keyed_by_node(tmp_path):
    f = tmp_path / "faults.json"
    f.write_text('{"node3": {"membw_slowdown": 0.5}}')
    env = {"SLURMGUARD_SWEEP_INJECT_FILE": str(f)}
    assert load_faults(env) == {"node3": NodeFault(membw_slowdown=0.5)}
    env["SLURMGUARD_SWEEP_INJECT"] = '{"node2": {"gemm_slowdown": 0.25, "gpus": [5]}}'
    faults = load_faults(env)
    assert set(faults) == {"node2"}
    assert faults["node2"].hits_gpu(5) and not faults["node2"].hits_gpu(4)
    assert load_faults({}) == {}


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"node2": {"gemm_slowdown": 1.0}}', "node2.gemm_slowdown: expected a fraction in [0, 1)"),
        ('{"node2": {"gemm_slow": 0.1}}', "node2.gemm_slow: unknown fault"),
        ('{"bad name": {}}', "invalid node name"),
        ('{"node2": {"link_direction": "up"}}', "expected tx, rx or both"),
        ('{"node2": {"crash": 1}}', "expected true or false"),
        ("[1]", "expected a JSON object"),
        ('{"node2": ', "invalid JSON"),
    ],
)
def test_bad_knobs_are_one_line_errors(text, needle):
    with pytest.raises(InputError) as exc:
        load_faults({"SLURMGUARD_SWEEP_INJECT": text})
    assert needle in str(exc.value) and str(exc.value).startswith("SLURMGUARD_SWEEP_INJECT: ")


def test_delay_turns_a_measurement_into_the_asked_slowdown():
    # rate = bytes / (t + delay) must be (1 - s) of bytes / t
    t, s = 0.2, 0.25
    assert t / (t + extra_delay(t, s)) == pytest.approx(1 - s)
    assert extra_delay(t, 0.0) == 0.0
    f = NodeFault(link_slowdown=0.5, link_direction="tx")
    assert f.link_factor(sending=True) == 0.5 and f.link_factor(sending=False) == 0.0


def test_the_shipped_workloads_have_no_fault_concept():
    """Fault injection lives in the development tools alone (issue 14.6): no name in the
    workloads' code (functions, parameters, attributes, variables) speaks of a fault, an
    injection or a slowdown; the launcher wraps their timers from outside."""
    import ast

    from slurmguard import datafiles

    for script in ("sweeplib.py", "node_sweep.py", "pair_sweep.py"):
        tree = ast.parse((datafiles.sweep_dir() / script).read_text(encoding="utf-8"))
        names = {
            getattr(n, "id", None)
            or getattr(n, "attr", None)
            or getattr(n, "name", None)
            or getattr(n, "arg", None)
            for n in ast.walk(tree)
        }
        names |= {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
        words = {n: {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", n)} for n in names if n}
        bad = sorted(
            n
            for n, ws in words.items()
            if ws & {"fault", "faults", "inject", "injected", "slowdown", "delay"}
        )
        assert not bad, (script, bad)
