"""fedsim: simulate large private federations with Flower apps on Ray actors."""

__version__ = "0.1.0"
