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
