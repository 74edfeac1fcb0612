"""``rollout.backend=sglang``: real sglang servers on GPUs, one per engine (cannot run on this CPU machine).

A thin launcher: `SglangServerSpec` says what one engine serves and on which GPUs; `command` is its
``python -m sglang.launch_server`` command line; `SglangServer` starts it (in its own process group,
hub offline, bound to 127.0.0.1) and waits for ``/health``. Everything after that — generation,
the weight-update group (NCCL there), checksums — goes through the same `EngineClient` as the CPU
engines. Deterministic inference (``--enable-deterministic-inference`` with the flashinfer attention
backend) is on by default, as the reference's real-rollout runs use it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftexp.rollout.client import EngineClient
from ftexp.rollout.processes import OFFLINE_ENV, end_process_group


@dataclass(frozen=True)
class SglangServerSpec:
    model_path: str
    port: int
    base_gpu_id: int = 0
    tp_size: int = 1
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    mem_fraction_static: float | None = None
    random_seed: int = 0
    deterministic: bool = True
    extra_args: tuple[str, ...] = field(default=())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def command(spec: SglangServerSpec) -> list[str]:
    """The ``sglang.launch_server`` command line of one engine."""
    args = [sys.executable, "-m", "sglang.launch_server",
            "--model-path", spec.model_path,
            "--host", spec.host, "--port", str(spec.port),
            "--base-gpu-id", str(spec.base_gpu_id), "--tp-size", str(spec.tp_size),
            "--random-seed", str(spec.random_seed)]
    if spec.tokenizer_path is not None:
        args += ["--tokenizer-path", spec.tokenizer_path]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.deterministic:
        args += ["--enable-deterministic-inference", "--attention-backend", "flashinfer"]
    return args + list(spec.extra_args)


class SglangServer:
    def __init__(self, spec: SglangServerSpec, log_path: str | Path | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> str:
        """Launch the server; returns its URL once ``/health`` answers 200."""
        output = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command(self.spec), env={**os.environ, **OFFLINE_ENV},
                                            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        finally:
            if output is not subprocess.DEVNULL:
                output.close()
        deadline = time.monotonic() + timeout_s
        with EngineClient(self.spec.url) as client:
            while not client.is_healthy():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    code = self.process.poll()
                    self.stop()
                    state = f"exited with code {code}" if code is not None else f"not healthy after {timeout_s:.0f} s"
                    raise RuntimeError(f"sglang server for {self.spec.url} {state}"
                                       + (f" (log: {self.log_path})" if self.log_path else ""))
                time.sleep(1.0)
        return self.spec.url

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server and its scheduler/detokenizer processes (its process group); idempotent."""
        if self.process is None:
            return
        end_process_group(self.process, timeout_s)
        self.process = None
