"""WitnessIdAllocator: fresh ids per attempt on a ring, stale slots, and resuming the counter."""

import pytest

from ftexp.audit.events import EventLogger, ProcessIdentity, WitnessAllocateIdEvent, read_events
from ftexp.audit.witness import WitnessIdAllocator, allocation_event, persisted_counter


def stale_ids(info) -> set[int]:
    return {i for start, stop in info.stale_ranges for i in range(start, stop)}


@pytest.mark.parametrize("buffer_size", [0, -1])
def test_non_positive_buffer_size_is_a_value_error(buffer_size):
    with pytest.raises(ValueError, match="positive"):
        WitnessIdAllocator(buffer_size)


def test_negative_num_ids_is_a_value_error_and_leaves_the_counter():
    allocator = WitnessIdAllocator(10)
    with pytest.raises(ValueError, match="negative"):
        allocator.allocate(-1)
    assert allocator.counter == 0


def test_more_ids_than_the_buffer_says_to_raise_the_buffer_size():
    allocator = WitnessIdAllocator(10)
    assert len(allocator.allocate(10).witness_ids) == 10
    with pytest.raises(ValueError, match="raise trainer.witness_buffer_size"):
        allocator.allocate(11)


def test_ids_wrap_around_the_ring():
    allocator = WitnessIdAllocator(5)
    assert allocator.allocate(3).witness_ids == [0, 1, 2]
    assert allocator.allocate(4).witness_ids == [3, 4, 0, 1]
    assert allocator.counter == 7


def test_stale_ids_are_the_next_slots_to_be_reused():
    # B=10: keep = 7; after 8 ids the 3 slots after the counter are stale.
    info = WitnessIdAllocator(10).allocate(8)
    assert stale_ids(info) == {8, 9, 0}
    assert info.stale_ranges == [(8, 10), (0, 1)]


def test_no_stale_ids_before_anything_was_allocated():
    assert WitnessIdAllocator(10).allocate(0).stale_ranges == []


@pytest.mark.parametrize("buffer_size", [1, 7, 10, 70])
def test_stale_and_recent_ids_partition_the_ring(buffer_size):
    allocator = WitnessIdAllocator(buffer_size)
    keep = buffer_size * 7 // 10
    recent: list[int] = []
    for n in [1, 3, buffer_size, 2, buffer_size - 1, 5]:
        n = min(n, buffer_size)
        info = allocator.allocate(n)
        recent = (recent + info.witness_ids)[-min(keep, allocator.counter):] if keep else []
        stale = stale_ids(info)
        assert not stale & set(recent)
        assert stale | set(recent) == set(range(buffer_size))


def test_keep_is_the_exact_floor_of_seventy_percent():
    # 0.7 * 70 is 48.99999999999999 in floating point; the exact floor is 49.
    info = WitnessIdAllocator(70).allocate(60)
    assert len(stale_ids(info)) == 70 - 49


def test_resume_never_moves_backwards():
    allocator = WitnessIdAllocator(10)
    allocator.resume(7)
    allocator.resume(7)
    with pytest.raises(ValueError, match="backwards"):
        allocator.resume(6)
    assert allocator.allocate(2).witness_ids == [7, 8]


def test_persisted_counter_is_the_highest_counter_after(tmp_path):
    logger = EventLogger(tmp_path, ProcessIdentity(component="main"))
    allocator = WitnessIdAllocator(1000)
    for rollout_id, attempt in [(0, 0), (1, 0), (1, 1)]:
        info = allocator.allocate(256)
        logger.log(allocation_event(rollout_id, attempt, info, allocator.counter))
    # Out of order on disk (another process's file sorts first) must not matter.
    EventLogger(tmp_path, ProcessIdentity(component="actor", cell_index=0, rank_within_cell=0)).log(
        WitnessAllocateIdEvent(rollout_id=0, attempt=0, witness_id_to_sample_index={0: 0}, counter_after=256))
    events = read_events(tmp_path)
    assert persisted_counter(events) == 768
    assert persisted_counter([]) == 0



def test_allocation_event_maps_each_id_to_its_sample():
    allocator = WitnessIdAllocator(5)
    allocator.allocate(3)
    event = allocation_event(4, 1, allocator.allocate(4), allocator.counter)
    assert event.witness_id_to_sample_index == {3: 0, 4: 1, 0: 2, 1: 3}
    assert (event.rollout_id, event.attempt, event.counter_after) == (4, 1, 7)
