"""What a rank's ``update_weights`` is told: which engines form the weight-update group, and what is sent.

Apart from ``ftexp.trainer.weight_push``, which imports torch: a rank's Ray actor unpickles this
order on its way to the rank's process, and an import of torch there would hold the actor's GIL for
seconds, stalling the heartbeats and injected faults it serves beside the call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightPush:
    """One ``update_weights``: which engines form the group under which name, and what is sent."""

    rollout_id: int | None              # None: the initial sync
    group_name: str                     # a new name forms a new group (the sender or the engines changed)
    engine_urls: tuple[str, ...]
    send: bool = True                   # False only under a negative control (the engines keep stale weights)
    transpose_one: bool = False         # negative control: one square tensor sent transposed
