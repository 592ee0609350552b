"""Stage 1: run the teacher once over a prompt list and record what a student needs.

The stage is `run.run`; the command line calls `entry.launch`, which joins a torchrun job before
importing the stage. Nothing is imported here, so that `import wandistill.precompute.parts` (or
`.job`) does not load diffusers: the package attribute `run` is the `run` submodule, not the
function (import `from wandistill.precompute.run import run`).
"""
