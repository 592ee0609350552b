"""The `wandistill` command line: parse, build a config, call the room that does the work.

One module per command family registers its commands on the apps of `common`; `entry.main` turns
exceptions into exit codes. Importing this package builds the whole command tree (the modules
import torch and the libraries only inside the commands, so --help stays fast).
"""

# The modules register their commands as they are imported, in --help's order.
# isort: off
from wandistill.cli import teacher, cache, recipes  # noqa: F401
from wandistill.cli import precompute, train, evaluation, demo, export, plan  # noqa: F401

# isort: on
from wandistill.cli.common import app, cache_app, recipes_app, teacher_app
from wandistill.cli.entry import main

__all__ = ["app", "cache_app", "main", "recipes_app", "teacher_app"]
