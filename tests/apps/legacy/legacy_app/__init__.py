"""A Flower app in the legacy form (fedsim's compatibility suite)."""
