"""Output folders: what a command may write into, one writer at a time, dead writers' temps.

Every case checks the refusal is one UsageError naming the folder and that nothing in the world
changed (files of the teacher / cache / foreign folder byte-identical, no folder created).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from wandistill.errors import UsageError, WandistillError
from wandistill.io import outputs
from wandistill.io.outputs import HOLDER, LOCK, MARKER, claim
from wandistill.runtime.dist import DistInfo

REPO = Path(__file__).parents[2]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (links not followed) -> sha256 of a file, "dir" or the link."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p)] = "dir"
    return out


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """A teacher (diffusers layout), a bare transformers model, a cache of an earlier version,
    a run of an earlier version, and a user's folder."""
    t = tmp_path / "teacher"
    (t / "transformer").mkdir(parents=True)
    (t / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (t / "transformer" / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    (t / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 16)
    m = tmp_path / "bert"
    m.mkdir()
    (m / "config.json").write_text('{"architectures": ["BertModel"]}')
    (m / "model.safetensors").write_bytes(b"\0" * 16)
    c = tmp_path / "cache"
    (c / "shards").mkdir(parents=True)
    (c / "manifest.json").write_text(json.dumps({"format": "wandistill-cache", "shards": []}))
    (c / "shared.safetensors").write_bytes(b"\0" * 8)
    r = tmp_path / "run"
    (r / "checkpoints").mkdir(parents=True)
    (r / "config.json").write_text(json.dumps({"train": {"steps": 2}, "student_config": {}}))
    u = tmp_path / "mine"
    u.mkdir()
    (u / "notes.txt").write_text("my notes")
    return tmp_path


def refused(path: Path, purpose: str, match: str, **kw: object) -> UsageError:
    with pytest.raises(UsageError, match=match) as info:
        claim(path, purpose, **kw)  # type: ignore[arg-type]
    assert str(path) in info.value.message and info.value.fix
    assert "\n" not in info.value.message
    return info.value


# --------------------------------------------------------------------------- what may be written


@pytest.mark.parametrize("purpose", outputs.PURPOSES)
def test_a_missing_or_empty_folder_is_claimed_and_marked_with_its_purpose(
    tmp_path: Path, purpose: str
) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)  # empty directories hold nothing to lose
    for target in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        with claim(target, purpose) as folder:
            assert folder.path == target.resolve() and folder.purpose == purpose
            marker = json.loads((target / MARKER).read_text())
            assert marker["purpose"] == purpose and marker["format"] == "wandistill-output"
            assert json.loads((target / HOLDER).read_text())["pid"] == os.getpid()
        assert not (target / HOLDER).exists()  # released
        with claim(target, purpose):  # ours now: claimed again
            pass


@pytest.mark.parametrize(
    ("name", "purpose", "match"),
    [
        ("teacher", "cache", "is a model folder .it holds model_index.json"),
        ("teacher/transformer", "run", "is inside the model folder|is a model folder"),
        ("bert", "eval", "is a model folder .it holds config.json and model.safetensors"),
        ("mine", "run", r"is not empty and was not written by wandistill \(holds notes.txt\)"),
        ("cache", "run", "is a wandistill cache folder, not a run folder"),
        ("run", "cache", "is a wandistill run folder, not a cache folder"),
        ("run", "sample", "is a wandistill run folder, not a sample folder"),
    ],
)
def test_folders_of_others_or_of_another_purpose_are_refused_and_untouched(
    world: Path, name: str, purpose: str, match: str
) -> None:
    before = snapshot(world)
    refused(world / name, purpose, match)
    assert snapshot(world) == before


def test_a_folder_holding_only_weights_or_an_unreadable_marker_is_refused(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.ckpt").write_bytes(b"x")
    refused(tmp_path / "w", "run", "is a model folder .it holds weights: model.ckpt")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / MARKER).write_text("{not json")
    (tmp_path / "m" / "data.txt").write_text("x")
    refused(tmp_path / "m", "cache", "has an unreadable .wandistill.json")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("teacher/cache", "is inside the model folder '.*teacher' .it holds model_index.json"),
        ("teacher/transformer/x/y", "is inside the model folder '.*transformer'"),
        ("bert/out", "is inside the model folder '.*bert'"),
        ("cache/run", "is inside the cache '.*cache'"),
        ("cache/shards/x", "is inside the cache '.*cache'"),
    ],
)
def test_nothing_is_written_inside_a_model_folder_or_a_cache(
    world: Path, name: str, match: str
) -> None:
    before = snapshot(world)
    for purpose in ("run", "eval"):
        refused(world / name, purpose, match)
    assert snapshot(world) == before and not (world / name).exists()


def test_symlinks_into_a_teacher_or_a_cache_are_followed_and_refused(world: Path) -> None:
    links = world / "links"
    links.mkdir()
    (links / "to_teacher").symlink_to(world / "teacher")
    (links / "into_teacher").symlink_to(world / "teacher" / "transformer")
    (links / "to_cache").symlink_to(world / "cache")
    before = snapshot(world)
    refused(links / "to_teacher", "cache", "is a model folder")
    refused(links / "into_teacher", "cache", "model folder")
    refused(links / "to_teacher" / "sub", "eval", "is inside the model folder")
    refused(links / "to_cache" / "run", "run", "is inside the cache")
    refused(links / "to_cache", "run", "is a wandistill cache folder")
    assert snapshot(world) == before


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ("cache", "is --cache"),
        ("cache/run", "is inside --cache"),
        (".", "contains --cache"),
        ("links/cache", "is --cache"),
    ],
)
def test_train_out_is_never_the_cache_nor_inside_it_nor_containing_it(
    world: Path, out: str, match: str
) -> None:
    (world / "links").mkdir()
    (world / "links" / "cache").symlink_to(world / "cache")
    before = snapshot(world)
    refused(world / out, "run", match, inputs={"--cache": world / "cache"})
    assert snapshot(world) == before


def test_a_model_folder_that_carries_a_marker_or_a_run_config_is_still_refused(
    world: Path,
) -> None:
    (world / "teacher" / MARKER).write_text(
        json.dumps({"format": "wandistill-output", "purpose": "run"})
    )
    refused(world / "teacher", "run", "is a model folder")
    (world / "bert" / "config.json").write_text(json.dumps({"train": {}}))
    (world / "bert" / "checkpoints").mkdir()  # looks like an old run, but holds weights
    refused(world / "bert", "run", "is a model folder")


def test_a_file_in_the_way_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    refused(tmp_path / "f" / "sub", "cache", r"cannot create cache directory .*Not a directory")
    refused(tmp_path / "f", "run", "Not a directory")


# --------------------------------------------------------------------------- earlier versions


def test_caches_runs_evals_and_samples_of_earlier_versions_are_adopted(world: Path) -> None:
    (world / "ev").mkdir()
    (world / "ev" / "eval.json").write_text(json.dumps({"latent_mse": 0.1, "per_record": []}))
    (world / "ev" / "grid.png").write_bytes(b"png")
    (world / "sm").mkdir()
    for name in ("0000.png", "0001.png", "grid.png"):
        (world / "sm" / name).write_bytes(b"png")
    for name, purpose in (("cache", "cache"), ("run", "run"), ("ev", "eval"), ("sm", "sample")):
        with claim(world / name, purpose):
            pass
        assert json.loads((world / name / MARKER).read_text())["purpose"] == purpose
    assert (world / "cache" / "shared.safetensors").read_bytes() == b"\0" * 8


def test_a_folder_holding_only_bookkeeping_can_be_claimed_for_another_purpose(
    tmp_path: Path,
) -> None:
    """A precompute that failed before writing anything leaves only the claim's own files."""
    with claim(tmp_path / "x", "cache"):
        pass
    with claim(tmp_path / "x", "run"):
        pass
    assert json.loads((tmp_path / "x" / MARKER).read_text())["purpose"] == "run"
    (tmp_path / "x" / "config.json").write_text("{}")
    refused(tmp_path / "x", "cache", "is a wandistill run folder")


# --------------------------------------------------------------------------- one writer


def test_a_second_claim_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    with claim(tmp_path / "c", "cache"):
        err = refused(tmp_path / "c", "cache", "is in use by another wandistill process")
        assert f"pid {os.getpid()}" in err.message and "host " in err.message
        assert "started " in err.message
        refused(tmp_path / "c", "run", "is in use by another wandistill process")
    with claim(tmp_path / "c", "cache"):  # released: free again
        pass


_HOLD = """
import sys
from wandistill.io.outputs import claim
folder = claim(sys.argv[1], "run")
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_kill_9_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "r")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        err = refused(tmp_path / "r", "run", "in use by another wandistill process")
        assert f"pid {proc.pid}" in err.message
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert (tmp_path / "r" / LOCK).exists() and (tmp_path / "r" / HOLDER).exists()
    with claim(tmp_path / "r", "run") as folder:  # the kernel dropped the dead holder's lock
        assert json.loads((folder / HOLDER).read_text())["pid"] == os.getpid()


def test_under_torchrun_rank_0_claims_and_every_rank_hears_the_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wandistill.runtime import dist

    sent: list[object] = []

    def broadcast(info: DistInfo, obj: object, src: int = 0) -> object:
        sent.append(obj)
        return obj if info.rank == 0 else heard

    monkeypatch.setattr(dist, "broadcast_json", broadcast)
    rank0 = DistInfo(rank=0, world_size=2, local_rank=0, device=_cpu(), backend="gloo")
    rank1 = DistInfo(rank=1, world_size=2, local_rank=1, device=_cpu(), backend="gloo")
    heard: object = None
    with claim(tmp_path / "c", "cache", rank0) as folder:
        assert sent == [None] and (folder / HOLDER).exists()
        with pytest.raises(UsageError, match="in use by another wandistill process"):
            claim(tmp_path / "c", "cache", rank0)  # a second job: rank 0 refused ...
        failure = sent[-1]
        assert isinstance(failure, dict) and "in use by" in failure["message"]
    shared = claim(tmp_path / "c", "cache", rank1)  # ... the same job's rank 1 shares it
    assert shared.path == (tmp_path / "c").resolve() and not (tmp_path / "c" / HOLDER).exists()
    heard = failure
    with pytest.raises(UsageError, match="in use by another wandistill process"):
        claim(tmp_path / "c", "cache", rank1)  # ... and the other job's rank 1 exits too
    heard = {"message": "boom", "fix": None, "usage": False}
    with pytest.raises(WandistillError, match="boom"):
        claim(tmp_path / "c", "cache", rank1)


def _cpu():  # noqa: ANN202
    import torch

    return torch.device("cpu")


# --------------------------------------------------------------------------- dead writers


def test_the_next_owner_removes_dead_writers_temps_and_nothing_else(tmp_path: Path) -> None:
    c = tmp_path / "c"
    with claim(c, "cache"):
        pass
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    temps = [
        c / ".manifest.json.123-456.tmp",
        c / "journal" / ".rank-00000.json.9-9.tmp",
        c / "shards" / ".r00000-000003.tar.77-1.tmp",
        c / "previews" / ".abc.png.5-5.tmp",
        c / "data.zarr" / "xt" / "c" / f"0.{'ab' * 16}.partial",
    ]
    for t in temps:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_bytes(b"half")
    for d in (c / ".offload.tmp" / "rank0" / "transformer-x", c / ".checkpoint-3.k2j.tmp"):
        d.mkdir(parents=True)
        (d / "weights").write_bytes(b"w")
    (c / ".link.tmp").symlink_to(outside)
    kept = [c / "shards" / "r00000-000000.tar", c / "notes.tmp", c / ".hidden"]
    nested = c / "sub" / ".own.tmp"  # a nested folder claimed on its own: not ours to clean
    for k in [*kept, nested]:
        k.parent.mkdir(parents=True, exist_ok=True)
        k.write_bytes(b"data")
    (c / "sub" / MARKER).write_text(json.dumps({"format": "wandistill-output", "purpose": "eval"}))
    with claim(c, "cache"):
        pass
    assert not any(t.exists() for t in temps)
    assert not (c / ".offload.tmp").exists() and not (c / ".checkpoint-3.k2j.tmp").exists()
    assert not (c / ".link.tmp").is_symlink() and (outside / "precious").read_text() == "keep"
    assert all(k.read_bytes() == b"data" for k in [*kept, nested])


def test_hostile_names_and_files_keep_the_refusal_one_line_and_never_block(
    tmp_path: Path,
) -> None:
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "evil\nerror: fake").write_text("x")
    err = refused(tmp_path / "f", "run", "was not written by wandistill")
    assert "evil\\nerror: fake" in err.message
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / MARKER)  # reading it would block forever
    os.mkfifo(tmp_path / "fifo" / "manifest.json")
    (tmp_path / "fifo" / "data").write_text("x")
    refused(tmp_path / "fifo", "cache", "has an unreadable .wandistill.json")
    with claim(tmp_path / "c", "cache"):
        (tmp_path / "c" / HOLDER).write_text(json.dumps({"host": "a\nb", "pid": "1\r2"}))
        err = refused(tmp_path / "c", "cache", "in use by another wandistill process")
        assert "host a\\nb, pid 1\\r2" in err.message


def test_a_prompt_file_kept_in_the_cache_folder_is_not_in_the_way(tmp_path: Path) -> None:
    with claim(tmp_path / "c", "cache"):
        pass
    (tmp_path / "c" / "prompts.txt").write_text("a cat\n")
    inputs = {"--prompts": tmp_path / "c" / "prompts.txt", "--teacher": tmp_path / "t"}
    with claim(tmp_path / "c", "cache", inputs=inputs):
        pass
    refused(tmp_path / "c" / "prompts.txt", "cache", "prompts.txt. is a file", inputs=inputs)


def test_refusals_never_unpickle_anything(tmp_path: Path) -> None:
    """A hostile folder's files are only looked at, never loaded (a pickle that would mkdir)."""

    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (os.mkdir, (str(tmp_path / "pwned"),))

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    (tmp_path / "m" / "config.json").write_text("{}")
    refused(tmp_path / "m", "run", "model folder")
    assert not (tmp_path / "pwned").exists()


def test_a_lock_path_that_is_a_directory_is_named_not_the_folder(tmp_path: Path) -> None:
    (tmp_path / "run" / LOCK).mkdir(parents=True)
    with pytest.raises(UsageError) as e:
        claim(tmp_path / "run", "run")
    assert f"cannot open the lock file {str(tmp_path / 'run' / LOCK)!r}" in e.value.message
    assert "remove the directory" in (e.value.fix or "")
