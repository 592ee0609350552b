"""Which part of the prompt list a job owns: `--part I/N`, a Slurm array task, or all of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from wandistill.cache.manifest import Manifest, new_manifest
from wandistill.errors import UsageError
from wandistill.io.storage import open_storage
from wandistill.precompute.parts import PARTS_NAME, Part, check_and_record, parse, resolve


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_parts_are_disjoint_and_cover_every_batch_in_order(count: int) -> None:
    batches = list(range(23))
    taken = [Part(i, count).take(batches) for i in range(count)]
    assert sorted(b for t in taken for b in t) == batches
    assert all(t == sorted(t) for t in taken)
    assert taken[0][:2] == [0, count][: len(taken[0][:2])]


def test_the_flag_wins_over_a_slurm_array_and_all_ignores_it() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert resolve(None, env) == Part(2, 4, resolve(None, env).source)
    assert (resolve("1/3", env).index, resolve("1/3", env).count) == (1, 3)
    assert resolve("all", env) is None
    assert resolve(None, {}) is None


def test_a_slurm_array_numbered_from_one_gives_parts_from_zero() -> None:
    env = {
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_ARRAY_TASK_MIN": "1",
        "SLURM_ARRAY_TASK_MAX": "3",
        "SLURM_ARRAY_TASK_COUNT": "3",
    }
    part = resolve(None, env)
    assert (part.index, part.count) == (0, 3)
    assert "SLURM_ARRAY_TASK_ID=1" in part.source


@pytest.mark.parametrize(
    ("flag", "env", "words"),
    [
        ("3/3", {}, "part index 3 is out of range for 3 parts"),
        ("-1/3", {}, "is not I/N"),
        ("1/0", {}, "0 parts: must be 1 to 99999"),
        ("two/3", {}, "is not I/N"),
        (None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"}, "out of range"),
        (None, {"SLURM_ARRAY_TASK_ID": "0"}, "SLURM_ARRAY_TASK_COUNT is not"),
        (None, {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "not an integer"),
        (
            None,  # --array=0-10:5: ids 0, 5, 10
            {
                "SLURM_ARRAY_TASK_ID": "5",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_MAX": "10",
            },
            "not 3 consecutive ids",
        ),
    ],
)
def test_a_bad_part_is_one_line_naming_it_with_the_fix(
    flag: str | None, env: dict[str, str], words: str
) -> None:
    with pytest.raises(UsageError) as e:
        resolve(flag, env)
    assert words in e.value.message and "\n" not in e.value.message
    assert e.value.fix


def test_part_folders_sort_in_part_order() -> None:
    names = [parse(f"{i}/12").dirname for i in range(12)]
    assert names == sorted(names) and names[3] == "part-00003-of-00012"


def _header(guidance: float = 5.0, path: str = "/models/a") -> Manifest:
    return new_manifest(
        backend="webdataset",
        teacher={"fingerprint": "f" * 64, "path": path},
        settings={"guidance_scale": guidance, "num_inference_steps": 8},
        fields=[{"name": "noise", "dtype": "float32", "shape": "C,F,H,W"}],
        numerics={"batch_size": 8},
    )


@pytest.fixture(params=["local", "s3"])
def parts_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "parts")
        return
    from s3server import BUCKET, s3_server

    with s3_server():
        yield f"s3://{BUCKET}/parts"


def test_the_first_part_records_the_set_and_later_parts_are_checked_against_it(
    parts_root: str,
) -> None:
    check_and_record(parts_root, Part(0, 3), _header(), "a" * 64, "p.txt")
    assert open_storage(parts_root).exists(PARTS_NAME)
    # a part on another node: same file contents under another path, the teacher elsewhere
    moved = _header(path="/elsewhere")
    check_and_record(parts_root, Part(2, 3), moved, "a" * 64, "/node7/p.txt")
    refusals = {
        "N = 3, not 4": (Part(1, 4), _header(), "a" * 64),
        "prompt file 'p.txt' differs": (Part(1, 3), _header(), "b" * 64),
        "settings.guidance_scale: theirs 5.0, this 3.0": (Part(1, 3), _header(3.0), "a" * 64),
    }
    for words, (part, header, sha) in refusals.items():
        with pytest.raises(UsageError) as e:
            check_and_record(parts_root, part, header, sha, "p.txt")
        assert words in e.value.message and "\n" not in e.value.message, e.value.message
        assert PARTS_NAME in e.value.message and e.value.fix


def test_a_set_without_any_record_yet_is_taken_over_by_a_fixed_run(tmp_path: Path) -> None:
    root = str(tmp_path / "parts")
    check_and_record(root, Part(0, 3), _header(), "a" * 64, "p.txt")
    check_and_record(root, Part(0, 3), _header(3.0), "a" * 64, "p.txt")  # nothing written yet
    with pytest.raises(UsageError, match="guidance_scale: theirs 3.0, this 5.0"):
        check_and_record(root, Part(1, 3), _header(), "a" * 64, "p.txt")  # still: it now binds
