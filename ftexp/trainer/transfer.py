"""Healing state transfer: send a replica's full state to a new cell over the cross-cell group.

The state (model, optimizer moments and step counts, scheduler, RNG states, counters) is a
nested dict holding tensors. Tensors often share storage (views of one buffer), so the codec
sends each underlying storage once, as raw bytes, and rebuilds every tensor on the receiver as a
view (dtype, shape, stride, offset) of the received storage — naive per-tensor sending would
send shared bytes once per view (~110x amplification on a real model).

Wire protocol over a point-to-point pair of a torchft/gloo group:
``header int64[2] = (len(meta), n_storages)`` → ``meta`` (pickled hollow state + view metadata,
as uint8) → ``sizes int64[n_storages]`` → the small storages (under ``DIRECT_BYTES``), concatenated
into one uint8 message → each large storage as a message of its own, in order. A model has hundreds
of small storages and each gloo send costs a round trip, so they travel together; the few large ones
(embeddings, their Adam moments, the witnesses) go straight from the sender's tensor into the
receiver's, with no copy into or out of a concatenation — at a heal's tens of MB those copies
(fresh memory, page faults included) took longer than the wire.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

_TAG = 7
DIRECT_BYTES = 1 << 20  # a storage this large travels as its own message


@dataclass
class _ViewMeta:
    storage_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


@dataclass
class _TensorRef:
    index: int  # into the view list


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Split ``state`` into (pickled hollow structure + view metas, unique storages as uint8)."""
    storages: list[torch.Tensor] = []
    storage_ids: dict[int, int] = {}
    views: list[_ViewMeta] = []

    def hollow(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()  # Parameters travel as plain tensors
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in storage_ids:
                storage_ids[key] = len(storages)
                storages.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            views.append(_ViewMeta(storage_ids[key], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
            return _TensorRef(len(views) - 1)
        if isinstance(obj, dict):
            return {k: hollow(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(hollow(v) for v in obj)
        return obj

    skeleton = hollow(state)
    return pickle.dumps({"skeleton": skeleton, "views": views}), storages


def decode(meta: bytes, storages: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; decoded tensors alias the received storages."""
    payload = pickle.loads(meta)
    views: list[_ViewMeta] = payload["views"]

    def fill(obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            v = views[obj.index]
            base = torch.empty(0, dtype=v.dtype).set_(storages[v.storage_id].untyped_storage())
            return base.as_strided(v.shape, v.stride, v.storage_offset)
        if isinstance(obj, dict):
            return {k: fill(val) for k, val in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(val) for val in obj)
        return obj

    return fill(payload["skeleton"])


def send_state(pg, state: Any, dst_rank: int) -> int:
    """Send ``state`` to ``dst_rank`` of the torchft group ``pg``; return the bytes sent."""
    meta, storages = encode(state)
    meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    header = torch.tensor([len(meta), len(storages)], dtype=torch.int64)
    pg.send([header], dst_rank, _TAG).wait()
    pg.send([meta_t], dst_rank, _TAG).wait()
    sizes = torch.tensor([s.numel() for s in storages], dtype=torch.int64)
    pg.send([sizes], dst_rank, _TAG).wait()
    small = [s for s in storages if s.numel() < DIRECT_BYTES]
    if sum(s.numel() for s in small):
        pg.send([torch.cat(small)], dst_rank, _TAG).wait()
    for storage in storages:
        if storage.numel() >= DIRECT_BYTES:
            pg.send([storage], dst_rank, _TAG).wait()
    return len(meta) + int(sizes.sum())


def recv_state(pg, src_rank: int) -> tuple[Any, int]:
    """Receive a state sent by :func:`send_state`; return (state, bytes received)."""
    header = torch.zeros(2, dtype=torch.int64)
    pg.recv([header], src_rank, _TAG).wait()
    meta_len, n_storages = (int(x) for x in header)
    meta_t = torch.empty(meta_len, dtype=torch.uint8)
    pg.recv([meta_t], src_rank, _TAG).wait()
    sizes = torch.zeros(n_storages, dtype=torch.int64)
    pg.recv([sizes], src_rank, _TAG).wait()
    small_sizes = [n for n in sizes.tolist() if n < DIRECT_BYTES]
    coalesced = torch.empty(sum(small_sizes), dtype=torch.uint8)
    if coalesced.numel():
        pg.recv([coalesced], src_rank, _TAG).wait()
    # Each small storage gets its own memory (a clone of its slice): decode rebuilds tensors on whole
    # storages, and a slice's storage is the whole message.
    small = iter([part.clone() for part in coalesced.split(small_sizes)])
    storages = []
    for n in sizes.tolist():
        if n < DIRECT_BYTES:
            storages.append(next(small))
        else:
            storages.append(torch.empty(n, dtype=torch.uint8))
            pg.recv([storages[-1]], src_rank, _TAG).wait()
    return decode(meta_t.numpy().tobytes(), storages), meta_len + int(sizes.sum())
