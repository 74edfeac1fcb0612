"""Tasks whose problems a reasoning-gym generator makes on demand, by index, from a dataset seed.

The generator is a virtual dataset of ``POOL`` problems; a split's problems are the indices whose
prompt hashes into it (``ftexp.tasks.splits``). Rollout and warm-up batches draw random indices from
a seeded stream until enough fall into their split; the eval set is the first ``eval_size`` distinct
eval prompts in index order, so it depends on the dataset seed alone.
"""

from __future__ import annotations

from ftexp.errors import InputError
from ftexp.tasks.base import Problem, metric_key
from ftexp.tasks.splits import EVAL, TRAIN, WARMUP, rng_for, split_of

POOL = 1_000_000
# Give up on a split that a generator (nearly) never reaches rather than loop forever.
MAX_DRAWS_PER_PROBLEM = 1000


class GeneratedTask:
    """Problems from ``item(index)``; subclasses say how a generated entry becomes a ``Problem``."""

    name = ""

    def __init__(self, dataset_seed: int, eval_size: int):
        self.dataset_seed, self.eval_size = dataset_seed, eval_size
        self._split: dict[str, str] = {}
        self._eval: list[Problem] | None = None

    @property
    def metric_key(self) -> str:
        return metric_key(self.name)

    def item(self, index: int) -> Problem:
        raise NotImplementedError

    def split(self, problem: Problem) -> str:
        if problem.prompt not in self._split:
            self._split[problem.prompt] = split_of(problem.prompt, self.dataset_seed)
        return self._split[problem.prompt]

    def _draw(self, split: str, count: int, *stream: object) -> list[Problem]:
        rng, out = rng_for(self.name, self.dataset_seed, *stream), []
        for _ in range(count * MAX_DRAWS_PER_PROBLEM):
            if len(out) == count:
                return out
            problem = self.item(rng.randrange(POOL))
            if self.split(problem) == split:
                out.append(problem)
        raise InputError(f"task {self.name}: its generator gave fewer than {count} {split} problems")

    def train_problems(self, rollout_id: int, count: int, seed: int) -> list[Problem]:
        return self._draw(TRAIN, count, "train", seed, rollout_id)

    def warmup_problems(self, step: int, count: int, seed: int) -> list[Problem]:
        return self._draw(WARMUP, count, "warmup", seed, step)

    def eval_problems(self) -> list[Problem]:
        if self._eval is None:
            seen: dict[str, Problem] = {}
            for index in range(self.eval_size * MAX_DRAWS_PER_PROBLEM):
                if len(seen) == self.eval_size:
                    break
                problem = self.item(index)
                if self.split(problem) == EVAL:
                    seen.setdefault(problem.prompt, problem)
            if len(seen) < self.eval_size:
                raise InputError(f"task {self.name}: only {len(seen)} distinct eval problems exist "
                                 f"(task.eval_size={self.eval_size})")
            self._eval = list(seen.values())
        return self._eval
