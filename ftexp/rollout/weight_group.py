"""The weight-update group: a gloo process group of the weight sender (rank 0) and the engines.

It is made without torch's default process group, so a process may belong to one such group next
to its own training world, and a new group can replace an old one (the sender changes when a cell
crashes or heals). The sender hosts a TCPStore; every member builds a ``ProcessGroupGloo`` over
the store's ``<group_name>/`` prefix (torch's own prefix for named groups) — the constructor returns
once all ``world_size`` members have connected. Every socket stays on the sender's address
(127.0.0.1 unless a multi-node run gives another): the store listens on a socket bound to it, and
each member's gloo device is pinned to its own address toward the sender, never to whatever the
host name resolves to.
"""

from __future__ import annotations

import datetime as dt
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


@dataclass
class WeightGroup:
    """One member's handle on a formed group."""

    name: str
    rank: int
    world_size: int
    pg: dist.ProcessGroupGloo = field(repr=False)
    store: dist.Store = field(repr=False)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """``dist.broadcast`` from rank 0, in place (rank 0 sends `tensor`, the others receive into it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


def join(store: dist.Store, name: str, rank: int, world_size: int, timeout_s: float,
         device_host: str = LOOPBACK) -> WeightGroup:
    """Form group `name` as `rank` of `world_size`; blocks until every member joined (or the timeout).

    `device_host` is the address this member's gloo connections use (see `address_toward`).
    """
    timeout = dt.timedelta(seconds=timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), rank, world_size, options)
    return WeightGroup(name=name, rank=rank, world_size=world_size, pg=pg, store=store)


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for a loopback host); sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a UDP connect only picks the route
        return probe.getsockname()[0]


def store_client(host: str, port: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=timeout_s))
