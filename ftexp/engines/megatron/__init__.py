"""The megatron-core engine: GPT models with TP/SP/PP/CP/EP, runnable on CPU with gloo (see cpu_compat).

A replica is ``tp·pp·cp`` ranks with their own torch.distributed world. Importing this package
does not import megatron-core: the descriptor below only reads the presets (or an HF checkpoint's
``config.json``, ``hf_import``), so the config can be validated without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ftexp.config import ModeConfig, TrainerConfig
from ftexp.engines.megatron.presets import GPTPreset
from ftexp.errors import InputError

if TYPE_CHECKING:
    from ftexp.engines.base import Replica


def model_preset(mode: ModeConfig) -> GPTPreset:
    """The mode's model (``hf_import.model_preset``), imported only when asked for: that module imports torch."""
    from ftexp.engines.megatron.hf_import import model_preset

    return model_preset(mode)


class MegatronEngine:
    name = "megatron"
    witness_by_default = False  # no witness embeddings in the megatron model yet
    needs_process_world = True
    preload_modules = ("ftexp.engines.megatron.replica", "ftexp.engines.megatron.model")

    def ranks_per_replica(self, mode: ModeConfig) -> int:
        return mode.ranks_per_cell

    def model_features(self, mode: ModeConfig) -> frozenset[str]:
        """Every model is built with QK layernorm (``model.transformer_config``); those with experts are MoE."""
        return frozenset({"qk_norm"} | ({"moe"} if model_preset(mode).num_experts else set()))

    def validate(self, mode: ModeConfig, trainer: TrainerConfig) -> None:
        """What megatron-core would assert on deep inside every rank, said once up front."""
        preset = model_preset(mode)
        if preset.num_attention_heads % mode.tp or preset.num_query_groups % mode.tp or preset.vocab_size % mode.tp:
            raise InputError(f"mode {mode.name}: tp={mode.tp} must divide the model's {preset.num_attention_heads} heads, "
                             f"{preset.num_query_groups} query groups and {preset.vocab_size}-token vocabulary")
        if mode.ep > 1 and (not preset.num_experts or preset.num_experts % mode.ep):
            raise InputError(f"mode {mode.name}: ep={mode.ep} must divide the model's experts ({preset.num_experts or 0})")
        if mode.ep > 1 and mode.ranks_per_cell % (mode.ep * mode.etp * mode.pp):
            raise InputError(f"mode {mode.name}: ep·etp·pp = {mode.ep * mode.etp * mode.pp} must divide the "
                             f"{mode.ranks_per_cell} ranks of a cell")
        if preset.num_experts and mode.tp > 1 and not mode.sequence_parallel:
            raise InputError(f"mode {mode.name}: megatron-core needs sequence_parallel=true for MoE with tp > 1")
        if mode.pp > preset.num_layers:
            raise InputError(f"mode {mode.name}: pp={mode.pp} exceeds the model's {preset.num_layers} layers")
        if trainer.enable_witness:  # explicitly on; unset means off for this engine
            raise InputError("the megatron engine has no witness parameters yet: set trainer.enable_witness=false")
        if trainer.megatron.micro_batch_size < 1:
            raise InputError("trainer.megatron.micro_batch_size must be >= 1")

    def build_replica(self, trainer: TrainerConfig, mode: ModeConfig, *, seed: int, deterministic: bool) -> Replica:
        from ftexp.engines.megatron.replica import MegatronReplica  # megatron-core, only in the ranks

        return MegatronReplica(trainer, mode, seed=seed, deterministic=deterministic)

    def vocab_size(self, mode: ModeConfig) -> int:
        return model_preset(mode).vocab_size

    def write_hf_model_dir(self, mode: ModeConfig, directory: Path) -> None:
        from ftexp.engines.megatron.hf_export import write_hf_model_dir  # torch: not for config validation

        write_hf_model_dir(mode.model_preset, directory)


ENGINE = MegatronEngine()
