"""Environment variables set for a block: children started inside inherit them, and afterwards each is as it was."""

import os
import subprocess
import sys

import pytest

from ftexp.environment import environment_set

UNSET, KEPT = "FTEXP_TEST_UNSET_VARIABLE", "FTEXP_TEST_KEPT_VARIABLE"


def _child_sees(name: str) -> str:
    return subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({name!r}, '-'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_child_started_inside_inherits_and_the_variables_are_restored_after(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv(KEPT, "before")
    with environment_set({UNSET: "inside", KEPT: "inside"}):
        assert _child_sees(UNSET) == "inside" and _child_sees(KEPT) == "inside"
    assert UNSET not in os.environ and os.environ[KEPT] == "before"
    assert _child_sees(UNSET) == "-"


def test_the_variables_are_restored_when_the_block_raises(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv(KEPT, "before")
    with pytest.raises(RuntimeError):
        with environment_set({UNSET: "inside", KEPT: "inside"}):
            raise RuntimeError("the start failed")
    assert UNSET not in os.environ and os.environ[KEPT] == "before"
