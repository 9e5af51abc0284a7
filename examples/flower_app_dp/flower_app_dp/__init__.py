"""flower-app-dp: a plain Flower app whose ServerApp switches FedAvg for fedsim's DPFedAvg or DMM."""
