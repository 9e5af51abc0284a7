"""The run front end: run configs, the experiment runner, run directories,
results and Flower app projects."""
