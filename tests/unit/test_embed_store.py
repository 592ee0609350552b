"""The encode phase's embedding store: committed shard by shard, read back checked, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wandistill.cache.embeds import EMBED_DIR, EmbedStore, negative_name
from wandistill.errors import CacheError


def _emb(i: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(3 + i % 5, 8, generator=g).to(dtype)


def test_embeddings_come_back_bit_exact_from_committed_shards(tmp_path: Path) -> None:
    store = EmbedStore(tmp_path, flush_records=2)
    for i in range(5):
        store.add(f"k{i}", _emb(i), truncated=i == 3)
        if store.full():
            store.flush()
    store.add(negative_name(""), _emb(99, torch.float32))
    store.flush()
    again = EmbedStore(tmp_path)  # a new run (resume) sees every committed embedding
    assert sorted(again.index.names()) == sorted([*(f"k{i}" for i in range(5)), negative_name("")])
    for i in range(5):
        got = again.get(f"k{i}")
        assert got.dtype == torch.bfloat16 and torch.equal(
            got.view(torch.int16), _emb(i).view(torch.int16)
        )
    assert again.truncated_keys().names() == ["k3"]
    assert len(list((tmp_path / EMBED_DIR).glob("*.safetensors"))) == 3


def test_a_shard_without_its_commit_record_is_ignored_and_overwritten(tmp_path: Path) -> None:
    store = EmbedStore(tmp_path, flush_records=1)
    store.add("a", _emb(1))
    store.flush()
    store.add("b", _emb(2))
    store.flush()
    (tmp_path / EMBED_DIR / "r00000-000001.json").unlink()  # killed between publish and commit
    again = EmbedStore(tmp_path, flush_records=1)
    assert set(again.index.names()) == {"a"} and not again.has("b")
    again.add("b", _emb(2))
    again.flush()  # same sequence number: the uncommitted file is replaced
    assert set(EmbedStore(tmp_path).index.names()) == {"a", "b"}


def test_every_rank_sees_every_ranks_commits_and_numbers_its_own(tmp_path: Path) -> None:
    for rank in (0, 1):
        store = EmbedStore(tmp_path, rank=rank, flush_records=1)
        store.add(f"r{rank}", _emb(rank))
        store.flush()
    one = EmbedStore(tmp_path, rank=1, flush_records=1)
    assert set(one.index.names()) == {"r0", "r1"}
    one.add("r1b", _emb(5))
    one.flush()
    assert (tmp_path / EMBED_DIR / "r00001-000001.safetensors").is_file()


def test_a_flipped_byte_in_an_embedding_is_an_error_naming_the_shard(tmp_path: Path) -> None:
    store = EmbedStore(tmp_path, flush_records=1)
    store.add("a", _emb(1, torch.float32))
    store.flush()
    path = tmp_path / EMBED_DIR / "r00000-000000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"r00000-000000.safetensors.*fails its crc32c") as info:
        EmbedStore(tmp_path).get("a")
    assert "r00000-000000.json" in (info.value.fix or "")


def test_a_truncated_or_edited_commit_record_only_means_encoding_again(tmp_path: Path) -> None:
    store = EmbedStore(tmp_path, flush_records=1)
    store.add("a", _emb(1))
    store.flush()
    side = tmp_path / EMBED_DIR / "r00000-000000.json"
    data = json.loads(side.read_text())
    side.write_text(json.dumps({**data, "bytes": data["bytes"] + 1}))
    assert not EmbedStore(tmp_path).has("a")
    side.write_text("{not json")
    assert not EmbedStore(tmp_path).has("a")
    store.remove()
    assert not (tmp_path / EMBED_DIR).exists()


def test_the_name_index_holds_record_keys_compactly_and_finds_every_name() -> None:
    from wandistill.cache.embeds import NameIndex

    keys = [f"{i:032x}" for i in range(0, 20_000, 3)]
    index = NameIndex()
    for pos, key in enumerate(keys):
        index.add(key, pos // 100)
        index.add(f"{key}.negative", 7)
    index.add(negative_name("x"), 5)
    index.add(keys[0], 99)  # first one wins
    assert index.get(keys[0]) == 0 and index.get(keys[-1]) == (len(keys) - 1) // 100
    assert index.get(f"{keys[5]}.negative") == 7 and index.get(negative_name("x")) == 5
    assert f"{1:032x}" not in index and "not-a-key" not in index
    assert f"{0x100:032x}" not in index  # ends in a zero byte: no padding confusion
    assert len(index.names()) == 2 * len(keys) + 1


def test_the_name_index_agrees_with_a_dict_over_many_merges_in_random_order() -> None:
    import random

    from wandistill.cache.keyindex import NameIndex

    rng = random.Random(7)
    index, model = NameIndex(), {}
    names = [f"{rng.getrandbits(128):032x}" for _ in range(60_000)]
    names += [f"{n}.negative" for n in names[:5_000]]
    for pos in range(90_000):  # repeats too: the first position added wins
        name = rng.choice(names)
        index.add(name, pos)
        model.setdefault(name, pos)
        if pos % 20_000 == 0:  # lookups between merges see merged and pending names alike
            assert all(index.get(n) == model.get(n) for n in rng.sample(names, 500))
    assert all(index.get(n) == model.get(n) for n in names)
    assert sorted(index.names()) == sorted(model) and len(index) == len(model)
