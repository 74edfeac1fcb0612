"""A gloo world for spawned test ranks whose rendezvous stays on 127.0.0.1.

torch's ``tcp://`` init makes rank 0 host the TCPStore on every interface. Here the test process
hosts it on loopback only (``ftexp.store.LoopbackStore``) and every spawned rank joins as a client.

The ranks start as forks of the test process's preloaded fork server (``spawn_ranks``,
``preloaded_forks``), not as fresh interpreters.
"""

import datetime as dt
import os

import torch.distributed as dist
import torch.multiprocessing as mp
from preloaded_forks import forkserver_context

from ftexp.store import LoopbackStore

_STORES: list[LoopbackStore] = []  # alive as long as the test process: the ranks of its spawns rendezvous on them


def rendezvous_port() -> int:
    """The port of a fresh store on 127.0.0.1, for one spawn's ranks to meet on (``join_world``)."""
    store = LoopbackStore()
    _STORES.append(store)
    return store.port


def join_world(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's data connections on loopback too
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each rank forked from the preloaded server."""
    forkserver_context()  # the server torch's forkserver start method then forks from
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
