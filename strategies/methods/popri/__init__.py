"""POPri: the strategy and its run-config spec."""
