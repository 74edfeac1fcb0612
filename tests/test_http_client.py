"""The HTTP client drops an idle connection long before uvicorn would close it, and reuses a fresh one."""

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from ftexp.http_client import KEEPALIVE_EXPIRY_S, short_keepalive_client


@pytest.fixture
def port_echo():
    """A uvicorn server (its default keep-alive) answering each request with the client's port."""
    app = FastAPI()

    @app.get("/port")
    def port(request: Request) -> int:
        return request.client.port

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", server.config.timeout_keep_alive
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_idle_connections_expire_before_the_server_closes_them(port_echo):
    url, server_keepalive_s = port_echo
    assert KEEPALIVE_EXPIRY_S <= server_keepalive_s / 2
    with short_keepalive_client(base_url=url, trust_env=False) as client:
        first = client.get("/port").json()
        assert client.get("/port").json() == first  # a busy connection is reused
        time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle past the client's expiry, within the server's keep-alive
        assert client.get("/port").json() != first
