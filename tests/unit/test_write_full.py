"""A write refused for want of room (disk full, quota, the file size limit) names the file being
written, never an input, and leaves no temp file behind (`fsutil.writing`, `fsutil.atomic_open`)."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wandistill.io import outputs

from cachefixtures import write_cache
from clirun import run_cli

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # a fresh interpreter under RLIMIT_FSIZE
def test_recipes_copy_over_the_file_size_limit_names_the_file_and_leaves_no_temp(
    tmp_path: Path,
) -> None:
    """A real EFBIG: the child's RLIMIT_FSIZE is 1 KiB (Python ignores SIGXFSZ, so write()
    fails with EFBIG instead of killing it). The recipe is a few KiB: it sits in the file's
    buffer, the flush fails, and so does the flush at close (the case that left a 0-byte temp)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    dest = tmp_path / "out" / "tiny.toml"
    dest.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "wandistill", "recipes", "copy", "tiny", str(dest)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env=env,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith("error: file too large (over the file size limit"), p.stderr
    assert first.endswith(f" while writing {dest}"), p.stderr
    assert list(dest.parent.iterdir()) == []  # no 0-byte temp, no partial file


def test_a_full_disk_while_merge_copies_names_the_merged_shard_not_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(0, 2), shard_records=2)
    write_cache(b, range(2, 4), shard_records=2)

    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")  # M on another filesystem

    def full(src: str, dst: str) -> None:
        Path(dst).write_bytes(b"half")
        e = OSError(errno.ENOSPC, "No space left on device")  # as shutil's sendfile copy
        e.filename, e.filename2 = str(src), str(dst)  # raises it: the input as `filename`
        raise e

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copyfile", full)
    code, _, err = run_cli(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code == 1 and err.count("error:") == 1, err
    assert f"disk full while writing {m}{os.sep}" in err, err  # M's file (shared tensors)
    assert str(a) not in err and str(b) not in err
    assert not [p for p in m.rglob("*") if outputs.is_temp(p.name)]
