"""Witness ids: every training attempt names its samples, so the weights can say what was trained.

The model carries witness parameters (``ftexp/engines/torch/witness.py``): one zero-initialised
scalar per slot of a ring buffer of ``buffer_size`` slots. Before every training *attempt* of a
rollout the driver allocates one fresh slot per sample — the sample's **witness id** — and each
sample's tokens touch only their own slot. After a committed step, a slot's row is non-zero
exactly when some cell trained that sample; the event analyzer compares the non-zero rows with
the ids of the attempts that committed. A retry takes new ids, so an attempt that
was discarded but still leaked into the weights shows up as rows nobody should have touched.

The counter only grows; ids are ``counter mod buffer_size``. The slots the next allocations will
reuse are **stale**: every rank zeroes their rows (weight and Adam moments) after each committed
step, so a reused slot starts from exactly zero. With ``keep = floor(0.7·B)`` and ``c`` the counter
after the allocation, the stale slots are the ``B − min(keep, c)`` slots starting at ``c mod B``;
they and the most recently allocated ``min(keep, c)`` ids partition the ring.

Zeroing keeps pace with reuse only while the ids handed out from one commit to the next number at
most ``B − keep`` (~0.3·B); otherwise a slot can be handed out again before any commit zeroed it,
and its old non-zero row could hide a lost sample. The default buffer (1,048,576 slots) allows
1,228 attempts of 256 samples per commit; a buffer below ~3.4× the samples per rollout allows none. A run of
rollouts trained in one call has its ids all handed out before its first commit, so the driver keeps runs
within that bound (``allocations_between_commits``).

Stale slots form one arc of the ring, so they travel as at most two half-open ranges rather than a
list: at the default buffer size nearly the whole buffer (~1M ids) is stale for the first thousands
of rollouts. The analyzer keeps every id set as ranges too (``merged``, ``difference``): the ids a
snapshot must show grow with the run (every committed sample so far), while their ranges number
only about one per gap (a zero-advantage sample, a discarded attempt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ftexp.audit.events import WitnessAllocateIdEvent

# Half-open [start, stop) range of witness slots.
IdRange = tuple[int, int]

# The share of the ring kept live: ids allocated in the most recent 70% of the ring.
KEEP_NUMERATOR, KEEP_DENOMINATOR = 7, 10


@dataclass(frozen=True)
class WitnessInfo:
    """What one training attempt needs: an id per sample and the slots to zero after the step."""

    witness_ids: list[int]          # one per sample, in the rollout's sample order
    stale_ranges: list[IdRange]     # at most two half-open slot ranges


def ranges_of(ids: Iterable[int]) -> list[IdRange]:
    """The canonical ranges (see ``merged``) of exactly ``ids``."""
    ranges: list[IdRange] = []
    for i in sorted(set(ids)):
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return ranges


def merged(ranges: Iterable[IdRange]) -> list[IdRange]:
    """``ranges`` sorted, empty ones dropped, overlapping or touching ones joined: the canonical form,
    in which two lists are equal exactly when they hold the same ids."""
    out: list[IdRange] = []
    for start, stop in sorted((a, b) for a, b in ranges if a < b):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def difference(a: list[IdRange], b: list[IdRange]) -> list[IdRange]:
    """The ids of ``a`` not in ``b``, both canonical, as canonical ranges; linear in the ranges."""
    out: list[IdRange] = []
    j = 0
    for start, stop in a:
        while j < len(b) and b[j][1] <= start:  # b's ranges wholly before this one never matter again
            j += 1
        k = j
        while k < len(b) and b[k][0] < stop:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < stop:
            out.append((start, stop))
    return out


def count(ranges: Iterable[IdRange]) -> int:
    return sum(stop - start for start, stop in ranges)


class WitnessIdAllocator:
    def __init__(self, buffer_size: int):
        if buffer_size <= 0:
            raise ValueError(f"witness buffer_size must be positive, got {buffer_size}")
        self.buffer_size = buffer_size
        self.counter = 0  # ids handed out so far, over the whole run (resumed from the event log)

    def allocate(self, num_ids: int) -> WitnessInfo:
        if num_ids < 0:
            raise ValueError(f"cannot allocate a negative number of witness ids ({num_ids})")
        if num_ids > self.buffer_size:
            raise ValueError(f"{num_ids} witness ids do not fit in a buffer of {self.buffer_size}; "
                             f"raise trainer.witness_buffer_size")
        ids = [(self.counter + i) % self.buffer_size for i in range(num_ids)]
        self.counter += num_ids
        return WitnessInfo(witness_ids=ids, stale_ranges=self._stale_ranges())

    def resume(self, counter: int) -> None:
        """Continue after ``counter`` ids; never backwards, or ids still live would be handed out again."""
        if counter < self.counter:
            raise ValueError(f"witness counter cannot move backwards ({self.counter} -> {counter})")
        self.counter = counter

    def _stale_ranges(self) -> list[IdRange]:
        if self.counter == 0:
            return []
        buffer = self.buffer_size
        keep = kept_slots(buffer)
        num_stale = buffer - min(keep, self.counter, buffer)
        start = self.counter % buffer
        if num_stale == 0:
            return []
        if start + num_stale <= buffer:
            return [(start, start + num_stale)]
        return [(start, buffer), (0, start + num_stale - buffer)]


def kept_slots(buffer_size: int) -> int:
    """``keep``: the ring's live share, exactly floor(0.7·B) (no float rounding)."""
    return buffer_size * KEEP_NUMERATOR // KEEP_DENOMINATOR


def allocations_between_commits(buffer_size: int, num_ids: int) -> int:
    """How many allocations of ``num_ids`` may be handed out from one commit to the next: at most ``B − keep``
    ids (module docstring), and always one."""
    return max(1, (buffer_size - kept_slots(buffer_size)) // max(1, num_ids))


def persisted_counter(events: Iterable[object]) -> int:
    """The highest ``counter_after`` of any allocation in the event log (0 if none)."""
    return max((e.counter_after for e in events if isinstance(e, WitnessAllocateIdEvent)), default=0)


def allocation_event(rollout_id: int, attempt: int, info: WitnessInfo, counter_after: int) -> WitnessAllocateIdEvent:
    return WitnessAllocateIdEvent(rollout_id=rollout_id, attempt=attempt, counter_after=counter_after,
                                  witness_id_to_sample_index={wid: i for i, wid in enumerate(info.witness_ids)})
