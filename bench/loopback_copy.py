"""The yardstick for a heal's transfer rate: a raw copy of the same bytes over a loopback TCP socket.

One process sends ``n`` bytes to another over 127.0.0.1 with plain ``sendall``/``recv_into``: no
serialization, no process group, no framing. A heal that moves its state at half this rate or better
is within what the machine's loopback allows (the issue's target: heal bytes/s ÷ this >= 0.5).
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


def loopback_bytes_per_s(n: int, repeats: int = 3) -> float:
    """The best of ``repeats`` copies of ``n`` bytes from this process to another, in bytes per second."""
    payload, best = bytes(n), 0.0
    for _ in range(repeats):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ready = mp.Event()
        receiver = mp.get_context("fork").Process(target=_receive, args=(port, n, ready))
        receiver.start()
        ready.wait()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            started = time.perf_counter()
            conn.sendall(payload)
            conn.recv(1)
            best = max(best, n / (time.perf_counter() - started))
        receiver.join()
    return best


if __name__ == "__main__":
    for size in (1 << 20, 25_000_000, 100_000_000):
        print(f"{size} bytes: {loopback_bytes_per_s(size) / 1e6:.0f} MB/s")
