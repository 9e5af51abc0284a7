"""Client-level DP-FedAvg: the strategy and its run-config spec."""
