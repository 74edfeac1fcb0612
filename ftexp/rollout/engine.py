"""Rollout engines as Ray actors: each one our CPU sglang-protocol server, in a process of its own.

`RolloutEngine` is an engine's Ray actor: its address and supervisor. The server runs in a process
that the node's fork server (``ftexp.forkserver``) forks for the actor, with torch, transformers,
FastAPI and uvicorn already imported (``ftexp.rollout.engine_process``); the actor imports none of
them. It serves on the actor's Ray node's address (127.0.0.1 on one machine and on a loopback
cluster). The actor and its server's process die together: the process when the actor dies (the
fork server SIGKILLs it), the actor when the process dies (its keeper ends it), so Ray reports a dead
engine as a dead actor. ``simulate_crash`` stops the server while the actor and its process stay
reachable — how an engine fault looks to the trainer.

`EngineGroup` is the driver's side: start N engine actors, wait until each answers ``/health``,
hand out their URLs, stop them. An engine asks Ray for no CPU by default (``num_cpus=0``): rollout
and training alternate, so engines fit on a 2-core machine beside the training cells. In a
multi-node job each engine also asks for its rollout node's custom resource (``node_resources``),
which pins it there; it then serves on that node's address, so the router and the weight sender
on the head reach it across nodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Pipe
from typing import Any

import httpx
import ray

from ftexp.forkserver import ask, end_with, fork_child
from ftexp.http_client import short_keepalive_client
from ftexp.rollout.server_config import ServerConfig

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
ENGINE_TARGET = "ftexp.rollout.engine_process:serve"  # what the fork server runs in an engine's process
ENGINE_PRELOAD = ("ftexp.rollout.engine_process",)  # what a node's fork server imports for its engines


class RolloutEngine:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.url: str | None = None
        self._commands, theirs = Pipe()
        self._lock = threading.Lock()  # one command at a time
        self.child = fork_child(ENGINE_TARGET, [theirs.fileno()], dict(os.environ))
        theirs.close()
        end_with(self.child, "the rollout engine's process")

    def start(self, timeout_s: float = 60.0) -> str:
        """Load the model, serve it; returns ``http://ADDRESS:PORT`` (see the module docstring) once it listens."""
        host = ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK
        self.url = self._ask("start", self.config, host, timeout_s)
        return self.url

    def simulate_crash(self) -> None:
        """Stop serving (connections refused from now on); the actor itself stays reachable."""
        self._ask("stop")

    def shutdown(self) -> None:
        self._ask("stop")

    def pid(self) -> int:
        """The pid of the process that serves."""
        return self.child.pid

    def _ask(self, *command: Any) -> Any:
        with self._lock:
            return ask(self._commands, command)


def wait_healthy(url: str, timeout_s: float) -> None:
    """Until ``GET url/health`` answers 200 from this process."""
    deadline = time.monotonic() + timeout_s
    with short_keepalive_client(timeout=10.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"GET {url}/health: not healthy within {timeout_s:.0f} s")
            time.sleep(0.1)


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
        # No runtime_env: the engine's process sets the hub's offline switches itself, and an actor
        # with a runtime_env starts through an extra Python process (about 0.8 s more per engine on 2 cores).
        self.actors = [actor_class.options(num_cpus=self.config.num_cpus,
                                           **({"resources": {pinned[i]: 1}} if pinned else {})).remote(self.server)
                       for i in range(self.config.num_engines)]
        try:
            self.urls = ray.get([a.start.remote() for a in self.actors], timeout=self.config.start_timeout_s)
            for url in self.urls:
                wait_healthy(url, self.config.start_timeout_s)
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
