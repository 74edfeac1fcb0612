"""The trainer's side of a weight update: push HF-named tensors to every engine, check what they hold.

`WeightSender` runs in the process that holds the full checkpoint-named tensors (rank 0 of the first
alive cell, or the baseline's DP rank 0). ``connect`` hosts a store on this machine's address toward
the engines (127.0.0.1 for engines on loopback, on one machine or across the nodes of a loopback
cluster; the node's own address toward rollout nodes elsewhere), asks every engine to join a gloo
weight-update group (``/init_weights_update_group``, all at once: each call returns only when the
whole group has formed) and joins it as rank 0. ``send`` posts
``/update_weights_from_distributed`` to every engine and broadcasts each tensor, in name order,
while they receive. When the sender changes (a cell crashed or healed) or an engine restarted, the
new sender ``connect``s under a new group name and the engines drop their old group.

`engine_checksums` reads back {checkpoint name: hash} from each engine (``/weights_checker``);
`tensor_checksums` hashes the sender's tensors the same way, so the two compare for equality.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from urllib.parse import urlsplit
from typing import Callable, TypeVar

import torch

from ftexp.audit.checksums import tensor_hash
from ftexp.errors import one_line
from ftexp.rollout import weight_group
from ftexp.store import LoopbackStore
from ftexp.rollout.client import EngineClient, EngineError, dtype_name

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightSender:
    """`host`: the address the engines reach this process at (None: this machine's address on the route to the
    first engine's host — 127.0.0.1 for engines on loopback, the node's own address toward rollout nodes)."""

    def __init__(self, timeout_s: float = 120.0, host: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.host = host
        self.group: weight_group.WeightGroup | None = None
        self._master: LoopbackStore | None = None
        self._clients: list[EngineClient] = []

    def connect(self, engine_urls: list[str], group_name: str, ranks_per_engine: int = 1) -> None:
        """Form group `group_name` of this process (rank 0) and every engine (one rank each, in order).

        `ranks_per_engine` > 1 is for sglang servers with TP > 1 (their ranks follow one another).
        """
        if not engine_urls:
            raise ValueError("connect needs at least one engine URL")
        self.close()
        host = self.host or weight_group.address_toward(urlsplit(engine_urls[0]).hostname)
        master = self._master = LoopbackStore(host)
        self._clients = [EngineClient(url, timeout_s=self.timeout_s) for url in engine_urls]
        world_size = 1 + ranks_per_engine * len(engine_urls)
        joins = [partial(c.init_weights_update_group, master.host, master.port, 1 + ranks_per_engine * i,
                         world_size, group_name, "gloo", self.timeout_s) for i, c in enumerate(self._clients)]
        try:
            self.group = _alongside_engines(
                lambda: weight_group.join(master.store, group_name, 0, world_size, self.timeout_s, master.host), joins)
        except BaseException:
            self.close()
            raise
        log.info("weight-update group %r formed with %d engine(s)", group_name, len(engine_urls))

    def send(self, named_tensors: dict[str, torch.Tensor], weight_version: str, flush_cache: bool = True) -> None:
        """Every engine loads `named_tensors` (HF checkpoint names) and serves weight version `weight_version`."""
        if self.group is None:
            raise RuntimeError("send before connect")
        group = self.group
        names = list(named_tensors)
        tensors = [named_tensors[n].detach().cpu().contiguous() for n in names]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        updates = [partial(c.update_weights_from_distributed, names, dtypes, shapes, group.name, weight_version,
                           flush_cache, self.timeout_s) for c in self._clients]

        def broadcast_all() -> None:
            for tensor in tensors:
                group.broadcast(tensor)

        try:
            _alongside_engines(broadcast_all, updates)
        except BaseException:
            self.close()  # the group may be mid-collective or broken: the next update re-connects
            raise

    def close(self) -> None:
        """Leave the group (the engines drop theirs when the next group forms)."""
        self.group = None
        for client in self._clients:
            client.close()
        self._clients = []
        if self._master is not None:
            self._master.close()
            self._master = None


def _alongside_engines(own: Callable[[], T], engine_calls: list[Callable[[], object]]) -> T:
    """Run `own` (this rank's part of a collective) while every engine's request is in flight.

    Returns `own`'s result once all succeeded. The first failure ends the wait: an engine's refusal
    comes back at once instead of after the collective's timeout (threads still blocked in it end
    with that timeout), and it is the error raised, being the one that says why.
    """
    pool = ThreadPoolExecutor(max_workers=1 + len(engine_calls))
    try:
        engines = [pool.submit(call) for call in engine_calls]
        mine = pool.submit(own)
        wait([mine, *engines], return_when=FIRST_EXCEPTION)
        for future in engines:
            if future.done() and future.exception() is not None:
                raise future.exception()
        if mine.exception() is not None:
            error = mine.exception()
            raise EngineError(f"weight-update group collective failed: {one_line(error)}") from error
        for future in engines:
            future.result()
        return mine.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def tensor_checksums(named_tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: hash} as an engine's weights checker computes it for the tensors it holds."""
    return {name: tensor_hash(t) for name, t in named_tensors.items()}


def engine_checksums(engine_urls: list[str]) -> list[dict[str, str]]:
    """One {checkpoint name: hash} per engine, in `engine_urls` order (queried concurrently)."""
    def one(url: str) -> dict[str, str]:
        with EngineClient(url) as client:
            return client.checksums()

    with ThreadPoolExecutor(max_workers=max(1, len(engine_urls))) as pool:
        return list(pool.map(one, engine_urls))
