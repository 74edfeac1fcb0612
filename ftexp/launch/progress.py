"""Progress of a training job as seen from the pipeline: committed rollouts of one side.

The job appends one line per committed rollout to ``<side_dir>/perf.jsonl``; the pipeline polls
it while waiting. On a terminal this is a rich progress bar; otherwise one log line per rollout.
"""

from __future__ import annotations

import json
import logging
import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("ftexp")


class SideProgress:
    def __init__(self, where: str, spec) -> None:
        self.where = where
        self.perf = spec.side_dir.perf
        self.total = len(spec.rollout_ids())
        self.seen = 0
        self._bar: Progress | None = None

    def __enter__(self) -> "SideProgress":
        if sys.stderr.isatty():
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"{self.where}: rollouts", total=self.total)
        return self

    def update(self) -> None:
        lines = self.perf.read_text().splitlines() if self.perf.is_file() else []
        for line in lines[self.seen:]:
            rollout_id = json.loads(line)["step"]
            self.seen += 1
            if self._bar is not None:
                self._bar.update(self._task, completed=self.seen, description=f"{self.where}: rollout {rollout_id}")
            else:
                log.info("%s: rollout %d committed (%d/%d)", self.where, rollout_id, self.seen, self.total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
