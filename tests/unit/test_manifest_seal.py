"""The manifest is sealed, and a resumed cache never mixes records computed differently.

Every block that defines what the records mean (teacher, settings, numerics, fields, dims,
shared, ...) carries a sha256 in `header_sha256`; a hand edit is one clear error on every open
(`cache info`, `cache verify`, `train`). `numerics` (batch size, threads, library versions,
device, math flags) joins the settings in the resume check. Schema 1 caches stay readable but
are not resumed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from wandistill.cache.contract import SCHEMA_VERSION
from wandistill.cache.files import SEALED
from wandistill.cache.manifest import HEADER_DIGEST, header_digests, read_manifest
from wandistill.cache.seal import seal_entry
from wandistill.precompute.numerics import record_numerics

from cachefixtures import write_cache
from clirun import run_cli_text as _cli
from realfiles import RealFiles, real_files, tree_digest


def _edit(cache: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = cache / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    write_cache(tmp_path / "c", range(4), shard_records=2)
    return tmp_path / "c"


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealFiles:
    return real_files(tmp_path_factory.mktemp("real"))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "format": lambda m: None,  # cannot change without being another file: covered below
    "schema_version": lambda m: None,
    "wandistill_version": lambda m: m.update(wandistill_version="9.9.9"),
    "backend": lambda m: None,  # another backend is another entry schema: refused by schema
    "created": lambda m: m.update(created="2001-01-01T00:00:00Z"),
    "teacher": lambda m: m["teacher"].update(fingerprint="e" * 64),
    "settings": lambda m: m["settings"].update(max_sequence_length=25),
    "numerics": lambda m: m["numerics"].update(batch_size=3),
    "fields": lambda m: m["fields"][0].update(doc="edited"),
    "dims": lambda m: m["dims"].update(text_dim=64),
    "shared": lambda m: m["shared"].update(sha256="0" * 64),
}


@pytest.mark.parametrize("block", [b for b in SEALED if b not in ("format", "schema_version")])
def test_a_hand_edit_of_any_sealed_block_is_one_error_naming_it_on_every_open(
    cache: Path, tmp_path: Path, block: str
) -> None:
    if block == "backend":  # entries are checked when used: the seal names the edit first
        _edit(cache, lambda m: m.update(backend="zarr"))
    else:
        _edit(cache, EDITS[block])
    want = f"{block} changed after the cache was written"
    before = tree_digest(cache)
    for args in (
        ["cache", "info", str(cache)],
        ["cache", "verify", str(cache)],
        ["train", "--cache", str(cache), "--out", str(tmp_path / "run")],
    ):
        code, text = _cli(*args)
        assert code == 1 and "Traceback" not in text, (args, text)
        assert text.count("error:") == 1 and "manifest.json" in text and want in text, text
        assert "fix: restore manifest.json" in text
    assert tree_digest(cache) == before and not (tmp_path / "run").exists()


def test_the_seal_covers_exactly_the_header_and_a_finalized_cache_keeps_it(cache: Path) -> None:
    data = json.loads((cache / "manifest.json").read_text())
    assert sorted(data[HEADER_DIGEST]) == sorted(SEALED)
    assert {"complete", "shards"}.isdisjoint(data[HEADER_DIGEST])
    # A cache still being written has the same seal as once finalized: shards/complete change.
    assert read_manifest(cache).complete and data["numerics"] == {}


def test_removing_the_seal_or_faking_schema_1_is_refused(cache: Path) -> None:
    _edit(cache, lambda m: m.pop(HEADER_DIGEST))
    code, text = _cli("cache", "info", str(cache))
    assert code == 1 and "header_sha256" in text and text.count("error:") == 1, text
    _edit(cache, lambda m: m.update(schema_version=1, header_sha256={"dims": "0" * 64}))
    code, text = _cli("cache", "info", str(cache))
    assert (
        code == 1 and f"has cache schema 1, this wandistill reads schema {SCHEMA_VERSION}" in text
    )


def _as_schema(cache: Path, version: int) -> Callable[[dict[str, Any]], None]:
    """What pre-release wandistill wrote: schemas 1-2 listed webdataset shards by the whole
    file's sha256; schema 1 had no seal and no numerics."""

    def edit(m: dict[str, Any]) -> None:
        for e in m["shards"]:
            e.pop("frame_sha256", None)
            e["sha256"] = hashlib.sha256((cache / e["file"]).read_bytes()).hexdigest()
            seal_entry(e)
        m["schema_version"] = version
        if version == 1:
            del m["numerics"], m[HEADER_DIGEST]
        else:
            m[HEADER_DIGEST] = header_digests(m)

    return edit


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_schema_cache_is_refused_in_one_line_naming_the_rebuild(
    real: RealFiles, tmp_path: Path, version: int
) -> None:
    import shutil

    old = Path(shutil.copytree(real.wds, tmp_path / "old"))
    _edit(old, _as_schema(old, version))
    before = tree_digest(old)
    for args in (("cache", "verify", str(old)), tuple(real.train_args(old, tmp_path / "run"))):
        code, text = _cli(*args)
        assert code == 1 and text.count("error:") == 1 and "Traceback" not in text, text
        assert f"has cache schema {version}, this wandistill reads schema 3 only" in text, text
        assert "fix: rebuild the cache" in text, text
    code, text = _precompute(real, old)
    assert code != 0 and text.count("error:") == 1 and "fix: rebuild the cache" in text, text
    assert tree_digest(old) == before


def _precompute(real: RealFiles, cache: Path, *sets: str) -> tuple[int, str]:
    base = [
        "sampler.num_inference_steps=2",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.batch_size=2",
        "cache.shard_records=2",
        "cache.holdout_fraction=0.0",
        "previews=0",
        *sets,
    ]
    args = ["precompute", "pipelines/tiny.toml", "--teacher", str(real.teacher)]
    args += ["--prompts", str(real.root / "prompts.txt"), "--out", str(cache)]
    return _cli(*args, *(x for s in base for x in ("--set", s)))


def test_resuming_with_numerics_that_change_the_bits_is_refused_before_any_weight_loads(
    real: RealFiles, tmp_path: Path
) -> None:
    import shutil

    cache = Path(shutil.copytree(real.wds, tmp_path / "c"))
    before = tree_digest(cache)
    code, text = _precompute(real, cache, "sampler.batch_size=1")
    assert code == 2 and text.count("error:") == 1 and text.count("fix:") == 1, text
    assert "numerics.batch_size: cache has 2, this run has 1" in text
    assert "OMP_NUM_THREADS" in text  # the fix says how to match the cache
    assert tree_digest(cache) == before


def test_resuming_from_another_thread_count_computes_with_the_cache_s_count(
    real: RealFiles, tmp_path: Path, restore_threads: None
) -> None:
    """torchrun gives each rank one thread; a cache a single process wrote with more is
    resumed with its own count (the bits depend on it), said once, instead of refused."""
    import shutil

    cache = Path(shutil.copytree(real.wds, tmp_path / "c"))
    threads = read_manifest(cache).numerics["intra_op_threads"]
    torch.set_num_threads(threads + 1)
    before = tree_digest(cache)
    code, text = _precompute(real, cache)
    assert code == 0 and "0 records written" in text, text
    assert text.count(f"precompute: {threads} intra-op threads per process (was {threads + 1})")
    assert torch.get_num_threads() == threads
    assert tree_digest(cache) == before


def test_resuming_with_the_same_numerics_adds_nothing_and_changes_nothing(
    real: RealFiles, tmp_path: Path
) -> None:
    import shutil

    cache = Path(shutil.copytree(real.wds, tmp_path / "c"))
    before = tree_digest(cache)
    code, text = _precompute(real, cache)
    assert code == 0 and "0 records written" in text, text
    assert "prompts/s" not in text and "s/prompts" not in text  # nothing computed, no rate
    assert tree_digest(cache) == before


def test_numerics_name_what_changes_the_bits_on_this_device() -> None:
    cpu = record_numerics(batch_size=4, device=torch.device("cpu"))
    assert cpu["batch_size"] == 4 and cpu["device"] == "cpu"
    assert cpu["intra_op_threads"] == torch.get_num_threads()
    assert cpu["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for key in ("torch", "diffusers", "transformers", "mkldnn", "env.MKL_CBWR"):
        assert key in cpu
    assert "env.ATEN_CPU_CAPABILITY" in cpu and "float32_matmul_precision" in cpu
