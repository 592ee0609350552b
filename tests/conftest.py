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
