"""ftexp: fault-tolerance experiments for RL training (plain DP baseline vs fault-tolerant cells)."""

import os
import platform

# Ray reads this when it is first imported: off, a single-node Ray advertises (and connects over)
# 127.0.0.1 instead of the host's external address, so every socket of a run stays on loopback.
# Every ftexp process imports this package before Ray (``ftexp.trainer.local_ray`` refuses a loopback start
# otherwise), and Ray workers inherit the environment.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray's token authentication, decided the same way in every process: a process joining a cluster by
# address (a multi-node job's worker node) with another setting fails with InvalidAuthToken. Off: every
# node of a run is reached only from this job; set RAY_AUTH_MODE=token (+ RAY_AUTH_TOKEN) to turn it on.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's usage statistics: on by default, its dashboard process then reports to usage-stats.ray.io. Off, it
# still probes the cloud metadata address (169.254.169.254); ftexp starts Ray with that probe sent to a
# closed loopback port (``ftexp.trainer.local_ray``), so a run talks to nothing outside 127.0.0.0/8.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Which vector kernels torch dispatches to, read at its first operation: AVX-512 kernels round floats
# differently from AVX2 ones, so the same run on two x86 CPUs drifts apart (a 300-step warm-up
# reached 0.64 eval accuracy with one set, 0.48 with the other). One set everywhere keeps a run's
# numbers, the calibrated thresholds and bitwise comparisons the same on every x86 node of a cluster.
# MKL picks its matrix kernels by CPU the same way (a Sapphire Rapids node's warm-up reached 0.67, its AVX2
# path's 0.535): its code path is pinned to AVX2 too.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_CBWR", "AVX2")
