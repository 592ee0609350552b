"""Cache storage options: stored dtype per trajectory field (fp8 with a per-step scale, bf16,
fp16), zstd for zarr, declared in the sealed fields and decoded by every documented reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
import zarr

from wandistill.cache.encoding import FP8_MAX, Encoding, fp8_decode, fp8_encode
from wandistill.cache.footprint import footprint
from wandistill.cache.reader import open_cache
from wandistill.cache.wds.decoder import safe_decoder
from wandistill.cli import main
from wandistill.config import CacheConfig
from wandistill.errors import CacheMismatchError, ConfigError

from cachefixtures import make_record, write_cache

TRAJ = ["xt", "teacher_out", "final_latent", "feature.b0"]
BOUND = {"fp8": 1 / 16, "bf16": 2**-8, "fp16": 2**-10}
"""Largest error relative to the tensor's (step's) largest magnitude: half a unit in the last
place of each format's mantissa (e4m3: 3 bits, bf16: 7, fp16: 10)."""


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp16"])
def test_stored_dtype_is_declared_and_read_back_as_the_computed_dtype(
    tmp_path: Path, backend: str, dtype: str
) -> None:
    write_cache(
        tmp_path, range(3), backend=backend, encoding=Encoding(dtype=dtype), features=("b0",)
    )
    with open_cache(tmp_path) as store:
        specs = {f.name: f for f in store.manifest.fields}
        assert specs["xt"].decoded == "float32" and specs["noise"].decoded is None
        assert specs["xt"].scaled == (dtype == "fp8")
        assert store.verify() == []
        entry = store.entries[0]
        want = make_record(1, features=("b0",))
        got = store.read_sample(entry, 1, 2, [*TRAJ, "noise"], pad=False)
        for name in TRAJ:
            ref = want.tensors()[name]
            ref = ref[2] if name != "final_latent" else ref
            assert got[name].dtype == torch.float32
            err = (got[name] - ref).abs().max() / ref.abs().max()
            assert 0 < err <= BOUND[dtype], (name, err)
        assert torch.equal(got["noise"], want.noise)  # not a trajectory field: untouched
        record = store.read_record(entry, 1)
        assert record.scales == {} and record.xt.dtype == torch.float32


def test_fp8_scale_is_per_recorded_step_and_zero_stays_zero() -> None:
    x = torch.stack([torch.full((4, 4), 1000.0), torch.full((4, 4), 1e-3), torch.zeros(4, 4)])
    q, scale = fp8_encode(x, per_step=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3,)
    assert scale[2] == 1 and scale[0] == 1000.0 / FP8_MAX
    back = fp8_decode(q, scale, torch.float32)
    assert torch.allclose(back, x, rtol=1 / 16)  # the tiny step keeps its own precision
    one, s = fp8_encode(x[1], per_step=False)
    assert s.shape == () and torch.allclose(fp8_decode(one, s, torch.float32), x[1], rtol=1 / 16)


def test_resume_with_another_storage_choice_is_refused_naming_fields(tmp_path: Path) -> None:
    write_cache(tmp_path, range(2), encoding=Encoding(dtype="fp8"), finalize=False, complete=False)
    with pytest.raises(CacheMismatchError, match=r"(?s)different fields.*xt:bfloat16"):
        write_cache(tmp_path, range(2, 4), encoding=Encoding(dtype="bf16"))


def test_zstd_zarr_cache_reads_with_stock_zarr(tmp_path: Path) -> None:
    encoding = Encoding(dtype="fp8", dtypes=(("final_latent", "fp32"),), compression="zstd")
    write_cache(tmp_path, range(3), backend="zarr", encoding=encoding)
    group = zarr.open_group(tmp_path / "data.zarr", mode="r")
    codecs = [c["name"] for c in group["xt"].metadata.to_dict()["codecs"]]
    assert codecs == ["sharding_indexed"]
    inner = group["xt"].metadata.to_dict()["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "zstd", "crc32c"]
    assert group["xt"].attrs["wandistill_dtype"] == "float8_e4m3fn"
    with open_cache(tmp_path) as store:
        entry = store.entries[0]
        row = store.read_sample(entry, 2, 1, ["xt", "final_latent"], pad=False)
    # The documented stock decode: fp8 bits as uint8, times the step's scale.
    bits = np.asarray(group["xt"][2, 1])
    stock = torch.from_numpy(bits).view(torch.float8_e4m3fn).float() * float(
        group["scale.xt"][2, 1]
    )
    assert torch.equal(stock, row["xt"])
    assert torch.equal(torch.from_numpy(np.asarray(group["final_latent"][2])), row["final_latent"])


def test_stock_webdataset_decoder_decodes_with_the_cache(tmp_path: Path) -> None:
    write_cache(tmp_path, range(3), encoding=Encoding(dtype="fp8"))
    tars = sorted(str(p) for p in (tmp_path / "shards").glob("*.tar"))
    raw = next(iter(wds.WebDataset(tars, shardshuffle=False).decode(safe_decoder())))
    assert raw["safetensors"]["xt"].dtype == torch.float8_e4m3fn  # as stored, scale beside it
    assert "scale.xt" in raw["safetensors"]
    ds = wds.WebDataset(tars, shardshuffle=False).decode(safe_decoder(cache=tmp_path))
    sample = next(iter(ds))
    with open_cache(tmp_path) as store:
        want = store.read_key(sample["__key__"])
    tensors = sample["safetensors"]
    assert "scale.xt" not in tensors and torch.equal(tensors["xt"], want.xt)


def test_bad_storage_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="needs cache.backend = 'zarr'"):
        CacheConfig(backend="webdataset", compression="zstd")
    with pytest.raises(ConfigError, match="store_dtype='fp4'"):
        CacheConfig(store_dtype="fp4")
    with pytest.raises(ConfigError, match=r"store_dtypes.noise='bf16'"):
        CacheConfig(store_dtypes={"noise": "bf16"})
    storage = CacheConfig(backend="zarr", store_dtypes={"xt": "fp8"}, compression="zstd").encoding()
    assert storage.stored("xt") == "float8_e4m3fn" and storage.stored("teacher_out") is None


def test_footprint_projects_bytes_per_field_to_wan_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(tmp_path, range(3), encoding=Encoding(dtype="fp8"))
    main(["cache", "info", str(tmp_path)])
    out = capsys.readouterr().out
    assert "480p" in out and "720p" in out and "x 100,000 records" in out and "scale" in out
    fp = footprint(tmp_path)
    assert fp is not None
    steps, latent = 3, 16 * 21 * 60 * 104
    assert fp.here["xt"] == steps * 16 * 16 + 4 * steps  # fp8 bytes + float32 scale per step
    assert fp.projected["480p"]["xt"] == steps * latent + 4 * steps
    assert fp.projected["720p"]["noise"] == 16 * 21 * 90 * 160 * 4  # fp32, not a trajectory
    assert fp.projected["480p"]["prompt_embeds"] == round(fp.embed_len * 4096 * 2)


def _fp8_reference(t: torch.Tensor, per_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, spelled out in float32: scale = max |t| / FP8_MAX (per step), 1 for 0."""
    x = t.float()
    rows = per_step and x.dim() >= 1
    n = x.shape[0] if rows else 1
    amax = x.abs().reshape(n, -1).amax(dim=1) if x.numel() else torch.zeros(n)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = scale if rows else scale.reshape(())
    view = scale.reshape(-1, *([1] * (x.dim() - 1))) if rows else scale
    return (x / view).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_step", [True, False])
def test_fp8_encode_is_bit_identical_to_its_float32_definition(
    dtype: torch.dtype, per_step: bool
) -> None:
    torch.manual_seed(0)
    mixed = torch.randn(3, 8) * 50
    mixed[1] = 0
    mixed[2, 3] = -6e4
    cases = [
        torch.randn(4, 5, 2, 3) * 100,
        mixed,
        -torch.rand(2, 5),
        torch.zeros(0, 4),
        torch.zeros(3, 0),
        torch.tensor(3.5),
        torch.tensor(0.0),
        torch.randn(4, 6).t(),
    ]
    for t in cases:
        t = t.to(dtype)
        q, scale = fp8_encode(t, per_step=per_step)
        want_q, want_scale = _fp8_reference(t, per_step)
        assert q.shape == t.shape and scale.dtype == torch.float32
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
