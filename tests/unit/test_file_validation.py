"""Every file from outside is checked before use: one error line naming file, field and fix.

Hand-picked cases per file kind (the property-based sweep is test_hypothesis_files.py): the
shared JSON checks, record headers and json members of a cache without checksums, zarr
metadata, shared.safetensors, checkpoint files that were changed and re-sealed (so only the
checks against the live run can catch them), a student folder's config.json, and the crash log
an internal error leaves instead of a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field
from safetensors.torch import load_file, save_file

from wandistill.checks.validate import (
    Schema,
    check,
    inside,
    load_json_file,
    parse_json,
    read_capped,
    seal,
)
from wandistill.cli import main
from wandistill.errors import CorruptRecordError, UsageError

from cachefixtures import without_tensor_checksums, write_cache
from clirun import run_cli_text as _cli
from realfiles import RealFiles, real_files, tree_digest


def _one_error(code: int, text: str, *named: str) -> None:
    assert code != 0 and "Traceback" not in text and text.count("error:") == 1, text
    assert "internal error" not in text, text
    for name in named:
        assert name in text, (name, text)


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealFiles:
    return real_files(tmp_path_factory.mktemp("real"))


# ----------------------------------------------------------------------------- shared checks


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": NaN}', "a is nan, not a finite number"),
        (b'{"a": {"b": Infinity}}', "a.b is inf, not a finite number"),
        (b'{"a": [1e999]}', "a[0] is inf, not a finite number"),
        (b"[" * 40 + b"]" * 40, "nests deeper than 32 levels"),
        (b"[" * 5000 + b"]" * 5000, ": nests deeper than 32 levels"),
        (b'{"a": "\xff"}', "not valid JSON (not UTF-8 text at byte 7)"),
        (b'{"a": "\\ud800"}', "not valid JSON"),
        (b'{"a": 1, "a": 2}', "not valid JSON (duplicate key 'a')"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON (Exceeds the limit"),
        (b"", "not valid JSON"),
    ],
)
def test_strict_json_refuses_non_finite_deep_and_malformed_input(data: bytes, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        parse_json(data, "thing 'x.json'", fix="restore it")
    assert e.value.message.startswith("thing 'x.json'") and e.value.fix == "restore it"


def test_a_file_over_its_cap_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048 + b"{}")
    with pytest.raises(UsageError, match="larger than the 1 KiB such a file may be"):
        read_capped(big, max_bytes=1024, what="thing", fix="x")
    assert read_capped(big, max_bytes=4096, what="thing", fix="x").endswith(b"{}")


class _Entry(Schema):
    name: str
    records: int


class _Doc(Schema):
    shards: list[_Entry]
    lr: float


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"shards": [{"name": "r1", "records": "3"}], "lr": 1.0},
            "shards[0] (r1).records must be an integer, not the string '3'",
        ),  # noqa: E501
        (
            {"shards": [{"name": "r1", "records": 3, "x": 1}], "lr": 1.0},
            "shards[0] (r1).x is not a known field",
        ),  # noqa: E501
        ({"shards": {}, "lr": 1.0}, "shards must be a JSON array, not a JSON object"),
        ({"shards": []}, "lr is missing"),
        ({"shards": [], "lr": True}, "lr must be a number, not true"),
        ([], "the top level must be a JSON object, not a JSON array"),
    ],
)
def test_a_schema_error_names_the_field_and_the_named_item(obj: Any, message: str) -> None:
    with pytest.raises(UsageError) as e:
        check(_Doc, obj, "doc 'd.json'", fix="f")
    assert e.value.message == f"doc 'd.json': {message}"


class _Inner(Schema):
    ratio: float = Field(json_schema_extra={"fix": "use a ratio in (0, 1)"}, gt=0, lt=1)


class _Outer(Schema):
    inner: _Inner
    steps: int


def test_a_field_that_declares_a_fix_gives_it_instead_of_the_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as e:
        check(_Outer, {"inner": {"ratio": 1.5}, "steps": 1}, "doc 'd.json'", fix="file fix")
    assert e.value.message.startswith("doc 'd.json': inner.ratio = 1.5")
    assert e.value.fix == "use a ratio in (0, 1)"
    path = tmp_path / "d.json"
    path.write_text('{"inner": {"ratio": 0.5}}')
    with pytest.raises(UsageError) as e:
        load_json_file(path, _Outer, what="doc", fix="file fix")
    assert e.value.message == f"doc {str(path)!r}: steps is missing"
    assert e.value.fix == "file fix"


def test_inside_refuses_names_that_leave_their_folder_even_through_a_symlink(
    tmp_path: Path,
) -> None:
    (tmp_path / "shards").mkdir()
    assert inside(tmp_path, "shards/a.tar", "file", UsageError) == tmp_path / "shards/a.tar"
    for rel in ("../x", "/etc/passwd", "a/../../x", "a\\b", "", "./a"):
        with pytest.raises(UsageError, match="refused"):
            inside(tmp_path, rel, "file", UsageError)
    (tmp_path / "shards" / "out").symlink_to("/etc")
    with pytest.raises(UsageError, match="leads outside its folder"):
        inside(tmp_path, "shards/out/passwd", "file", UsageError)


# ----------------------------------------------------------------------------- cache records


def _unchecked_cache(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache whose records carry no checksums (header metadata, the entry's crc32c): nothing
    guards a header, so a hostile one reaches the parser."""
    from wandistill.cache.seal import seal_entry

    with monkeypatch.context() as m:
        without_tensor_checksums(m)
        write_cache(path, range(2), shard_records=2)
    manifest = json.loads((path / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["crc32c"]
        seal_entry(entry)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _header(cache: Path, i: int) -> tuple[Path, int, bytes]:
    entry = json.loads((cache / "manifest.json").read_text())["shards"][0]
    tar = cache / entry["file"]
    off = entry["offsets"][i][0]
    with open(tar, "rb") as f:
        f.seek(off)
        hlen = int.from_bytes(f.read(8), "little")
        return tar, off + 8, f.read(hlen)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (b'"F32"', b'"Q32"', "dtype = 'Q32': must be 'F32', 'F16'"),
        (b'"shape":[', b'"shape":{', "not valid JSON"),
        (b'"data_offsets":[0,', b'"data_offsets":[9,', "do not fit shape"),
    ],
)
def test_a_hostile_safetensors_header_is_a_corrupt_record_never_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bytes, new: bytes, message: str
) -> None:
    from wandistill.cache import open_cache

    cache = _unchecked_cache(tmp_path / "c", monkeypatch)
    tar, start, head = _header(cache, 0)
    assert old in head and len(old) == len(new)
    _overwrite(tar, start, head.replace(old, new, 1))
    names = ["final_latent", "noise", "prompt_embeds", "timesteps", "xt", "teacher_out"]
    with open_cache(cache) as store, pytest.raises(CorruptRecordError, match=message):
        store.read_sample(store.entries[0], 0, 0, names)


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (lambda m: b"[" * len(m), "json member: not valid JSON"),
        (lambda m: m.replace(b'"seed": 0', b'"seed":""'), "seed must be an integer"),
    ],
)
def test_a_hostile_json_member_is_a_corrupt_record_never_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: Any, message: str
) -> None:
    from wandistill.cache import open_cache

    cache = _unchecked_cache(tmp_path / "c", monkeypatch)
    entry = json.loads((cache / "manifest.json").read_text())["shards"][0]
    joff, jlen = entry["offsets"][0][2:]
    with open(cache / entry["file"], "rb") as f:
        f.seek(joff)
        member = f.read(jlen)
    hostile = replace(member)
    assert len(hostile) == len(member)
    _overwrite(cache / entry["file"], joff, hostile)
    with open_cache(cache) as store, pytest.raises(CorruptRecordError, match=message):
        store.read_record(store.entries[0], 0)


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("zarr.json", lambda m: m.update(zarr_format=2), "zarr_format = 2: must be 3"),
        (
            "zarr.json",
            lambda m: m["attributes"]["wandistill"].update(block_records=-1),
            "attributes.wandistill: block_records = -1",
        ),
        ("xt/zarr.json", lambda m: m.update(shape=[2**50, 2]), "shape[0] = 1125899906842624"),
        ("xt/zarr.json", lambda m: m.update(codecs=[]), "codecs = []: list should have at least 1"),
        ("xt/zarr.json", lambda m: m.update(data_type="float99"), "zarr cannot read it"),
        ("xt/zarr.json", lambda m: m.update(attributes={"wandistill_dtype": 5}), "not a dtype"),
    ],
)
def test_bad_zarr_metadata_is_one_error_line_naming_the_file(
    real: RealFiles, tmp_path: Path, file: str, edit: Any, message: str
) -> None:
    cache = Path(shutil.copytree(real.zarr, tmp_path / "z"))
    _edit_json(cache / "data.zarr" / file, edit)
    before = tree_digest(cache)
    code, text = _cli(*real.train_args(cache, tmp_path / "run"))
    _one_error(code, text, message, "xt" if file.startswith("xt") else "zarr.json")
    assert tree_digest(cache) == before


def test_a_symlink_inside_the_zarr_group_is_refused(real: RealFiles, tmp_path: Path) -> None:
    cache = Path(shutil.copytree(real.zarr, tmp_path / "z"))
    shutil.rmtree(cache / "data.zarr" / "noise")
    (cache / "data.zarr" / "noise").symlink_to(real.zarr / "data.zarr" / "noise")
    code, text = _cli("cache", "verify", str(cache))
    _one_error(code, text, "noise' is a symlink inside data.zarr; refused")


def test_a_zarr_entry_naming_a_file_outside_the_group_is_refused(
    real: RealFiles, tmp_path: Path
) -> None:
    cache = Path(shutil.copytree(real.zarr, tmp_path / "z"))

    def escape(m: dict[str, Any]) -> None:
        sums = m["shards"][0]["sha256"]
        sums["../../../etc/passwd"] = sums.pop(next(iter(sums)))

    _edit_json(cache / "manifest.json", escape)
    code, text = _cli("cache", "verify", str(cache))
    _one_error(code, text, "manifest.json", "path contains an empty, '.' or '..' part")


def test_a_changed_shared_safetensors_is_one_error_naming_it(
    real: RealFiles, tmp_path: Path
) -> None:
    cache = Path(shutil.copytree(real.wds, tmp_path / "c"))
    shared = cache / "shared.safetensors"
    _overwrite(shared, shared.stat().st_size - 1, b"\x7f")
    code, text = _cli(*real.train_args(cache, tmp_path / "run"))
    _one_error(code, text, "shared.safetensors' fails its sha256 check")


# ----------------------------------------------------------------------------- checkpoints


def _reseal(folder: Path) -> None:
    """Recompute state.json's file sums and seal, as a consistent (hostile) writer would."""
    import google_crc32c

    state = json.loads((folder / "state.json").read_text())
    for name in state["files"]:
        data = (folder / name).read_bytes()
        state["files"][name] = {"bytes": len(data), "crc32c": google_crc32c.value(data)}
    state.pop("sha256")
    state["sha256"] = seal(state)
    (folder / "state.json").write_text(json.dumps(state, indent=1))


def _resume(real: RealFiles, run: Path) -> tuple[int, str]:
    # Past the finished run's total (2): a resume that trains on, so the checkpoint is read (a
    # resume at the total of a finished run is a no-op that reads no tensor file).
    return _cli(*real.train_args(real.wds, run, "--resume", "--steps", "3"))


@pytest.fixture
def run(real: RealFiles, tmp_path: Path) -> Path:
    return Path(shutil.copytree(real.run, tmp_path / "run"))


def test_a_checkpoint_file_changed_on_disk_is_refused_at_resume(real: RealFiles, run: Path) -> None:
    rng = run / "checkpoints" / "checkpoint-2" / "rng.safetensors"
    _overwrite(rng, rng.stat().st_size - 3, b"\x00\x01\x02")
    before = tree_digest(run)
    _one_error(*_resume(real, run), "rng.safetensors' fails its crc32c check", "fix: delete")
    assert tree_digest(run) == before


def _edit_tensors(path: Path, edit: Any) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        (
            "student.safetensors",
            lambda t: t.__setitem__(next(iter(t)), torch.full_like(t[next(iter(t))], torch.nan)),
            "holds NaN or inf values",
        ),
        (
            "student.safetensors",
            lambda t: t.__setitem__(next(iter(t)), torch.zeros(3, 3)),
            "this student has",
        ),
        ("ema.safetensors", lambda t: t.pop(next(iter(t))), "does not fit this student"),
        (
            "rng.safetensors",
            lambda t: t.update({"rank0.cpu": torch.zeros(7, dtype=torch.uint8)}),
            "a CPU RNG state is 5056",
        ),
        (
            "optimizer.safetensors",
            lambda t: t.update({"state.0.exp_avg": torch.zeros(2)}),
            "state.0.exp_avg is [2], the parameter is",
        ),
        (
            "optimizer.safetensors",
            lambda t: t.update({"../x": torch.zeros(2)}),
            "unexpected tensor '../x'",
        ),
    ],
)
def test_a_resealed_checkpoint_that_does_not_fit_the_run_is_refused(
    real: RealFiles, run: Path, file: str, edit: Any, message: str
) -> None:
    folder = run / "checkpoints" / "checkpoint-2"
    _edit_tensors(folder / file, edit)
    _reseal(folder)
    _one_error(*_resume(real, run), file, message)


def test_a_resealed_state_that_injects_a_scheduler_attribute_is_refused(
    real: RealFiles, run: Path
) -> None:
    folder = run / "checkpoints" / "checkpoint-2"
    _edit_json(folder / "state.json", lambda s: s["scheduler"].update(step=5))
    _reseal(folder)
    _one_error(*_resume(real, run), "state.json", "scheduler does not fit this run", "'step'")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: [s.update(step=1), s["scheduler"].update(last_epoch=1)],
            "step = 1 but the folder is 'checkpoint-2'",
        ),
        (lambda s: s["scheduler"].update(last_epoch=7), "scheduler.last_epoch = 7 but step = 2"),
        (lambda s: s.pop("files"), "files and sha256 come together"),
        (lambda s: s["reader"].update(batch_size=0), "reader.batch_size = 0"),
    ],
)
def test_an_inconsistent_resealed_state_is_refused_before_anything_is_built(
    real: RealFiles, run: Path, edit: Any, message: str
) -> None:
    folder = run / "checkpoints" / "checkpoint-2"
    _edit_json(folder / "state.json", edit)
    state = json.loads((folder / "state.json").read_text())
    if "files" in state:
        _reseal(folder)
    _one_error(*_resume(real, run), "state.json", message)


def test_a_checkpoint_written_before_the_seal_still_resumes(real: RealFiles, run: Path) -> None:
    for folder in (run / "checkpoints").glob("checkpoint-*"):
        _edit_json(folder / "state.json", lambda s: [s.pop("files"), s.pop("sha256")])
    code, text = _cli(*real.train_args(real.wds, run, "--resume", "--steps", "3"))
    assert code == 0 and "resumed from" in text and "trained 3 steps" in text, text


def test_a_latest_pointer_outside_the_checkpoints_folder_is_refused(
    real: RealFiles, run: Path
) -> None:
    (run / "checkpoints" / "latest").write_text("../../elsewhere/checkpoint-2\n")
    _one_error(*_resume(real, run), "latest' holds '../../elsewhere/checkpoint-2'")


# ----------------------------------------------------------------------------- student folders


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(num_layers=10**9), "num_layers = 1000000000"),
        (lambda c: c.update(num_attention_heads=4096, attention_head_dim=4096), "parameters"),
        (lambda c: c.update(eps="tiny"), "eps must be a number"),
        (lambda c: c.update(unknown_key=1), "does not take: unknown_key"),
    ],
)
def test_a_bad_student_config_json_is_one_error_naming_it(
    real: RealFiles, tmp_path: Path, edit: Any, message: str
) -> None:
    student = Path(shutil.copytree(real.run / "student", tmp_path / "student"))
    _edit_json(student / "config.json", edit)
    code, text = _cli(
        "eval", "--cache", str(real.wds), "--student", str(student), "--out", str(tmp_path / "e"),
        "--split", "all",
    )  # fmt: skip
    _one_error(code, text, "student config", "config.json", message)
    assert not (tmp_path / "e").exists()


def test_a_student_config_file_that_is_not_an_object_names_the_file(
    real: RealFiles, tmp_path: Path
) -> None:
    conf = tmp_path / "s.json"
    conf.write_text('["num_layers", 2]')
    args = real.train_args(real.wds, tmp_path / "run", "--set", f'student.config_file="{conf}"')
    _one_error(*_cli(*args), f"student.config_file '{conf}'", "must be a JSON object")


def test_a_student_config_file_is_checked_with_load_json_file(tmp_path: Path) -> None:
    conf = tmp_path / "s.json"
    conf.write_text('{"num_layers": 2}')
    data, raw = load_json_file(conf, dict, what="student.config_file", fix="f")
    assert data == raw == {"num_layers": 2}


# ----------------------------------------------------------------------------- internal errors


def test_an_internal_error_is_one_line_and_a_crash_log_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import wandistill.cache.manifest as mf
    import wandistill.cli.entry as cli

    def bug(*a: Any, **k: Any) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(mf, "load_committed", bug)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    code, text = _cli("cache", "info", str(tmp_path))
    assert code == 1 and "Traceback" not in text and text.count("error:") == 1, text
    assert "internal error (ZeroDivisionError: division by zero)" in text
    logs = list(tmp_path.glob("wandistill-crash-*.log"))
    assert len(logs) == 1 and str(logs[0]) in text
    assert "Traceback" in logs[0].read_text() and "def bug" not in text
    monkeypatch.setattr(cli, "_debug", True)
    with pytest.raises(ZeroDivisionError):
        main(["cache", "info", str(tmp_path)])
    assert os.environ.get("WANDISTILL_DEBUG") is None or cli._debug


@pytest.mark.parametrize("cut", [3000, 100], ids=["header-cut", "last-tensor-cut"])
def test_export_of_a_run_with_truncated_student_weights_names_the_file(
    real: RealFiles, tmp_path: Path, cut: int
) -> None:
    run = Path(shutil.copytree(real.run, tmp_path / "run"))
    weights = run / "student_ema" / "diffusion_pytorch_model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, cut if cut > 1000 else size - cut)
    out = tmp_path / "pipe"
    code, text = _cli(
        "export", "--run", str(run), "--teacher", str(real.teacher), "--out", str(out)
    )
    assert code != 0 and text.count("error:") == 1 and "internal error" not in text, text
    assert str(weights) in text and not out.exists()


def test_export_copy_stops_at_the_first_file_it_cannot_copy_in_one_line(
    real: RealFiles, tmp_path: Path
) -> None:
    teacher = Path(shutil.copytree(real.teacher, tmp_path / "teacher", symlinks=True))
    (teacher / "vae" / "notes.txt").symlink_to(tmp_path / "gone")  # dangling
    out = tmp_path / "pipe"
    code, text = _cli(
        "export", "--run", str(real.run), "--teacher", str(teacher), "--out", str(out), "--copy"
    )
    assert code != 0 and text.count("error:") == 1 and "[(" not in text, text
    assert str(teacher / "vae" / "notes.txt") in text
    left = {p.name for p in out.iterdir()} if out.exists() else set()
    assert left <= {".wandistill.json", ".wandistill.lock", ".wandistill.holder.json"}, left


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["eval", "sample"])
def test_device_cuda_on_a_cpu_machine_names_device_not_placement(
    real: RealFiles, tmp_path: Path, command: str
) -> None:
    args = {
        "eval": ["eval", "--cache", str(real.wds), "--split", "all"],
        "sample": ["sample", "--prompts", str(real.root / "prompts.txt")],
    }[command]
    code, text = _cli(
        *args, "--run", str(real.run), "--out", str(tmp_path / "o"), "--device", "cuda"
    )
    assert code == 2 and "--device 'cuda' needs CUDA" in text and "--placement" not in text, text
