"""The rollout models' tokenizer: one token per ASCII character, token id = the character's code.

The policies have a vocabulary of 128, so every ASCII character is its own token and nothing needs
training or downloading. It is built with the ``tokenizers`` library and saved as ``tokenizer.json``
plus ``tokenizer_config.json``: what ``transformers.AutoTokenizer`` and the sglang router load from a
local directory, offline. A character outside ASCII becomes the ASCII substitute character (0x1A).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 128
UNKNOWN = "\x1a"  # ASCII SUB, the control character meant for "a character that cannot be represented"


def build_ascii_tokenizer() -> Tokenizer:
    vocab = {chr(code): code for code in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    # Every character (newlines included) is a word of its own; decoding joins them back without spaces.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def write_ascii_tokenizer(directory: str | Path) -> Path:
    """Save the tokenizer into `directory` (created if needed); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_ascii_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 16,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
