"""Warm spares (``trainer.spare_cells``): whole cells' worth of ranks, built before any failure needs them.

A spare is one replica's ranks, started on their node's rank host, belonging to no cell yet: their
processes are up, the engine is imported (megatron-core for the megatron engine), their own process world is
formed and the model and optimizer are allocated — everything a cold cell start waits for. A stopped
cell that starts again takes a spare instead of starting processes, so its heal is only configure +
transfer + load; the spare's ranks learn which cell they are from the heal's ``init``. The group
tops the pool up after each commit (so a replacement's start-up does not slow the heal that used its
predecessor); their host starts the replacements in the background.

A spare that died while waiting (its ``lifeline`` call returned) is dropped when a cell asks for one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray

log = logging.getLogger(__name__)


class SparePool:
    def __init__(self, size: int, make_spare: Callable[[int], list[Any]]):
        # make_spare(spare number) -> one replica's rank handles; the number keeps each spare's world apart
        self.size, self.make_spare = size, make_spare
        self.started = 0  # spares made so far (the last one's number)
        self._spares: list[tuple[list[Any], list[ray.ObjectRef]]] = []  # (ranks, their lifeline calls)

    def fill(self) -> None:
        """Start spares until the pool holds ``size`` (returns at once: the ranks build in the background)."""
        while len(self._spares) < self.size:
            self.started += 1
            ranks = self.make_spare(self.started)
            self._spares.append((ranks, [r.lifeline.remote() for r in ranks]))
            log.info("warm spare %d starting (%d rank(s))", self.started, len(ranks))

    def take(self) -> list[Any] | None:
        """The oldest spare whose every rank is still alive (None if none is left); dead ones are dropped."""
        while self._spares:
            ranks, lifelines = self._spares.pop(0)
            died, _ = ray.wait(lifelines, num_returns=1, timeout=0)
            if not died:
                return ranks
            log.warning("a warm spare died while waiting; dropped")
            _kill(ranks)
        return None

    def shutdown(self) -> None:
        for ranks, _ in self._spares:
            _kill(ranks)
        self._spares = []


def _kill(ranks: list[Any]) -> None:
    for rank in ranks:
        rank.kill()
