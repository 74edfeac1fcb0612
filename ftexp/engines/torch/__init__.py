"""The torch engine: the builtin tiny GPT in plain PyTorch, one rank per replica (fastest)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ftexp.config import ModeConfig, TrainerConfig
from ftexp.errors import InputError

if TYPE_CHECKING:
    from ftexp.engines.base import Replica


class TorchEngine:
    name = "torch"
    witness_by_default = True
    needs_process_world = False
    preload_modules = ("ftexp.engines.torch.replica",)

    def ranks_per_replica(self, mode: ModeConfig) -> int:
        return 1

    def model_features(self, mode: ModeConfig) -> frozenset[str]:
        return frozenset()  # TinyGPT: dense, no QK norm

    def validate(self, mode: ModeConfig, trainer: TrainerConfig) -> None:
        if mode.hf_checkpoint:
            raise InputError("mode.hf_checkpoint: the torch engine trains its own TinyGPT; a Qwen3 checkpoint "
                             "needs trainer=megatron")
        if mode.rollout_num_engines:
            raise InputError(f"mode {mode.name} generates with live rollout engines, which run HF-layout models: "
                             f"the torch engine's TinyGPT has none (use trainer=megatron)")
        if mode.ranks_per_cell != 1:
            raise InputError(f"mode {mode.name} splits a replica over {mode.ranks_per_cell} ranks "
                             f"(tp={mode.tp} pp={mode.pp} cp={mode.cp}); the torch engine runs one rank per replica")

    def build_replica(self, trainer: TrainerConfig, mode: ModeConfig, *, seed: int, deterministic: bool) -> Replica:
        from ftexp.engines.torch.replica import TorchReplica  # torch's model code, only in the ranks

        return TorchReplica(trainer, seed=seed)

    def vocab_size(self, mode: ModeConfig) -> int:
        raise InputError("the torch engine has no live rollout engines (validate refuses such a mode)")

    def write_hf_model_dir(self, mode: ModeConfig, directory: Path) -> None:
        raise InputError("the torch engine has no live rollout engines (validate refuses such a mode)")


ENGINE = TorchEngine()
