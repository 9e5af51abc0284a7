"""Federated analytics with query messages (fedsim's compatibility suite)."""
