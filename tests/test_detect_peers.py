"""Peer-relative scoring (Guard 4.2): multi-signal, consecutive windows, robust stats."""

from __future__ import annotations

import numpy as np

from slurmguard.detect.peers import PeerScorer, by_node
from slurmguard.telemetry.base import Signal, sample


def _window(rng, t, *, throttled=None, noisy_temp=None, low_power=None):
    out = []
    for g in range(8):
        temp, clock, power, util = (
            60 + rng.normal(0, 1),
            1980 - abs(rng.normal(0, 5)),
            650 + rng.normal(0, 6),
            100,
        )
        if g == throttled:
            temp, clock, power = 78, 1380, 550  # Guard Table 2
        if g == noisy_temp:
            temp = 85  # one signal only
        if g == low_power:
            power = 570  # 12% low at normal utilisation
        out += [
            sample("n1", Signal.GPU_TEMP, temp, t, gpu=g),
            sample("n1", Signal.SM_CLOCK, clock, t, gpu=g),
            sample("n1", Signal.POWER, power, t, gpu=g),
            sample("n1", Signal.GPU_UTIL, util, t, gpu=g),
        ]
    return out


def test_throttled_gpu_flagged_against_7_healthy_peers_after_consecutive_windows():
    rng = np.random.default_rng(0)
    ps = PeerScorer()
    got = [ps.window(_window(rng, 30.0 * w, throttled=5)) for w in range(4)]
    assert got[0] == [] and got[1] == []  # needs 3 consecutive windows
    (flag,) = got[2]
    assert (flag.node, flag.device, flag.hard) == ("n1", "gpu5", False)
    assert {d.signal for d in flag.deviations} >= {Signal.GPU_TEMP, Signal.SM_CLOCK, Signal.POWER}
    assert any("sm_clock 1380" in r for r in flag.reasons)


def test_one_noisy_signal_alone_is_not_flagged():
    rng = np.random.default_rng(1)
    ps = PeerScorer()
    for w in range(6):
        assert ps.window(_window(rng, 30.0 * w, noisy_temp=2)) == []
    # ...even though it does deviate
    assert ps.deviations(_window(rng, 0.0, noisy_temp=2))[("n1", "gpu2")][0].signal == Signal.GPU_TEMP


def test_streak_resets_when_the_deviation_stops():
    rng = np.random.default_rng(2)
    ps = PeerScorer()
    seq = [5, 5, None, 5, 5]
    flags = [ps.window(_window(rng, 30.0 * i, throttled=t)) for i, t in enumerate(seq)]
    assert all(f == [] for f in flags)


def test_low_power_at_normal_utilisation_counts_as_two_signals():
    rng = np.random.default_rng(3)
    ps = PeerScorer()
    flags = [ps.window(_window(rng, 30.0 * w, low_power=1)) for w in range(3)]
    (flag,) = flags[2]
    assert flag.device == "gpu1"
    assert {d.signal for d in flag.deviations} == {Signal.POWER, "power_per_util"}


def test_hard_failures_flag_at_once():
    ps = PeerScorer()
    s = [
        sample("n3", Signal.XID, 79, 0.0, gpu=4),
        sample("n3", Signal.XID, 13, 0.0, gpu=1),
        sample("n4", Signal.NIC_STATE, 0, 0.0, nic="mlx5_2:1"),
    ]
    flags = ps.window(s)
    assert {(f.node, f.device) for f in flags} == {
        ("n3", "gpu4"),
        ("n4", "mlx5_2:1"),
    }  # XID 13 is an app error
    assert by_node(flags)["n3"].hard


def test_peer_groups_are_compared_separately():
    rng = np.random.default_rng(4)
    ps = PeerScorer()
    # two hardware classes: A100 nodes run cooler and slower than H100 nodes; neither is an outlier
    s = []
    for n in range(5):
        for g in range(4):
            s += [
                sample(f"a{n}", Signal.SM_CLOCK, 1410 + rng.normal(0, 3), 0, gpu=g),
                sample(f"a{n}", Signal.GPU_TEMP, 50 + rng.normal(0, 1), 0, gpu=g),
                sample(f"h{n}", Signal.SM_CLOCK, 1980 + rng.normal(0, 3), 0, gpu=g),
                sample(f"h{n}", Signal.GPU_TEMP, 65 + rng.normal(0, 1), 0, gpu=g),
            ]
    groups = {f"a{n}": "a100" for n in range(5)} | {f"h{n}": "h100" for n in range(5)}
    assert ps.deviations(s, groups) == {}
