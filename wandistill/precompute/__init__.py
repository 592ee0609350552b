"""Stage 1: run the teacher once over a prompt list and record what a student needs."""

from wandistill.precompute.run import run

__all__ = ["run"]
