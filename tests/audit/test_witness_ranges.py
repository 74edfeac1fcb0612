"""Witness id sets as ranges: the canonical form, differences, and a run's ledger staying small."""

import random

from ftexp.audit.analyzer import CommittedIds
from ftexp.audit.witness import count, difference, merged, ranges_of


def ids_in(ranges):
    return {i for start, stop in ranges for i in range(start, stop)}


def test_ranges_of_and_merged_give_one_canonical_form_per_set():
    assert ranges_of([5, 3, 4, 9, 3]) == [(3, 6), (9, 10)]
    assert merged([(9, 10), (3, 5), (4, 6), (6, 6), (10, 12)]) == [(3, 6), (9, 12)]  # overlapping and touching
    rng = random.Random(0)
    for _ in range(300):
        ranges = [(x, x + rng.randrange(0, 6)) for x in rng.sample(range(80), 10)]
        canonical = merged(ranges)
        assert ids_in(canonical) == ids_in(ranges) and canonical == ranges_of(ids_in(ranges))


def test_difference_is_set_difference():
    rng = random.Random(1)
    for _ in range(2000):
        a = {rng.randrange(60) for _ in range(rng.randrange(40))}
        b = {rng.randrange(60) for _ in range(rng.randrange(40))}
        d = difference(ranges_of(a), ranges_of(b))
        assert d == ranges_of(a - b) and count(d) == len(a - b)


def test_the_wanted_ids_of_a_long_run_stay_a_few_ranges():
    """1,000 rollouts of 256 ids, two zero-advantage samples each, one reallocated-and-excused id reused:
    256,000 ids, as ranges one per excused sample plus one."""
    committed, per_rollout = CommittedIds(), 256
    for r in range(1000):
        first = r * per_rollout
        want = committed.add([(first, first + per_rollout)], [(first + 7, first + 8), (first + 100, first + 101)])
    assert committed.expected == [(0, 1000 * per_rollout)]
    assert len(want) == 2 * 1000 + 1 and count(want) == 1000 * (per_rollout - 2)
    # An id allocated again loses its excuse: the ring wrapped onto an excused slot.
    assert count(committed.add([(7, 8)], [])) == 1000 * (per_rollout - 2) + 1
