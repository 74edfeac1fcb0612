"""A rollout engine's HTTP server, and the process it runs in when its Ray actor has it forked.

`EngineServer` is one engine: our CPU server (``server``) under uvicorn, in a thread of the process
that starts it, on the address it is given, on a port the OS picks (bound here first, so the URL is
known before the first request). Tests run it in their own process.

`serve` is the main of an engine's process, forked by its node's fork server (``ftexp.forkserver``)
for the engine's actor (``ftexp.rollout.engine``), on one pipe from that actor: ``("start", config,
host)`` answers the URL once the server listens, ``("stop",)`` stops serving (the process stays, as
after an engine fault); the pipe's end (the actor died) ends the process. Importing this module
imports everything an engine needs before it builds its model — torch, FastAPI, uvicorn, and
transformers with the tokenizer and the model classes the engines build (Qwen3, dense and MoE) — so
a fork server that preloads it forks engines ready to build; an engine's actor that imported them
itself paid ~8 CPU-seconds per engine on this project's 2-core machine.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from multiprocessing.connection import Connection

from ftexp.rollout.processes import stay_offline

stay_offline()  # nothing an engine loads comes from the Hugging Face hub

import torch  # noqa: E402
import transformers.models.qwen3.modeling_qwen3  # noqa: E402, F401  (the engines' model classes, imported
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: E402, F401  once by a preloading fork server)
import transformers.tokenization_utils_fast  # noqa: E402, F401
import uvicorn  # noqa: E402

from ftexp.forkserver import answer  # noqa: E402
from ftexp.rollout.server import CpuEngine, build_app  # noqa: E402
from ftexp.rollout.server_config import ServerConfig  # noqa: E402

log = logging.getLogger(__name__)
WHERE = "the rollout engine's process"  # where a command ran, in the note an error carries back


class EngineServer:
    """One engine serving HTTP from a thread of this process; ``stop`` ends serving, ``start`` serves again."""

    def __init__(self, config: ServerConfig) -> None:
        # One thread per engine: several engines and the training cells share few cores, and one
        # thread keeps each engine's numerics the same whatever machine it lands on.
        torch.set_num_threads(1)
        self.config = config
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self, host: str = "127.0.0.1", timeout_s: float = 60.0) -> str:
        """Load the model, serve it on ``host``; returns ``http://HOST:PORT`` once it listens."""
        if self._thread is not None and self._thread.is_alive():
            return self.url
        engine = CpuEngine(self.config)
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

    def stop(self) -> None:
        """Stop serving (connections refused from now on)."""
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        self._server, self._sock = None, None


def serve(connections: list[Connection]) -> None:
    """The engine process's main (see the module docstring); returns when its actor is gone."""
    stay_offline()  # the asker's environment replaced the fork server's
    (commands,) = connections
    server: EngineServer | None = None
    while True:
        try:
            command, *args = commands.recv()
        except EOFError:
            return
        if command == "start":
            config, host, timeout_s = args
            server = server or EngineServer(config)
            answer(commands, lambda: server.start(host, timeout_s), WHERE)
        elif command == "stop":
            answer(commands, lambda: server.stop() if server is not None else None, WHERE)
        else:
            answer(commands, lambda: _unknown(command), WHERE)


def _unknown(command: str) -> None:
    raise ValueError(f"unknown engine command {command!r}")
