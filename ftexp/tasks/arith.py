"""``task=arith``: chains of small additions and subtractions, from reasoning-gym's ``chain_sum``.

A problem is ``terms`` numbers of ``digits`` digits joined by + and -, asked without spaces
(``4-1+7=``) so that it fits a small model's context; the answer is the integer, graded by
reasoning-gym's own ``score_answer`` and counted only when it scores exactly 1.0 (its partial credit
for an answer that merely contains the right digits is no answer). With 3 one-digit terms there are
4000 distinct problems: enough for disjoint splits whose problems share the carries and signs a
model must learn, so the eval accuracy measures arithmetic, not memory.
"""

from __future__ import annotations

import reasoning_gym

from ftexp.tasks.base import Problem
from ftexp.tasks.generated import POOL, GeneratedTask


class ArithTask(GeneratedTask):
    name = "arith"

    def __init__(self, dataset_seed: int, eval_size: int, terms: int, digits: int):
        super().__init__(dataset_seed, eval_size)
        self.dataset = reasoning_gym.create_dataset("chain_sum", min_terms=terms, max_terms=terms, min_digits=digits,
                                                    max_digits=digits, size=POOL, seed=dataset_seed)

    def item(self, index: int) -> Problem:
        entry = self.dataset[index]
        expression = entry["metadata"]["expression"].replace(" ", "")
        return Problem(prompt=f"{expression}=", answer=entry["answer"], solution=entry["answer"])

    def reward(self, problem: Problem, response: str) -> float:
        answer = response.strip()
        return 1.0 if answer and self.dataset.score_answer(answer, {"answer": problem.answer}) == 1.0 else 0.0
