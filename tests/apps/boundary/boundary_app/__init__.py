"""A Flower app whose ServerApp plays the server against fedsim's DPFedAvg."""
