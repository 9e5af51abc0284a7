"""bench-app: a small plain Flower app (no fedsim imports) for start-up benchmarks."""
