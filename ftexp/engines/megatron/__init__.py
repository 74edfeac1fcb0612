"""megatron-core engine: tiny GPT models with TP/PP/CP/EP, runnable on CPU with gloo (see cpu_compat)."""
