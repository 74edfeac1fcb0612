"""The control server: a FastAPI app over a ``CellRegistry``, served by uvicorn on a daemon thread.

Endpoints::

    GET   /api/v1/health                    200 {"status": "ok"}
    GET   /api/v1/cells                     200 CellList, registration order | 500
    GET   /api/v1/cells/{name}              200 Cell | 404 | 500
    PATCH /api/v1/cells/{name}              200 Cell after the change | 404 | 500
    POST  /api/v1/cells/{name}/inject-fault 200 {"status": "ok"} | 404 | 400 | 500

Errors the server raises use the Kubernetes ``Status`` body; malformed requests get FastAPI's 422.
Handles are called without locks, concurrently with training: a handle must
tolerate that.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ftexp.control.api_models import (
    Cell,
    CellLabels,
    CellList,
    CellMetadata,
    CellSpec,
    CellStatus,
    OkResponse,
    InjectFaultRequest,
    PatchCellRequest,
    Status,
)
from ftexp.control.registry import CellHandle, CellRegistry, NotSupported, cell_name
from ftexp.errors import InputError

log = logging.getLogger(__name__)
_STARTUP_TIMEOUT_S = 10.0


def _status_response(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse(Status(code=code, reason=reason, message=message).model_dump(), status_code=code)


def _not_found(name: str) -> JSONResponse:
    return _status_response(404, "NotFound", f"Cell '{name}' not found")


def _to_cell(handle: CellHandle) -> Cell:
    snapshot = handle.status()
    labels = CellLabels(cell_type=handle.cell_type, cell_index=str(handle.index))
    return Cell(metadata=CellMetadata(name=cell_name(handle), labels=labels),
                spec=CellSpec(suspend=snapshot.suspended),
                status=CellStatus(phase=snapshot.phase, conditions=snapshot.conditions))


def create_app(registry: CellRegistry) -> FastAPI:
    app = FastAPI(title="ftexp control server")
    # Error responses bypass response_model, so the success models are declared per route.
    cell_route = {"response_model": Cell, "responses": {404: {"model": Status}, 500: {"model": Status}}}

    @app.get("/api/v1/health", response_model=OkResponse)
    def health() -> OkResponse:
        return OkResponse()

    # A handle whose status() raises gets a Status 500 here: left to the framework, the error
    # would also drop the keep-alive connection under the client's next request.
    @app.get("/api/v1/cells", response_model=CellList, responses={500: {"model": Status}})
    def list_cells():
        try:
            return CellList(items=[_to_cell(h) for h in registry.handles()])
        except Exception:
            log.exception("listing cells failed")
            return _status_response(500, "InternalError", "Failed to list cells")

    @app.get("/api/v1/cells/{name}", **cell_route)
    def get_cell(name: str):
        handle = registry.get(name)
        if handle is None:
            return _not_found(name)
        try:
            return _to_cell(handle)
        except Exception:
            log.exception("reading cell %s failed", name)
            return _status_response(500, "InternalError", f"Failed to read cell '{name}'")

    @app.patch("/api/v1/cells/{name}", **cell_route)
    def patch_cell(name: str, body: PatchCellRequest):
        handle = registry.get(name)
        if handle is None:
            return _not_found(name)
        suspend = body.spec.suspend if body.spec is not None else None
        try:
            if suspend is True:
                handle.suspend()
            elif suspend is False:
                handle.resume()
        except Exception:
            log.exception("patching cell %s (suspend=%s) failed", name, suspend)
            return _status_response(500, "InternalError", f"Failed to patch cell '{name}'")
        return _to_cell(handle)

    @app.post("/api/v1/cells/{name}/inject-fault", response_model=OkResponse,
              responses={400: {"model": Status}, 404: {"model": Status}, 500: {"model": Status}})
    def inject_fault(name: str, body: InjectFaultRequest):
        handle = registry.get(name)
        if handle is None:
            return _not_found(name)
        try:
            handle.inject_fault(body.mode, body.sub_index)
        except NotSupported as exc:
            return _status_response(400, "BadRequest", str(exc))
        except Exception:
            log.exception("injecting %s into cell %s[%d] failed", body.mode, name, body.sub_index)
            return _status_response(500, "InternalError", f"Failed to inject fault into cell '{name}'")
        log.warning("injected %s into cell %s[%d]", body.mode, name, body.sub_index)
        return OkResponse()

    return app


class ControlServer:
    """Serves ``create_app(registry)`` on ``host:port`` from a daemon thread."""

    def __init__(self, registry: CellRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        self._app = create_app(registry)
        self._host, self._requested_port = host, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://{self._host}:{self.port}"

    def start(self) -> int:
        """Bind, start serving, and return the bound port (port 0 picks a free one)."""
        assert self._server is None, "server already started"
        # Binding here, not inside uvicorn, turns a busy port into a clear error in the caller's
        # thread and tells us which port 0 picked.
        # An explicit IPPROTO_TCP: asyncio only sets TCP_NODELAY on sockets that declare it, and
        # without it Nagle holds each response body back ~40 ms behind its headers.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # allow a restart over TIME_WAIT
        try:
            sock.bind((self._host, self._requested_port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"port {self._requested_port} on {self._host} is busy") from None
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"control-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"control server on {self._host}:{self.port} failed to start")
            time.sleep(0.01)
        log.info("control server listening on %s", self.base_url)
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
