"""Tests that play an adversary against fedsim: one module per component."""
