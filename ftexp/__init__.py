"""ftexp: fault-tolerance experiments for RL training (plain DP baseline vs fault-tolerant cells)."""
