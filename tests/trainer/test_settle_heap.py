"""A rank's start-up heap is kept out of the garbage collector's sight, so no full collection scans it mid-training."""

import json
import subprocess
import sys

PROBE = """
import gc, json, torch
from ftexp.trainer.step import settle_heap
tracked = len(gc.get_objects())
settle_heap()
print(json.dumps({"tracked": tracked, "frozen": gc.get_freeze_count(), "left": len(gc.get_objects())}))
"""


def test_a_settled_heap_leaves_the_collector_only_what_comes_after():
    # A process of its own, like a rank: freezing the test runner's heap would outlive this test.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    counts = json.loads(out.splitlines()[-1])
    assert counts["tracked"] > 50_000  # torch's import alone
    assert counts["frozen"] >= counts["tracked"]
    assert counts["left"] < counts["tracked"] // 100
