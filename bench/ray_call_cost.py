"""Benchmark: what Ray itself costs a round of train calls, with the training taken out.

Once a round, the target's driver calls every cell's ``train`` and waits for the answers: once a run of up to
``trainer.rollouts_per_call`` rollouts. The baseline has no such
round. This bench times one round per step alone, as when every rollout is a call of its own. Its actors
are shaped like a cell's rank: a threaded actor with ``num_cpus=0`` and concurrency groups of its own. Each
call spins on its CPU for one step's worth of time, as training would. Per step length it prints:

- the driver's CPU per round;
- each actor's CPU beyond the work it was given;
- the round's wall time over the step;
- ``ray_share``: Ray's CPU over the work's. That is the floor Ray sets under the target's CPU ratio at
  that step length.

``--compiled`` also runs the round as a Ray compiled graph (``experimental_compile``), the usual answer to
per-call overhead. Its driver can wait for the results by polling. It then spends CPU while the step runs,
and how much varies from run to run. On a machine with fewer cores than ranks plus one, that CPU comes out of
the ranks' time.

Usage:
    python bench/ray_call_cost.py                      # 2 cells; steps of 0, 20 and 40 ms
    python bench/ray_call_cost.py --cells 4 --compiled
"""

from __future__ import annotations

import argparse
import statistics
import time

import ftexp  # noqa: F401  before Ray: it sets the environment that keeps Ray's sockets on loopback
import ray
from ray.dag import InputNode, MultiOutputNode

from ftexp.trainer.local_ray import start_local_ray
from step_time import markdown_table


def spin(seconds: float) -> None:
    """Hold this thread on the CPU for ``seconds`` of its own CPU time, as a training step would."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


# Shaped like ftexp.trainer.cell_rank.RankHost: other concurrency groups make Ray run it as a threaded actor.
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"heartbeat": 1, "lifeline": 1})
class Rank:
    def train(self, rollout_id: int, step_s: float) -> tuple[str, dict[str, float]]:
        spin(step_s)
        return "normal", {"train/loss": 0.1}

    @ray.method(concurrency_group="heartbeat")  # served while a compiled graph holds the default group
    def cpu_s(self) -> float:
        return time.process_time()

    @ray.method(concurrency_group="heartbeat")
    def ping(self) -> bool:
        return True


def measure(label: str, ranks: list, call_round, step_s: float, rounds: int) -> dict:
    """``rounds`` rounds of ``call_round(rollout_id, step_s)``; the CPU and wall time each took beyond the work."""
    call_round(-1, step_s)  # warm-up
    ranks_before = ray.get([r.cpu_s.remote() for r in ranks])
    driver_before, wall_before = time.process_time(), time.perf_counter()
    for rollout_id in range(rounds):
        call_round(rollout_id, step_s)
    driver_s, wall_s = time.process_time() - driver_before, time.perf_counter() - wall_before
    ranks_after = ray.get([r.cpu_s.remote() for r in ranks])
    rank_extra_ms = statistics.mean(1000 * (after - before) / rounds - 1000 * step_s
                                    for before, after in zip(ranks_before, ranks_after))
    driver_ms = 1000 * driver_s / rounds
    return {"calls": label, "step_ms": round(1000 * step_s), "driver_cpu_ms": driver_ms,
            "rank_extra_cpu_ms": rank_extra_ms, "round_wall_ms": 1000 * wall_s / rounds,
            "ray_share": (driver_ms + len(ranks) * rank_extra_ms) / (len(ranks) * 1000 * step_s) if step_s else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--steps-ms", type=float, nargs="+", default=[0, 20, 40])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--compiled", action="store_true", help="also time the round as a Ray compiled graph")
    args = parser.parse_args()

    start_local_ray(num_cpus=max(2, args.cells))
    ranks = [Rank.remote() for _ in range(args.cells)]
    ray.get([r.ping.remote() for r in ranks])
    rows = [measure("actor calls", ranks, lambda i, s: ray.get([r.train.remote(i, s) for r in ranks]),
                    step_ms / 1000, args.rounds) for step_ms in args.steps_ms]
    if args.compiled:
        with InputNode() as inp:
            graph = MultiOutputNode([r.train.bind(inp[0], inp[1]) for r in ranks]).experimental_compile()
        rows += [measure("compiled graph", ranks, lambda i, s: ray.get(graph.execute(i, s)), step_ms / 1000,
                         args.rounds) for step_ms in args.steps_ms]
        graph.teardown()
    ray.shutdown()

    print(f"# Ray's cost per round of {args.cells} actor calls")
    intro = f"{args.rounds} rounds a row; milliseconds; `ray_share`: Ray's CPU over the work's."
    print("\n".join(markdown_table(intro, rows, list(rows[0]))))

if __name__ == "__main__":
    main()
