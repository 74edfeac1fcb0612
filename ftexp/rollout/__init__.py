"""Where the rollouts a side trains on come from: recorded once from the initial policy (``recorded``)."""
