"""The real sglang router (the ``sglang-router`` wheel) in front of a side's rollout engines.

`Router.start` launches ``python -m sglang_router.launch_router`` as a subprocess on a free
127.0.0.1 port and returns its URL once it has registered every engine (``/readiness``). Nothing of
it may leave loopback: it binds 127.0.0.1 (its default is every interface), its Prometheus exporter
too, and it is given the tokenizer's local directory with the Hugging Face hub's offline switches
set, since it otherwise downloads a tokenizer for the engines' ``model_path``. Requests go
round-robin over the engines: with seeded sampling, which engine serves a prompt does not change the
tokens, and round-robin spreads them evenly. `stop` ends the router's process group by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ftexp.rollout.processes import OFFLINE_ENV, end_process_group, free_port


# free_port's pick is free when made, but the router binds it a second or two later: in between, any
# process on the host may get it (an outgoing connection's port, another free_port), so a start that
# fails on a taken port is retried on new ones.
PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    """The router exited at start because one of its ports was no longer free."""


class Router:
    def __init__(self, policy: str = "round_robin", log_path: str | Path | None = None,
                 startup_timeout_s: float = 60.0, extra_args: tuple[str, ...] = ()) -> None:
        self.policy = policy
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.start_seconds: float | None = None

    def command(self, worker_urls: list[str], tokenizer_path: str | Path, port: int, metrics_port: int) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *worker_urls,
                "--policy", self.policy,
                "--tokenizer-path", str(Path(tokenizer_path).resolve()),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--shutdown-grace-period-secs", "1",
                "--log-level", "warn", *self.extra_args]

    def start(self, worker_urls: list[str], tokenizer_path: str | Path) -> str:
        """Launch the router over `worker_urls`; returns its URL once every worker is registered and healthy."""
        if self.process is not None:
            raise RuntimeError(f"router already running at {self.url}")
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        if not (Path(tokenizer_path) / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {tokenizer_path}: the router would fetch one from the hub")
        started = time.monotonic()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._launch(worker_urls, tokenizer_path)
                break
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise RuntimeError(f"sglang router: its ports were taken at start {PORT_ATTEMPTS} times "
                                       f"(log: {self.log_path})") from None
        self.start_seconds = time.monotonic() - started
        return self.url

    def _launch(self, worker_urls: list[str], tokenizer_path: str | Path) -> None:
        port = free_port()
        command = self.command(worker_urls, tokenizer_path, port, free_port())
        log_offset = self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0
        output = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command, env={**os.environ, **OFFLINE_ENV}, stdin=subprocess.DEVNULL,
                                            stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if output is not subprocess.DEVNULL:
                output.close()
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready(len(worker_urls), log_offset)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, workers: int, log_offset: int) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while True:
                if self.process.poll() is not None:
                    if self._port_taken(log_offset):
                        raise _PortTaken
                    where = f" (log: {self.log_path})" if self.log_path else ""
                    raise RuntimeError(f"sglang router exited with code {self.process.returncode} at start{where}")
                try:
                    ready = http.get(f"{self.url}/readiness").json()
                    if ready.get("healthy_workers") == workers:
                        return
                    last = (f"{ready['healthy_workers']} of {workers} workers healthy" if "healthy_workers" in ready
                            else ready.get("reason", str(ready)))
                except (httpx.HTTPError, ValueError) as exc:
                    last = type(exc).__name__
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sglang router at {self.url} not ready within {self.startup_timeout_s:.0f} s "
                                       f"({last})")
                time.sleep(0.1)

    def _port_taken(self, log_offset: int) -> bool:
        """Whether this launch's log output says a port was in use."""
        if self.log_path is None or not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as log:
            log.seek(log_offset)
            return b"Address already in use" in log.read()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the router and anything it started (its own process group); idempotent."""
        if self.process is None:
            return
        end_process_group(self.process, timeout_s)
        self.process, self.url = None, None
