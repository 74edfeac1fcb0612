"""The engine behind a rank: which replica class holds its model, and how many ranks a replica has.

``torch`` — :class:`ftexp.trainer.replica.Replica`, the builtin tiny GPT on one rank.
``megatron`` — :class:`ftexp.engines.megatron.replica.MegatronReplica`, a megatron-core GPT
split over ``tp·pp·cp`` ranks; it needs ``torch.distributed`` initialised over the ranks it
shares data parallelism with before it is built (the baseline's world, or one cell's world).
"""

from __future__ import annotations

from ftexp.config import Engine


def ranks_per_replica(spec) -> int:
    return spec.mode.ranks_per_cell if spec.trainer.engine == Engine.megatron else 1


def needs_process_world(spec) -> bool:
    """Whether a replica's ranks talk among themselves (a torch.distributed world per cell)."""
    return spec.trainer.engine == Engine.megatron


def build_replica(spec):
    if spec.trainer.engine == Engine.megatron:
        from ftexp.engines.megatron.replica import MegatronReplica, layout_of

        return MegatronReplica(spec.trainer, layout_of(spec.mode), spec.mode.model_preset, seed=spec.seed,
                               deterministic=spec.deterministic)
    from ftexp.trainer.replica import Replica

    return Replica(spec.trainer, seed=spec.seed)
