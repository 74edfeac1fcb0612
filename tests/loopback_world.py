"""A gloo world for spawned test ranks whose rendezvous stays on 127.0.0.1.

torch's ``tcp://`` init makes rank 0 host the TCPStore on every interface. Here the test process
hosts it on loopback only (``ftexp.store.LoopbackStore``) and every spawned rank joins as a client.

The ranks start as forks of one server that imported torch's compiler stack and megatron-core once
(``spawn_ranks``): a fresh interpreter spends ~5 CPU-seconds on those imports, far more than the few
training steps a test rank runs. Each rank still starts from the server's clean state, before any
thread or process group. The server (multiprocessing's forkserver) lives as long as the test process.
"""

import datetime as dt
import multiprocessing
import os

import torch.distributed as dist
import torch.multiprocessing as mp

from ftexp.store import LoopbackStore

# torch's optimizers import torch._dynamo when they are built; megatron-core is what every rank builds.
PRELOAD = ["torch", "torch._dynamo", "megatron.core", "ftexp.engines.megatron.model"]

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
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
