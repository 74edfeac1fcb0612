"""Healing state transfer: stream a replica's full state to a new cell over a TCP connection of its own.

The state (model, optimizer moments and step counts, scheduler, RNG states, counters) is a
nested dict holding tensors. Tensors often share storage (views of one buffer), so the codec
sends each underlying storage once, as raw bytes, and rebuilds every tensor on the receiver as a
view (dtype, shape, stride, offset) of the received storage — naive per-tensor sending would
send shared bytes once per view (~110x amplification on a real model).

The transfer does not go through the cross-cell gloo group. A heal is always the first transfer
of its quorum's group, and a fresh gloo pair moved its first tens of MB at a third of a plain
socket's rate; a socket also streams hundreds of small storages without a round trip each. So
the healed rank listens on its node's address and publishes it in the rendezvous store under
the quorum's key (:class:`StateReceiver`); the source reads it, connects and streams
(:func:`send_state_to`). A new quorum id means new keys: a transfer of a failed quorum is never
mistaken for the next one's. The receiver publishes only once its group is configured, so a
connection means both ends are ready: the wait for the peer (configure skew between two processes)
and the bytes' time are told apart, on the receiver from its accept.

Wire format, after connecting: ``header <q n_storages, q len(views), q len(skeleton)>`` → ``views``
(the pickled view metadata) → ``skeleton`` (the pickled hollow state) → ``sizes <q × n_storages>`` →
every storage's bytes, in order. Both ends move the storages with gather writes and scatter reads
(``sendmsg``/``recvmsg_into``), so a state of hundreds of small storages costs a few system calls, and
no copy into one buffer. The buffers those calls take are made before the connection where they can be
(the source's encoded state, the receiver's own tensors): making the buffers of 233 storages took
0.4-0.5 ms, against 0.7 ms for moving their 1.2 MB through a loopback socket. For the same reason the
receiver pickles its own views up front: when the sender's pickled views are the same bytes, the
storages go straight into its tensors without unpickling and comparing the sender's views, and the
skeleton is unpickled once the bytes are in. In a heal of 233 storages, the part of the transfer before
the storages took 0.4-1.0 ms when the views were unpickled and compared (more than the storages' own
bytes took), and 0.03-0.13 ms with the byte comparison.

Where the bytes land decides the rate: fresh memory faults in every page inside the socket copy, and
zeroing a fresh 24 MB took as long as moving it. So a healed replica that already has the source's
layout (same model, its optimizer state made up front) receives straight into its own tensors; any
other receive lands in fresh memory, large storages on transparent huge pages (one fault per 2 MiB).

The receiver asks for a receive buffer that holds a small state whole. A fresh connection starts with a
window of about 64 KB that grows only as the receiver reads, so on a busy machine every window's worth
the source waits until the receiver is scheduled again: 4 heals of 1.2 MB at once, from accept to the last
byte, took 5.7 ms (median) with the kernel's default and 1.4 ms with a 4 MiB buffer; heals of 80 MB took
as long either way. A host that caps buffers lower (``net.core.rmem_max``) keeps the kernel's autotuning,
which can grow a large transfer's window past that cap.

A heal whose quorum is released mid-transfer is cancelled at once (:meth:`StateReceiver.cancel`),
so no abandoned receive keeps writing into a replica that already moved on.
"""

from __future__ import annotations

import mmap
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable, NamedTuple

import torch

LARGE_BYTES = 1 << 20  # a storage this large lands on huge pages when received into fresh memory
RECEIVE_BUFFER_BYTES = 4 << 20  # the receive buffer a heal's connection asks for (see the module docstring)
_IOV_MAX = 1024  # buffers one sendmsg/recvmsg_into call takes (Linux's IOV_MAX)
_HEADER = struct.Struct("<qqq")


class _TensorRef(int):
    """A tensor's place in the hollow structure: the index of its view."""


def _flatten(state: Any) -> tuple[Any, list[tuple], list[torch.Tensor], list[torch.Tensor]]:
    """Split ``state`` into (hollow structure, views, unique storages as uint8, its tensors in view order).

    A tensor becomes a :class:`_TensorRef` in the hollow structure; its view is the tuple
    ``(storage index, dtype, shape, stride, storage offset)``. Two states of one layout (same
    model, same optimizer) have equal views and storage sizes, whatever their values.
    """
    storages: list[torch.Tensor] = []
    storage_ids: dict[int, int] = {}
    views: list[tuple] = []
    tensors: list[torch.Tensor] = []

    def hollow(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()  # Parameters travel as plain tensors
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in storage_ids:
                storage_ids[key] = len(storages)
                storages.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            views.append((storage_ids[key], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
            tensors.append(obj)
            return _TensorRef(len(views) - 1)
        if isinstance(obj, dict):
            return {k: hollow(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(hollow(v) for v in obj)
        return obj

    skeleton = hollow(state)
    return skeleton, views, storages, tensors


class Encoded(NamedTuple):
    """A state ready to send: its pickled views and hollow structure, the unique storages as uint8, and
    the buffers a gather write takes of them."""
    views: bytes
    skeleton: bytes
    storages: list[torch.Tensor]
    buffers: list[memoryview]

    @property
    def meta_bytes(self) -> int:
        """The bytes sent besides the storages' own: the pickled views and hollow structure."""
        return len(self.views) + len(self.skeleton)


class Layout(NamedTuple):
    """A state's views (also pickled) and storage sizes, what a receiver compares with the sender's to
    receive in place; its storages and tensors, which the received state then reuses; and the buffers
    a scatter read takes of its storages."""
    views: list[tuple]
    pickled_views: bytes
    sizes: list[int]
    storages: list[torch.Tensor]
    tensors: list[torch.Tensor]
    buffers: list[memoryview]


def encode(state: Any) -> Encoded:
    skeleton, views, storages, _ = _flatten(state)
    return Encoded(_pickle(views), _pickle(skeleton), storages, _buffers(storages))


def layout(state: Any) -> Layout:
    _, views, storages, tensors = _flatten(state)
    return Layout(views, _pickle(views), [s.numel() for s in storages], storages, tensors, _buffers(storages))


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _buffers(storages: list[torch.Tensor]) -> list[memoryview]:
    """The bytes of ``storages`` (uint8 tensors) as buffers a socket call takes; empty storages have none."""
    return [memoryview(s.numpy()) for s in storages if s.numel()]


def _view(view: tuple, storages: list[torch.Tensor]) -> torch.Tensor:
    storage_id, dtype, shape, stride, offset = view
    return torch.empty(0, dtype=dtype).set_(storages[storage_id].untyped_storage(), offset, shape, stride)


def _fill(skeleton: Any, tensor_of: Callable[[_TensorRef], torch.Tensor]) -> Any:
    """The hollow structure with each tensor reference replaced by ``tensor_of(reference)``."""
    def fill(obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            return tensor_of(obj)
        if isinstance(obj, dict):
            return {k: fill(val) for k, val in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(val) for val in obj)
        return obj

    return fill(skeleton)


def _landing(n: int) -> torch.Tensor:
    """``n`` bytes of fresh memory to receive into, on transparent huge pages where the kernel offers them."""
    if n == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(n, dtype=torch.uint8)
    memory = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping alive


def _move_all(move: Callable[[list[memoryview]], int], buffers: list[memoryview]) -> None:
    """Run every byte of ``buffers`` through ``move``, a gather send or a scatter receive.

    One system call moves as many storages as the socket takes, in order: hundreds of small storages
    cost a few calls, not one each. ``move`` returns how many bytes it moved; 0 means the peer closed.
    """
    pending = list(buffers)  # trimmed as it goes; the caller's list is kept for the next transfer
    total, done, first = sum(len(v) for v in pending), 0, 0
    while first < len(pending):
        n = move(pending[first:first + _IOV_MAX])
        if n == 0:
            raise ConnectionError(f"the source closed the heal transfer after {done} of {total} bytes of a message")
        done += n
        while n:  # skip the buffers this call filled or emptied; trim the one it stopped in
            if n >= len(pending[first]):
                n -= len(pending[first])
                first += 1
            else:
                pending[first], n = pending[first][n:], 0


def _recv_into(conn: socket.socket, buffers: list[memoryview]) -> None:
    _move_all(lambda views: conn.recvmsg_into(views)[0], buffers)


def _recv_bytes(conn: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    _recv_into(conn, [memoryview(buffer)] if n else [])
    return bytes(buffer)


def send_state(conn: socket.socket, encoded: Encoded) -> int:
    """Stream an encoded state over the connected socket ``conn``; return the state's bytes (meta + storages)."""
    views, skeleton, storages, buffers = encoded
    sizes = [s.numel() for s in storages]
    conn.sendall(_HEADER.pack(len(storages), len(views), len(skeleton)) + views + skeleton
                 + struct.pack(f"<{len(sizes)}q", *sizes))
    _move_all(conn.sendmsg, buffers)
    return encoded.meta_bytes + sum(sizes)


def recv_state(conn: socket.socket, into: Layout | None = None,
               on_last_byte: Callable[[], None] = lambda: None) -> tuple[Any, int]:
    """Receive a state sent by :func:`send_state`; return (state, bytes received).

    With ``into``, the layout of the receiver's own state: if it is the sender's, every storage lands
    straight in the receiver's (memory that already holds pages, so no page faults on the way; the
    returned state aliases those tensors). Otherwise, or without ``into``, in fresh memory.
    ``on_last_byte`` is called once every byte arrived, before the state is rebuilt around them.
    """
    n_storages, views_len, skeleton_len = _HEADER.unpack(_recv_bytes(conn, _HEADER.size))
    small = _recv_bytes(conn, views_len + skeleton_len + 8 * n_storages)
    pickled_views, pickled_skeleton = small[:views_len], small[views_len:views_len + skeleton_len]
    sizes = list(struct.unpack_from(f"<{n_storages}q", small, views_len + skeleton_len))
    views = None  # unpickled only where the bytes alone do not settle it
    same_sizes = into is not None and into.sizes == sizes
    if same_sizes and into.pickled_views != pickled_views:
        views = pickle.loads(pickled_views)  # other bytes may still be equal views, pickled another way
    in_place = same_sizes and (views is None or views == into.views)
    if in_place:
        buffers = into.buffers
    else:
        # Every storage gets memory of its own: a tensor at an offset into a shared buffer is not one
        # every consumer takes (torch's generator state crashes on one).
        storages = [torch.empty(n, dtype=torch.uint8) if n < LARGE_BYTES else _landing(n) for n in sizes]
        buffers = _buffers(storages)
    _recv_into(conn, buffers)
    on_last_byte()
    skeleton = pickle.loads(pickled_skeleton)
    if in_place:
        state = _fill(skeleton, into.tensors.__getitem__)
    else:
        views = pickle.loads(pickled_views) if views is None else views
        state = _fill(skeleton, lambda ref: _view(views[ref], storages))
    return state, views_len + skeleton_len + sum(sizes)


def listen(host: str) -> socket.socket:
    """A socket listening on ``host`` (any port) whose connections get a receive buffer of
    :data:`RECEIVE_BUFFER_BYTES` where the host allows one that large; set before any peer connects,
    since a connection takes its listener's buffer and its window scale is agreed when it opens."""
    server = socket.create_server((host, 0))
    if _largest_receive_buffer() >= RECEIVE_BUFFER_BYTES:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    return server


def _largest_receive_buffer() -> int:
    """The largest receive buffer a socket may ask for on this host (0 where that cannot be read)."""
    try:
        with open("/proc/sys/net/core/rmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def heal_key(quorum_id: int, rank_within_cell: int, dst_rank: int) -> str:
    """Where the healed rank ``dst_rank`` (alive rank in quorum ``quorum_id``) publishes its address."""
    return f"indep_dp/heal/{quorum_id}/{rank_within_cell}/{dst_rank}"


class StateReceiver:
    """One heal's receiving end: listen on ``host``, publish the address, receive one state, into the
    tensors of ``into`` (the receiver's own state) where it has the sender's layout.

    :meth:`cancel`, from another thread, ends a :meth:`receive` at once, wherever it waits: a receive
    that lands in the replica's own tensors must have stopped writing before the rank moves on.
    """

    def __init__(self, host: str, timeout_s: float, into: Any = None):
        self.into = layout(into) if into is not None else None  # before the transfer: the source needs none of it
        self.host, self.timeout_s = host, timeout_s
        self.server: socket.socket | None = None
        self.conn: socket.socket | None = None
        self.connected_at: float | None = None  # time.monotonic() when the source connected
        self.received_at: float | None = None  # time.monotonic() when the state's last byte arrived
        self.cancelled = False
        self._lock = threading.Lock()

    def receive(self, store, key: str) -> tuple[Any, int]:
        """Publish this end's address under ``key`` in ``store``; receive a state (see :func:`recv_state`)."""
        try:
            with self._lock:
                if self.cancelled:
                    raise ConnectionAbortedError("heal transfer cancelled")
                self.server = listen(self.host)
            self.server.settimeout(self.timeout_s)
            store.set(key, f"{self.host}:{self.server.getsockname()[1]}")
            conn, _ = self.server.accept()
            self.connected_at = time.monotonic()
            with self._lock:
                self.conn = conn
                if self.cancelled:
                    raise ConnectionAbortedError("heal transfer cancelled")
            conn.settimeout(self.timeout_s)
            return recv_state(conn, self.into, on_last_byte=self._arrived)
        finally:
            self.close()

    def _arrived(self) -> None:
        self.received_at = time.monotonic()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for sock in (self.server, self.conn):
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
                    except OSError:
                        pass  # not connected, or already closed

    def close(self) -> None:
        with self._lock:
            for sock in (self.server, self.conn):
                if sock is not None:
                    sock.close()


def published_address(store, key: str) -> tuple[str, int]:
    """The address a receiver published under ``key``; waits until it is there (the store's timeout)."""
    host, port = store.get(key).decode().rsplit(":", 1)
    return host, int(port)


def send_state_to(address: tuple[str, int], encoded: Encoded, timeout_s: float) -> int:
    """Send an encoded state to the receiver listening on ``address``; return the state's bytes."""
    with socket.create_connection(address, timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return send_state(conn, encoded)
