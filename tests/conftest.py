"""Shared fixtures: everything offline, everything tiny, and what is costly built once.

Nothing here may reach a model hub: the offline switches are forced (not defaulted) for this
process and every subprocess a test starts. The tiny teachers are built once per test process
(per pytest-xdist worker) and shared read-only by every module that needs one; a test that
wants to change a teacher copies it (`shutil.copytree`) first. Teardown checks that nobody wrote
into the shared folders.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order pytest-xdist hands the modules out in (`-n auto --dist loadfile
    --no-loadscope-reorder`, pyproject.toml): the longest first.

    A module is one unit of work (`loadfile`): its tests stay on one worker, so its module-scoped
    fixtures (teachers, caches, reference runs, the zygote) are built once. Multi-process tests
    (marked `dist`: torchrun, 2 gloo ranks) stay with their module: two such jobs may run at once,
    one per worker (each has its own rendezvous port and folders). Modules with a `dist` test go
    first, then modules with a `slow` one, so the last module a worker takes is short and the two
    workers finish together. (`loadgroup` is not used: pytest-xdist 3.8 renames the test ids for
    it through `item._nodeid`, which pytest 9 no longer reads, so every test was its own unit and
    each module's fixtures were built on both workers.)
    """
    if not hasattr(config, "workerinput"):  # the order matters only to xdist's workers
        return
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        mark = 0 if item.get_closest_marker("dist") else 1 if item.get_closest_marker("slow") else 2
        rank[module] = min(rank.get(module, 2), mark)
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: modules stay whole


def _digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _shared_teacher(root: Path, *, wan22: bool) -> Iterator[Path]:
    from wandistill.teacher.tiny import make_tiny_teacher

    path = make_tiny_teacher(root / ("wan22" if wan22 else "wan21"), wan22=wan22)
    before = _digest(path)
    yield path
    assert _digest(path) == before, f"a test wrote into the shared tiny teacher {path}"


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Wan 2.1 tiny teacher (seed 0), shared read-only by the whole session."""
    yield from _shared_teacher(tmp_path_factory.mktemp("tiny-teacher"), wan22=False)


@pytest.fixture(scope="session")
def tiny_teacher_wan22(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Wan 2.2 two-expert tiny teacher (seed 0), shared read-only by the whole session."""
    yield from _shared_teacher(tmp_path_factory.mktemp("tiny-teacher"), wan22=True)


@pytest.fixture(autouse=True)
def _no_process_group() -> Iterator[None]:
    """A test that ran an in-process train leaves no process group behind for the next one."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch just to check
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def zygote() -> Iterator[object]:
    """A forking process (tests/zygote.py) for the whole session (one per pytest-xdist worker):
    runs of `wandistill`, `python` and `torchrun` in real processes without seconds of imports
    each. Each run gets the environment of this process as it is when the run starts."""
    from zygote import Zygote

    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="session")
def zygote_nopickle() -> Iterator[object]:
    """A second zygote (one per pytest-xdist worker) with every way to unpickle made to raise in
    it and so in every run forked from it (tests/nopickle: its `sitecustomize` patches pickle
    before torch binds it at import). torchrun's agent unpickles its rendezvous state: start
    the agent with `sys.executable` and its ranks through this zygote (`PYTHON_EXEC`)."""
    from zygote import Zygote

    root = Path(__file__).parents[1]
    path = [str(root / "tests" / "nopickle"), str(root), str(root / "tests")]
    z = Zygote(PYTHONPATH=os.pathsep.join(path), WANDISTILL_TEST_NO_PICKLE="1")
    yield z
    z.close()
