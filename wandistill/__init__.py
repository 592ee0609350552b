"""wandistill: distil Wan 2.1/2.2 teachers into small students through a reusable cache."""

__version__ = "0.1.0"
