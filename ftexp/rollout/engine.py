"""Rollout engines as Ray actors: each one our CPU sglang-protocol server (``server``) under uvicorn.

`RolloutEngine` owns one server: uvicorn runs in a thread of the engine's process on its Ray node's
address (127.0.0.1 on one machine and on a loopback cluster; outside Ray, 127.0.0.1), on a port the
OS picks (bound here first, so the URL is known before the first request). The class is a plain
one: `EngineGroup` makes Ray actors of it, and tests may run it in-process. ``simulate_crash``
stops the server while the actor stays reachable — how an engine fault looks to the trainer.

`EngineGroup` is the driver's side: start N engine actors, wait until each answers ``/health``,
hand out their URLs, stop them. An engine asks Ray for no CPU by default (``num_cpus=0``): rollout
and training alternate, so engines fit on a 2-core machine beside the training cells. In a
multi-node job each engine also asks for its rollout node's custom resource (``node_resources``),
which pins it there; it then serves on that node's address, so the router and the weight sender
on the head reach it across nodes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import ray
import torch
import uvicorn

from ftexp.rollout.client import EngineClient
from ftexp.rollout.server import CpuEngine, ServerConfig, build_app

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


class RolloutEngine:
    def __init__(self, config: ServerConfig) -> None:
        # One thread per engine: several engines and the training cells share few cores, and one
        # thread keeps each engine's numerics the same whatever machine it lands on.
        torch.set_num_threads(1)
        self.config = config
        self._server = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self, timeout_s: float = 60.0) -> str:
        """Load the model, serve it; returns ``http://ADDRESS:PORT`` (see the module docstring) once it listens."""
        if self._thread is not None and self._thread.is_alive():
            return self.url
        engine = CpuEngine(self.config)
        host = ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="rollout-server")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rollout server on {host}:{port} did not start")
            time.sleep(0.01)
        self._server, self._sock = server, sock
        self.url = f"http://{host}:{port}"
        log.info("rollout engine serving %s at %s", self.config.model_path, self.url)
        return self.url

    def simulate_crash(self) -> None:
        """Stop serving (connections refused from now on); the actor itself stays reachable."""
        self._stop_server()

    def shutdown(self) -> None:
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        self._server, self._sock = None, None

    def pid(self) -> int:
        return os.getpid()


@dataclass
class EngineGroupConfig:
    num_engines: int
    num_cpus: float = 0.0  # Ray CPUs per engine actor (see the module docstring)
    start_timeout_s: float = 300.0  # several engines starting on a loaded 2-core machine take minutes
    # [engine] -> the Ray custom resource of the node it must run on (empty: wherever Ray puts it)
    node_resources: tuple[str, ...] = ()


class EngineGroup:
    """N engine actors serving the same model; `urls` in engine order once `start` returned."""

    def __init__(self, server: ServerConfig, config: EngineGroupConfig) -> None:
        self.server = server
        self.config = config
        self.actors: list[ray.actor.ActorHandle] = []
        self.urls: list[str] = []

    def start(self) -> list[str]:
        actor_class = ray.remote(RolloutEngine)
        pinned = self.config.node_resources
        # No runtime_env: the server sets the hub's offline switches itself before it imports
        # transformers, and an actor with a runtime_env starts through an extra Python process
        # (about 0.8 s more per engine on 2 cores).
        self.actors = [actor_class.options(num_cpus=self.config.num_cpus,
                                           **({"resources": {pinned[i]: 1}} if pinned else {})).remote(self.server)
                       for i in range(self.config.num_engines)]
        try:
            self.urls = ray.get([a.start.remote() for a in self.actors], timeout=self.config.start_timeout_s)
            for url in self.urls:
                with EngineClient(url) as client:
                    client.wait_healthy(timeout_s=self.config.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def stop(self) -> None:
        """Shut every server down and end the actors (idempotent)."""
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=15)
            except Exception as exc:  # an engine that crashed or hangs is killed all the same
                log.warning("engine shutdown failed: %s", exc)
            ray.kill(actor, no_restart=True)
        self.actors, self.urls = [], []
