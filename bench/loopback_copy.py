"""The yardstick for a heal's transfer rate: a raw copy of the same bytes over loopback TCP sockets.

Each connection joins two processes of its own, which copy with plain ``sendall``/``recv_into`` over
127.0.0.1: no serialization, no process group, no framing. A heal that moves its state at half this
rate or better is within what the machine's loopback allows (the bound ``step_time.py`` holds heals
to: heal bytes/s ÷ this >= 0.5). One connection is the plain yardstick. A heal of a multi-rank cell
moves its bytes over one connection per rank, all at once; ``connections=k`` copies the same bytes
that way (split evenly, k copies at once), which on a machine with fewer cores than processes is what
the same bytes cost to move in that pattern, before any of the heal's own work.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

CHUNK = 1 << 20


def _receive(port: int, n: int, ready) -> None:
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        conn, _ = server.accept()
        with conn:
            buffer, got = bytearray(CHUNK), 0
            view = memoryview(buffer)
            while got < n:
                got += conn.recv_into(view, min(CHUNK, n - got))
            conn.sendall(b"k")  # the sender's clock stops when every byte has arrived


def _send(port: int, n: int, connected, start, times) -> None:
    payload = b"\1" * n  # written, so resident: a zero-filled allocation would fault its pages in during the copy
    with socket.create_connection(("127.0.0.1", port)) as conn:
        connected.put(None)
        start.wait()
        started = time.perf_counter()
        conn.sendall(payload)
        conn.recv(1)
        times.put(time.perf_counter() - started)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_bytes_per_s(n: int, repeats: int = 3, connections: int = 1) -> float:
    """The best of ``repeats`` copies of ``n`` bytes, split evenly over ``connections`` connections that copy
    at once, in bytes per second: ``n`` over the slowest connection's time."""
    ctx, best = mp.get_context("fork"), 0.0
    shares = [n // connections + (i < n % connections) for i in range(connections)]
    for _ in range(repeats):
        connected, start, times, processes = ctx.Queue(), ctx.Event(), ctx.Queue(), []
        for share in shares:
            port, ready = _free_port(), ctx.Event()
            processes.append(ctx.Process(target=_receive, args=(port, share, ready)))
            processes[-1].start()
            ready.wait()
            processes.append(ctx.Process(target=_send, args=(port, share, connected, start, times)))
            processes[-1].start()
        for _ in shares:
            connected.get()
        start.set()
        best = max(best, n / max(times.get() for _ in shares))
        for process in processes:
            process.join()
    return best


if __name__ == "__main__":
    for size in (1 << 20, 25_000_000, 100_000_000):
        print(f"{size} bytes: {loopback_bytes_per_s(size) / 1e6:.0f} MB/s")
    print(f"5 MB over 4 connections at once: {loopback_bytes_per_s(5_000_000, connections=4) / 1e6:.0f} MB/s")
