import pytest

from slurmguard.sweeps.schedule import (
    check_passes,
    reverse_passes,
    ring_links,
    ring_passes,
    tree_level,
    tree_links,
    tree_passes,
)


@pytest.mark.parametrize("n", range(2, 70))
def test_ring_covers_every_link_once_in_two_or_three_passes(n):
    passes = ring_passes(n)
    check_passes(passes, ring_links(n))  # exact cover, no rank twice in a pass
    assert len(passes) == (2 if n % 2 == 0 else 3)


@pytest.mark.parametrize("n", range(2, 70))
def test_tree_covers_every_child_parent_link_in_at_most_four_passes(n):
    passes = tree_passes(n)
    check_passes(passes, tree_links(n))
    assert len(passes) <= 4
    if n >= 7:  # both sides at both level parities exist
        assert len(passes) == 4
    # pass order of Greyhound Fig. 10: even-level left, even-level right, odd left, odd right
    for p, (parity, right) in zip(passes if n >= 7 else (), ((0, 0), (0, 1), (1, 0), (1, 1))):
        for child, parent in p:
            assert tree_level(child) % 2 == parity and (child % 2 == 0) == bool(right)
            assert parent == (child - 1) // 2


def test_known_small_schedules():
    assert ring_passes(4) == (((0, 1), (2, 3)), ((1, 2), (3, 0)))
    assert ring_passes(5) == (((0, 1), (2, 3)), ((1, 2), (3, 4)), ((4, 0),))
    assert ring_passes(2) == (((0, 1),), ((1, 0),))  # the 2-node sweep: both directions
    assert ring_passes(1) == () and tree_passes(1) == ()
    assert tree_passes(7) == (((3, 1), (5, 2)), ((4, 1), (6, 2)), ((1, 0),), ((2, 0),))


def test_reverse_passes_stay_valid():
    for n in (3, 8, 13):
        rev = reverse_passes(tree_passes(n))
        check_passes(rev, [(p, c) for c, p in tree_links(n)])


def test_check_passes_rejects_overlap_and_gaps():
    with pytest.raises(ValueError, match="uses a rank twice"):
        check_passes((((0, 1), (1, 2)),), [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="cover"):
        check_passes((((0, 1),),), [(0, 1), (1, 0)])
    with pytest.raises(ValueError):
        ring_passes(-1)
