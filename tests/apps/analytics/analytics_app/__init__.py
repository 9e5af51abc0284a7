"""Message-API surfaces: query messages with actions, FedAvg (fedsim's compatibility suite)."""
