"""flower-app-dp: a plain Flower app that switches FedAvg for fedsim's DPFedAvg or DMM."""
