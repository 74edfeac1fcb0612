"""A TCPStore master that listens on 127.0.0.1 only (or on one given address: a multi-node job's head).

torch's TCPStore server binds every interface whatever host it is given; handing it a socket we
bound to loopback ourselves (``master_listen_fd``) keeps the rendezvous off the network.
"""

from __future__ import annotations

import socket

import torch.distributed as dist


class LoopbackStore:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=self._sock.fileno())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        # The store server owns the listening socket from now on and closes it when it goes away
        # (the last member's handle on it dropped); closing it here too would close a stranger's fd.
        self.store = None
        self._sock.detach()
