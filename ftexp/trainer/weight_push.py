"""Pushing a replica's weights to a side's rollout engines: the trainer's end of the weight sync.

Every rank of the replica that holds the weights (the target's first alive cell, the baseline's
replica 0) exports them in HF layout; its first rank broadcasts them to all engines over a
weight-update group (``ftexp.rollout.weight_sync``), kept while its name stays the same: a new name,
given whenever the sender or the engine set changes, forms a new group. The engines themselves, the
rollouts generated through them and the checks of what they hold are ``ftexp.trainer.rollout_engines``;
this module is apart from it so that the ranks, which only push, do not import the engines' server.
"""

from __future__ import annotations

from ftexp.engines.base import Replica
from ftexp.rollout.weight_sync import WeightSender, tensor_checksums
from ftexp.trainer.weight_order import WeightPush

# A sender that dies mid-update (its cell crashed) leaves every engine waiting on its weight-update
# group until the engine's group timeout; the next sender's requests queue behind that wait, so they
# allow for it on top of forming their own group — else the new sender's cell would be failed for it.
ENGINE_GROUP_TIMEOUT_S = 60.0
SENDER_TIMEOUT_S = 3 * ENGINE_GROUP_TIMEOUT_S


class WeightPusher:
    """The sending end of the weight-update group, kept by the rank that pushes (one group per name)."""

    def __init__(self) -> None:
        self.sender: WeightSender | None = None
        self.group_name: str | None = None

    def push(self, replica: Replica, order: WeightPush) -> dict[str, str] | None:
        """Every rank of the replica calls this (the export is a collective); its first rank sends.

        Returns the checksums of the weights the trainer holds (first rank), None on the others.
        """
        named = replica.export_hf()
        if named is None:
            return None
        if order.transpose_one:
            name = next(n for n, t in sorted(named.items()) if t.dim() == 2 and t.shape[0] == t.shape[1])
            named = {**named, name: named[name].t().contiguous()}
        if order.send:
            if self.group_name != order.group_name:
                self.close()
                self.sender = WeightSender(timeout_s=SENDER_TIMEOUT_S)
                self.sender.connect(list(order.engine_urls), order.group_name)
                self.group_name = order.group_name
            self.sender.send(named, weight_version=str(order.rollout_id))
        return tensor_checksums(named)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender, self.group_name = None, None
