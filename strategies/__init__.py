"""Flower Message-API strategies shipped with fedsim."""
