"""ftexp: fault-tolerance experiments for RL training (plain DP baseline vs fault-tolerant cells)."""

import os

# Ray reads this when it is first imported: off, a single-node Ray advertises (and connects over)
# 127.0.0.1 instead of the host's external address, so every socket of a run stays on loopback.
# Every ftexp process imports this package before Ray, and Ray workers inherit the environment.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
