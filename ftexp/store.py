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
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        # The store's server owns the listening fd from here on and closes it when it goes away. The socket
        # object must not close it too: a second close, after the number was reused, would close a stranger's
        # file (an event log being opened on another thread failed with EBADF).
        sock.detach()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Drop this handle on the store; its server closes the listening fd once the last handle is gone."""
        self.store = None
