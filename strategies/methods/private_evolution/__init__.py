"""Private Evolution: the strategy and its run-config spec."""
