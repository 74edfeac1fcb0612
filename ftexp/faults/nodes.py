"""How the tasks of a multi-node job meet, and how a node is taken away and brought back: files.

Every task of a Slurm job sees the side's directory (submitit needs a shared filesystem anyway), so
the tasks rendezvous there instead of over a network port of their own::

    <side>/cluster/
      head.json             task 0 (the head): its Ray GCS address, or the baseline's TCPStore address
      node<i>.down          a planned node fault: take node i away now (written by the rank that sets it off)
      node<i>.up            bring node i back (written by the driver, ``restore_node_at_end``)
      node<i>.state.json    node i's supervisor: {"state": "down"|"up", "down_at": ..., "up_at": ...} (epoch s)
      engines<i>.json       the baseline's rollout node i: its engines and their URLs (the head's router fronts them)
      task<i>.failed        task i failed (the baseline's head stops waiting for it)
      done                  task 0 is finished: every other task stops its node and returns

A request file is consumed (removed) by the node's supervisor when it acts on it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ftexp.atomic_files import write_text_atomically


class NodeFiles:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _write(self, name: str, payload: dict) -> None:
        write_text_atomically(self.root / name, json.dumps(payload))

    def _read(self, name: str) -> dict | None:
        try:
            return json.loads((self.root / name).read_text())
        except (OSError, ValueError):
            return None

    # ---- the head's address ---------------------------------------------------------------------
    def publish(self, name: str, payload: dict) -> None:
        self._write(f"{name}.json", payload)

    def wait_for(self, name: str, timeout_s: float, abandon=lambda: False) -> dict | None:
        """The payload ``name`` once published; None after ``timeout_s`` or when ``abandon()`` says so."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not abandon():
            payload = self._read(f"{name}.json")
            if payload is not None:
                return payload
            time.sleep(0.2)
        return None

    # ---- node down / up ---------------------------------------------------------------------------
    def request_down(self, node: int, why: str, how: str = "ray") -> None:
        self._write(f"node{node}.down", {"why": why, "how": how, "at": time.time()})

    def request_up(self, node: int) -> None:
        self._write(f"node{node}.up", {"at": time.time()})

    def take_request(self, node: int, kind: str) -> dict | None:
        """Consume a pending ``down``/``up`` request for ``node``."""
        payload = self._read(f"node{node}.{kind}")
        if payload is not None:
            (self.root / f"node{node}.{kind}").unlink(missing_ok=True)
        return payload

    def write_state(self, node: int, state: str, **times: float) -> None:
        previous = self.read_state(node) or {}
        self._write(f"node{node}.state.json", {**previous, **times, "state": state})

    def read_state(self, node: int) -> dict | None:
        return self._read(f"node{node}.state.json")

    # ---- the end of the job -----------------------------------------------------------------------
    def mark_failed(self, task: int, why: str) -> None:
        self._write(f"task{task}.failed", {"why": why})

    def failed_tasks(self) -> dict[int, str]:
        out = {}
        for path in self.root.glob("task*.failed"):
            payload = self._read(path.name) or {}
            out[int(path.name[4:-7])] = payload.get("why", "?")
        return out

    def finish(self) -> None:
        self._write("done", {"at": time.time()})

    def finished(self) -> bool:
        return (self.root / "done").exists()
