"""Model engines behind a cell: the builtin torch GPT (``ftexp.trainer``) and megatron-core."""
