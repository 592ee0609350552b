"""Shared fixtures: everything offline, everything tiny."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# hypothesis keeps its example database and constants cache in `.hypothesis/` of the working
# directory: the repository root holds only the agreed folders, so they go to the temp folder.
import tempfile  # noqa: E402

from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "wandistill-hypothesis"))

# Every property test runs derandomized: the examples are a function of the test alone (no
# random seed, no example database carried between runs), so a failure in CI reproduces on any
# clone. The "ci" profile (loaded when CI is set, as CI services do) also prints the blob that
# replays a failing example; tests that set their own settings keep derandomize=True too.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", derandomize=True, database=None, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
