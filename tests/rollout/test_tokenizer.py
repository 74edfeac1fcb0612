"""The ASCII tokenizer: one token per character, id = code; loads offline through transformers."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from ftexp.rollout.tokenizer import UNKNOWN, build_ascii_tokenizer, write_ascii_tokenizer


def test_round_trip_and_ids():
    tokenizer = build_ascii_tokenizer()
    ids = tokenizer.encode("12+7=19").ids
    assert ids == [ord(c) for c in "12+7=19"] == [49, 50, 43, 55, 61, 49, 57]
    assert tokenizer.decode(ids) == "12+7=19"
    assert tokenizer.decode(tokenizer.encode("a b\n\tc").ids) == "a b\n\tc"  # whitespace is kept, not re-spaced
    assert tokenizer.encode("é").ids == [ord(UNKNOWN)]
    assert tokenizer.get_vocab_size() == 128


def test_saved_directory_loads_with_auto_tokenizer(tmp_path):
    write_ascii_tokenizer(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["tokenizer_class"]
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ids = loaded("12+7=19", add_special_tokens=False).input_ids
    assert ids == [49, 50, 43, 55, 61, 49, 57]
    assert loaded.decode(ids) == "12+7=19"
    assert loaded.decode([ord("x"), 10, ord("y")]) == "x\ny"
