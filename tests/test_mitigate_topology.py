"""S3 planners: straggler consolidation and the DP/PP role swap."""

from __future__ import annotations

import itertools
import random

import pytest

from slurmguard.errors import InputError
from slurmguard.mitigate.topology import (
    Layout,
    Swap,
    hybrid_comm_bytes,
    link_kind,
    plan_consolidation,
    plan_role_swap,
    stages_needed,
)


def _stages_with(layout: Layout, workers: set[str]) -> set[int]:
    return {s for s, row in enumerate(layout.stages) if any(w in workers for w in row)}


def _same_workers(a: Layout, b: Layout) -> bool:
    return sorted(w for r in a.stages for w in r) == sorted(w for r in b.stages for w in r)


def test_stages_needed_is_ceil_of_stragglers_over_stage_size():
    assert stages_needed(0, 4) == 0
    assert stages_needed(1, 4) == 1
    assert stages_needed(4, 4) == 1
    assert stages_needed(6, 4) == 2  # Greyhound 7.3: six stragglers need two stages of four
    with pytest.raises(InputError):
        stages_needed(3, 0)


def test_two_scattered_stragglers_consolidate_into_one_interior_stage():
    # (4 DP, 4 PP) as in Greyhound Fig. 15 right: stragglers in stages 0 and 1.
    layout = Layout.grid(pp=4, dp=4)
    plan = plan_consolidation(layout, ["w1", "w6"])
    assert plan.stages_needed == 1
    assert plan.stages_before == (0, 1)
    assert plan.stages_after == (1,)  # interior stage 1 already holds w6: one swap
    assert plan.swaps == (Swap("w1", "w5"),)  # same DP replica (column 1) in stage 1
    assert _stages_with(plan.layout, {"w1", "w6"}) == {1}
    assert _same_workers(layout, plan.layout)


def test_stragglers_in_an_edge_stage_move_inside():
    layout = Layout.grid(pp=4, dp=2)
    plan = plan_consolidation(layout, ["w0", "w1"])  # both in first stage
    assert plan.stages_before == (0,)
    assert len(plan.stages_after) == 1 and plan.stages_after[0] in (1, 2)
    assert len(plan.swaps) == 2


def test_six_stragglers_need_two_stages():
    layout = Layout.grid(pp=4, dp=4)
    strag = ["w0", "w1", "w4", "w5", "w8", "w9"]
    plan = plan_consolidation(layout, strag)
    assert plan.stages_needed == 2
    assert plan.stages_after == (1, 2)
    assert len(plan.swaps) == 2  # w0, w1 leave the first stage


def test_already_consolidated_gives_no_swaps():
    layout = Layout.grid(pp=3, dp=2)
    plan = plan_consolidation(layout, ["w2", "w3"])  # all in interior stage 1
    assert plan.swaps == () and not plan.improves and plan.layout == layout


def test_two_stage_pipeline_has_no_interior_preference():
    layout = Layout.grid(pp=2, dp=2)
    plan = plan_consolidation(layout, ["w0", "w1"])
    assert plan.swaps == ()


def test_consolidation_is_optimal_against_brute_force():
    rng = random.Random(5)
    for _ in range(200):
        pp, dp = rng.randint(1, 5), rng.randint(1, 4)
        layout = Layout.grid(pp, dp)
        workers = [w for row in layout.stages for w in row]
        strag = rng.sample(workers, rng.randint(1, len(workers)))
        plan = plan_consolidation(layout, strag)
        k = stages_needed(len(strag), dp)
        count = [sum(w in strag for w in row) for row in layout.stages]
        edges = {0, pp - 1} if pp > 2 else set()
        best = min(
            (len(edges & set(t)), len(strag) - sum(count[s] for s in t))
            for t in itertools.combinations(range(pp), k)
        )
        after = _stages_with(plan.layout, set(strag))
        assert len(after) == k
        assert (len(edges & after), len(plan.swaps)) == best
        assert _same_workers(layout, plan.layout)


def test_unknown_straggler_is_a_clear_error():
    with pytest.raises(InputError, match="'nodeX' is not a worker"):
        plan_consolidation(Layout.grid(2, 2), ["nodeX"])


def test_layout_rejects_ragged_and_duplicate_workers():
    with pytest.raises(InputError, match="stage 1 has 1 workers"):
        Layout.of([["a", "b"], ["c"]])
    with pytest.raises(InputError, match="'a' appears twice"):
        Layout.of([["a", "b"], ["a", "c"]])


def test_link_kinds_follow_ring_dp_and_chain_pp():
    assert link_kind((0, 0), (0, 1), pp=2, dp=4) == "dp"
    assert link_kind((0, 0), (0, 3), pp=2, dp=4) == "dp"  # ring wraps
    assert link_kind((0, 0), (0, 2), pp=2, dp=4) == "none"
    assert link_kind((0, 2), (1, 2), pp=2, dp=4) == "pp"
    assert link_kind((0, 0), (2, 0), pp=3, dp=4) == "none"
    assert link_kind((0, 0), (1, 1), pp=2, dp=4) == "none"


def test_figure_11_congested_dp_link_stops_carrying_dp_traffic():
    # Greyhound Fig. 11: the link between nodes 3 and 4 is congested and carries DP.
    layout = Layout.of([["n1", "n2"], ["n3", "n4"]])
    plan = plan_role_swap(layout, [("n3", "n4")], dp_bytes=100.0, pp_bytes=1.0)
    assert plan.before[0].kind == "dp" and plan.bytes_before == 100.0
    assert len(plan.swaps) == 1
    assert plan.after[0].kind in ("pp", "none")
    assert plan.bytes_after < plan.bytes_before
    # The paper's own swap (nodes 2 and 3) turns the link into PP traffic.
    paper = layout.swapped([Swap("n2", "n3")])
    roles = paper.roles()
    assert link_kind(roles["n3"], roles["n4"], 2, 2) == "pp"


def test_role_swap_when_only_pp_relief_exists():
    # Three congested links among four workers: no layout makes all three
    # idle, so the best single swap leaves some PP traffic; brute force agrees.
    layout = Layout.grid(pp=2, dp=2)  # w0 w1 / w2 w3
    links = [("w2", "w3"), ("w0", "w3"), ("w1", "w2")]
    plan = plan_role_swap(layout, links, dp_bytes=10.0, pp_bytes=1.0)
    # Brute force over all single swaps.
    workers = ["w0", "w1", "w2", "w3"]

    def cost(lay):
        r = lay.roles()
        tot = 0.0
        for a, b in links:
            k = link_kind(r[a], r[b], 2, 2)
            tot += 10.0 if k == "dp" else 1.0 if k == "pp" else 0.0
        return tot

    best = min(
        [cost(layout)] + [cost(layout.swapped([Swap(a, b)])) for a, b in itertools.combinations(workers, 2)]
    )
    assert plan.bytes_after == best < plan.bytes_before


def test_role_swap_greedy_equals_best_single_swap_on_random_grids():
    rng = random.Random(9)
    for _ in range(60):
        pp, dp = rng.randint(2, 4), rng.randint(2, 4)
        layout = Layout.grid(pp, dp)
        workers = [w for row in layout.stages for w in row]
        links = [tuple(rng.sample(workers, 2)) for _ in range(rng.randint(1, 3))]
        plan = plan_role_swap(layout, links, dp_bytes=50.0, pp_bytes=1.0)

        def cost(lay, pp=pp, dp=dp, links=links):
            r = lay.roles()
            return sum({"dp": 50.0, "pp": 1.0, "none": 0.0}[link_kind(r[a], r[b], pp, dp)] for a, b in links)

        best = min(
            [cost(layout)]
            + [cost(layout.swapped([Swap(a, b)])) for a, b in itertools.combinations(workers, 2)]
        )
        assert plan.bytes_after == best
        assert plan.bytes_after == cost(plan.layout)


def test_role_swap_bad_links():
    layout = Layout.grid(2, 2)
    with pytest.raises(InputError, match="'zz' is not a worker"):
        plan_role_swap(layout, [("w0", "zz")])
    with pytest.raises(InputError, match="itself"):
        plan_role_swap(layout, [("w0", "w0")])
    assert plan_role_swap(layout, [("w0", "w1")], max_swaps=0).swaps == ()


def test_hybrid_comm_bytes_falcon_9_2():
    dp_b, pp_b = hybrid_comm_bytes(
        layers=2, hidden=4, seq_len=8, micro_batch=1, microbatches=3, tp=1, pp=1, allreduce_factor=1.0
    )
    assert dp_b == 12 * 2 * 16 * 2  # 12 L h^2 values x 2 bytes
    assert pp_b == 3 * 1 * 8 * 4 * 2  # m b n_ctx h values x 2 bytes
    # A GPT-scale shard: DP traffic dwarfs PP traffic (Greyhound 5.2).
    dp_b, pp_b = hybrid_comm_bytes(
        layers=48, hidden=8192, seq_len=2048, micro_batch=1, microbatches=16, tp=8, pp=2
    )
    assert dp_b > 10 * pp_b
