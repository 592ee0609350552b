"""The snippets in docs/cache-format.md read real caches with stock webdataset / zarr only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from wandistill.cache.manifest import load_committed
from wandistill.cache.wds.decoder import CorruptMemberError, safe_decoder

from cachefixtures import make_record, write_cache

DOC = Path(__file__).parents[2] / "docs" / "cache-format.md"


def _snippet(name: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.+?)\n```", text, flags=re.S)
    assert match, f"docs/cache-format.md lost its {name} snippet"
    return match.group(1)


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_the_documented_snippet_reads_every_record(tmp_path: Path, backend: str) -> None:
    write_cache(tmp_path, range(5), backend=backend, shard_records=2, latent_dtype=torch.bfloat16)
    code = _snippet(backend)
    # Run the snippet, then check it saw the right tensors.
    code = code.replace("    assert", "    seen.append((xt_step0, locals().get('key'))); assert", 1)
    scope: dict[str, object] = {"cache": str(tmp_path), "seen": []}
    exec(compile(code, f"docs/cache-format.md:{backend}", "exec"), scope)
    seen = scope["seen"]
    assert isinstance(seen, list) and len(seen) == 5
    want = {
        make_record(i, latent_dtype=torch.bfloat16).xt[0].view(torch.int16).sum().item()
        for i in range(5)
    }
    got = {t.view(torch.int16).sum().item() for t, _ in seen}
    assert got == want and all(t.dtype == torch.bfloat16 for t, _ in seen)


def test_webdataset_default_decoders_are_never_needed(tmp_path: Path) -> None:
    """Members are .json and .safetensors only: nothing a pickle-based decoder would touch."""
    import tarfile

    write_cache(tmp_path, range(3), shard_records=3)
    for tar_path in (tmp_path / "shards").glob("*.tar"):
        with tarfile.open(tar_path) as tar:
            assert {Path(m.name).suffix for m in tar.getmembers()} == {".json", ".safetensors"}


def _flip_data_byte(cache: Path, record: int, back: int) -> None:
    """Flip one byte `back` bytes before the end of a record's .safetensors member (tensor data,
    not the header): the tar stays well-formed, only the numbers change."""
    entry = load_committed(cache).shards[0]
    offset, length = entry.offsets[record][:2]
    path = cache / entry.file
    data = bytearray(path.read_bytes())
    data[offset + length - back] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("back", [1, 200])
def test_the_documented_snippet_raises_on_a_flipped_byte_instead_of_returning_wrong_numbers(
    tmp_path: Path, back: int
) -> None:
    write_cache(tmp_path, range(3), shard_records=3)
    _flip_data_byte(tmp_path, 1, back)
    code = _snippet("webdataset")
    with pytest.raises(CorruptMemberError, match=r"record \w+: tensor '\w+'.* fails its crc32c"):
        exec(compile(code, "docs/cache-format.md:webdataset", "exec"), {"cache": str(tmp_path)})


def test_verify_false_returns_the_damaged_numbers_the_check_would_have_caught(
    tmp_path: Path,
) -> None:
    import webdataset as wds

    write_cache(tmp_path, range(2), shard_records=2)
    _flip_data_byte(tmp_path, 0, 1)
    url = str(next((tmp_path / "shards").glob("*.tar")))
    samples = list(wds.WebDataset(url, shardshuffle=False).decode(safe_decoder(verify=False)))
    got = samples[0]["safetensors"]
    want = make_record(0).tensors()
    assert any(not torch.equal(got[k], want[k]) for k in want)  # wrong numbers, unchecked
    with pytest.raises(CorruptMemberError):
        list(wds.WebDataset(url, shardshuffle=False).map(safe_decoder()))
