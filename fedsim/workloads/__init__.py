"""Client-side methods (training loops, optimisers, averaging, ...) as ClientApps."""
