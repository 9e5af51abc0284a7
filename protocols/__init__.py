"""Pure cryptographic protocols over numpy arrays (no Ray, no Flower)."""
