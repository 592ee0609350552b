"""`precompute --part I/N`: N independent parts, one of them killed and re-run, are together
the cache of one job over the whole prompt list, record for record (keys and tensor bytes);
parts that do not belong together are refused before anything is written."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from wandistill.cache import open_cache
from wandistill.cache.contract import tensor_bytes
from wandistill.cache.manifest import read_manifest
from wandistill.cache.merge import MergeConfig, merge
from wandistill.config import load_recipe
from wandistill.errors import UsageError
from wandistill.precompute.parts import PARTS_NAME, Part
from wandistill.precompute.run import run

from zygote import Zygote

REPO = Path(__file__).parents[2]
PROMPTS = [f"prompt {i}: a {animal}" for i, animal in enumerate("cat dog fox owl elk cow".split())]
PROMPTS += ["a red car at night", "the sea", "a tree", "a boat"]  # 10 prompts: 5 batches of 2


def _sets(teacher: Path, prompts: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{cache}"',
        "sampler.num_inference_steps=3",
        "sampler.record_steps=[0, 2]",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.batch_size=2",
        "cache.shard_records=1",
        "cache.holdout_fraction=0.2",
        "previews=0",
        *extra,
    ]


def _cfg(teacher: Path, prompts: Path, cache: Path, *extra: str):
    sets = _sets(teacher, prompts, cache, *extra)
    return load_recipe(Path("pipelines/tiny.toml"), sets, stage="precompute").precompute


@pytest.fixture(scope="module")
def world(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parts")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"teacher": tiny_teacher, "prompts": prompts, "root": root}


def records_by_key(cache: Path) -> dict[str, dict[str, object]]:
    """Every record of a cache: key -> field -> the tensor's bytes (dtype and shape with them)."""
    with open_cache(cache) as store:
        return {
            r.key: {
                name: (str(t.dtype), tuple(t.shape), tensor_bytes(t).tobytes())
                for name, t in r.tensors().items()
            }
            | {"prompt": r.prompt, "seed": r.seed}
            for r in store.records()
        }


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: size and modification time (what a refused run must not touch)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _kill_part(
    zygote: Zygote, world: dict[str, Path], out: Path, part: str
) -> subprocess.CompletedProcess:
    """The real command line, SIGKILLed by the test hook right after its first record (a fork of
    the session's zygote: a real process)."""
    sets = _sets(world["teacher"], world["prompts"], out)
    argv = [zygote.python, "-m", "wandistill", "precompute", "pipelines/tiny.toml"]
    argv += [a for s in sets for a in ("--set", s)] + ["--part", part]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDISTILL_FAULT": "precompute:record:1"}
    return subprocess.run(
        argv, cwd=REPO, env=zygote.env(env), capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_three_parts_one_killed_and_rerun_are_one_jobs_cache_record_for_record(
    zygote: Zygote, world: dict[str, Path]
) -> None:
    teacher, prompts, root = world["teacher"], world["prompts"], world["root"]
    one = run(_cfg(teacher, prompts, root / "one"), quiet=True)
    out = root / "parts"
    killed = _kill_part(zygote, world, out, "1/3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    part1 = out / "part-00001-of-00003"
    assert not read_manifest(part1).complete  # killed: committed records, never sealed
    summaries = [run(_cfg(teacher, prompts, out), quiet=True, part=Part(i, 3)) for i in range(3)]
    assert [s.prompts for s in summaries] == [4, 4, 2]  # batches {0, 3}, {1, 4}, {2} of 2 each
    assert summaries[1].records_present == 1 and summaries[1].records_written == 3
    assert summaries[1].records_skipped == 1  # its first batch was redone whole, one key dropped

    whole = records_by_key(root / "one")
    parts = [records_by_key(out / f"part-{i:05d}-of-00003") for i in range(3)]
    assert one.records_written == len(whole) == len(PROMPTS)
    union: dict[str, dict[str, object]] = {}
    for p in parts:
        assert not union.keys() & p.keys()  # disjoint
        union |= p
    assert union.keys() == whole.keys()
    for key, tensors in whole.items():
        assert union[key] == tensors, key  # every tensor's bytes, every field
    merged = merge(MergeConfig(inputs=tuple(sorted(map(str, out.glob("part-*")))), out=root / "m"))
    assert merged.records == len(PROMPTS) and records_by_key(root / "m") == whole
    ref = read_manifest(root / "one")
    for i in range(3):
        m = read_manifest(out / f"part-{i:05d}-of-00003")
        assert m.complete
        got = (m.teacher, m.settings, m.numerics, m.fields, m.shared, m.dims)
        assert got == (ref.teacher, ref.settings, ref.numerics, ref.fields, ref.shared, ref.dims)


def _refused(world: dict[str, Path], out: Path, part: Part, *extra: str, prompts=None) -> str:
    """The part's run refused in one line with a fix, and nothing under `out` changed."""
    before = tree(out)
    cfg = _cfg(world["teacher"], prompts or world["prompts"], out, *extra)
    with pytest.raises(UsageError) as e:
        run(cfg, quiet=True, part=part)
    assert "\n" not in e.value.message and e.value.fix
    assert tree(out) == before
    return e.value.message


def test_parts_that_do_not_belong_with_the_others_are_refused_writing_nothing(
    world: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "parts"
    run(_cfg(world["teacher"], world["prompts"], out), quiet=True, part=Part(2, 3))
    assert (out / PARTS_NAME).is_file()

    message = _refused(world, out, Part(0, 4))
    assert "--part 0/4" in message and "3-part run" in message

    message = _refused(world, out, Part(2, 3), "sampler.guidance_scale=3.0")
    assert "settings.guidance_scale" in message and "--part 2/3" in message

    other = tmp_path / "other.txt"
    other.write_text("\n".join(reversed(PROMPTS)) + "\n")
    message = _refused(world, out, Part(0, 3), prompts=other)
    assert "prompt file" in message and "(sha256)" in message

    inside = out / "part-00002-of-00003"  # parts inside a cache: refused before parts.json
    before = tree(out)
    message = _refused(world, inside, Part(0, 3))
    assert "inside" in message and "cache" in message
    assert tree(out) == before


def test_a_part_index_out_of_range_is_one_line_and_a_nonzero_exit(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clirun import run_cli

    sets = _sets(world["teacher"], world["prompts"], tmp_path / "out")
    args = [a for s in sets for a in ("--set", s)]
    code, _, err = run_cli(capsys, "precompute", "pipelines/tiny.toml", *args, "--part", "3/3")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("error: --part: part index 3 is out of range for 3 parts")
    assert lines[-1].strip().startswith("fix:") and len(lines) == 2
    assert not (tmp_path / "out").exists()
