"""What the methods build on: wrappers, clipping, sampling guards,
server secrets, vectors, worker-side sums."""
