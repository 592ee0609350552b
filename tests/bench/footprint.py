#!/usr/bin/env python
"""Cache footprint: bytes per record of each storage choice against a naive layout, and the
reconstruction error of each stored dtype.

    python tests/bench/footprint.py --out /tmp/footprint

Records are flow-matching trajectories with Wan's structure (not a teacher's output: the bench
needs no weights): a spatially smooth clean latent x0 (16 channels, per-channel offset and scale),
Gaussian noise, Wan's shifted sigma schedule (50 steps, shift 5), x_t = (1 - s) x0 + s noise and
the velocity teacher_out = noise - x0; the final latent is x0. The prompt embedding is a
~100-token UMT5-width (4096) tensor, the length of a typical one- or two-sentence prompt.

Each layout is written through CacheWriter (the real backends, --records records, one shard) at
latent 16x21x15x26 (a quarter of 480p's height and width: same frames and channels), and its
bytes per record read from the manifest. The same function `wandistill cache info` uses
(encoding.projected_bytes) projects each layout to real Wan 480p (16x21x60x104) and 720p
(16x21x90x160); compression is measured at the small shape only.

naive    fp32 everything, prompt embedding padded to 512 tokens, every one of the 50 steps.
The other rows record the shipped Wan 2.1 recipes' 8 steps ([0, 7, ..., 49]) with a trimmed
embedding; `model` stores what a bf16 teacher computes (x_t, teacher output, features in bf16, the
final latent in fp32); bf16/fp16/fp8 also store the final latent so.

Reconstruction error (max abs, relative RMS = ||decoded - x|| / ||x||) is of x_t, teacher output
and final latent stored from fp32, per dtype, over every recorded step.

Not a pytest test (tests/bench is excluded from collection).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import machine_line, write_json  # tests/bench, next to this script

from wandistill.cache.contract import Record, field_specs, record_key
from wandistill.cache.encoding import STORE_DTYPES, Encoding
from wandistill.cache.footprint import WAN_SIZES, projected_bytes
from wandistill.cache.reader import open_cache
from wandistill.cache.writer import CacheWriter

STEPS = 50
RECORDED = [0, 7, 14, 21, 28, 35, 42, 49]
SHAPE = (16, 21, 15, 26)
TOKENS = 100
TEXT_DIM = 4096
SHIFT = 5.0


def sigmas() -> torch.Tensor:
    t = torch.linspace(1, 0, STEPS + 1)[:-1]
    return SHIFT * t / (1 + (SHIFT - 1) * t)


def trajectory(seed: int, steps: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c, f, h, w = SHAPE
    low = torch.randn(c, f, h // 4 + 1, w // 4 + 1, generator=g)
    x0 = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    x0 = x0 * (0.5 + torch.rand(c, 1, 1, 1, generator=g)) + 0.3 * torch.randn(c, 1, 1, 1)
    x0 = x0 + 0.1 * torch.randn(SHAPE, generator=g)  # fine detail
    noise = torch.randn(SHAPE, generator=g)
    s = sigmas()[steps].reshape(-1, 1, 1, 1, 1)
    return {
        "noise": noise,
        "xt": (1 - s) * x0 + s * noise,
        "teacher_out": (noise - x0).expand(len(steps), *SHAPE).clone(),
        "final_latent": x0,
        "timesteps": sigmas()[steps] * 1000,
        "prompt_embeds": 0.05 * torch.randn(TOKENS, TEXT_DIM, generator=g),
    }


LAYOUTS = {
    # name: (backend, teacher dtype, recorded steps, padded tokens, storage)
    "naive (fp32, pad 512, 50 steps)": ("webdataset", torch.float32, list(range(STEPS)), 512, None),
    "model (bf16 teacher), webdataset": ("webdataset", torch.bfloat16, RECORDED, 0, "model"),
    "bf16, webdataset": ("webdataset", torch.bfloat16, RECORDED, 0, "bf16"),
    "fp16, webdataset": ("webdataset", torch.bfloat16, RECORDED, 0, "fp16"),
    "fp8, webdataset": ("webdataset", torch.bfloat16, RECORDED, 0, "fp8"),
    "fp8, zarr": ("zarr", torch.bfloat16, RECORDED, 0, "fp8"),
    "bf16 + zstd-3, zarr": ("zarr", torch.bfloat16, RECORDED, 0, "bf16+zstd"),
    "fp8 + zstd-3, zarr": ("zarr", torch.bfloat16, RECORDED, 0, "fp8+zstd"),
}


def record(i: int, dtype: torch.dtype, steps: list[int], pad: int) -> Record:
    t = trajectory(i, steps)
    embeds = t["prompt_embeds"]
    if pad:
        embeds = torch.cat([embeds, embeds.new_zeros(pad - embeds.shape[0], TEXT_DIM)])
    return Record(
        key=record_key(f"prompt {i}", i, {}),
        prompt=f"prompt {i}",
        seed=i,
        prompt_embeds=embeds.to(dtype),
        noise=t["noise"],
        timesteps=t["timesteps"],
        xt=t["xt"].to(dtype),
        teacher_out=t["teacher_out"].to(dtype),
        final_latent=t["final_latent"],
    )


def write(out: Path, name: str, records: int) -> dict[str, object]:
    backend, dtype, steps, pad, choice = LAYOUTS[name]
    dtype_choice, _, codec = (choice or "model").partition("+")
    storage = Encoding(dtype=dtype_choice, compression=codec or "none")
    fields = storage.apply(
        field_specs(latent_dtype=torch.float32, model_dtype=dtype, embed_dtype=dtype, features=[])
    )
    path = out / name.split(" ")[0].replace(",", "") / backend / (codec or "raw")
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    writer = CacheWriter(
        path,
        backend=backend,
        teacher={"fingerprint": "f" * 64},
        settings={"record_steps": steps, "num_inference_steps": STEPS},
        fields=fields,
        shard_records=records,
    )
    first = None
    for i in range(records):
        rec = record(i, dtype, steps, pad)
        first = first or writer.codec.encode(rec).tensors()
        writer.write(rec)
    writer.close(finalize=True, complete=True)
    seconds = time.perf_counter() - t0
    with open_cache(path) as store:
        per_record = store.manifest.num_bytes / len(store)
    tokens = pad or TOKENS
    assert first is not None
    projected = {k: sum(projected_bytes(first, v, tokens).values()) for k, v in WAN_SIZES.items()}
    return {"bytes": per_record, "projected": projected, "write_s": seconds}


def errors() -> dict[str, dict[str, tuple[float, float]]]:
    """Per stored dtype and field: (max abs error, relative RMS) against fp32."""
    t = trajectory(0, RECORDED)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for choice in ("bf16", "fp16", "fp8"):
        fields = Encoding(dtype=choice).apply(
            field_specs(latent_dtype=torch.float32, embed_dtype=torch.float32, features=[])
        )
        from wandistill.cache.encoding import RecordCodec

        codec = RecordCodec(fields)
        rec = Record(key="k", prompt="p", seed=0, **t)  # type: ignore[arg-type]
        back = codec.decode(codec.encode(rec).tensors())
        row = {}
        for name in ("xt", "teacher_out", "final_latent"):
            x, y = t[name], back[name]
            row[name] = (
                float((y - x).abs().max()),
                float((y - x).pow(2).sum().sqrt() / x.pow(2).sum().sqrt()),
            )
        out[f"{choice} ({STORE_DTYPES[choice]})"] = row
    return out


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/wandistill-footprint"))
    ap.add_argument("--records", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {name: write(args.out, name, args.records) for name in LAYOUTS}
    naive = results[next(iter(LAYOUTS))]
    print(machine_line())
    print(
        f"\n| layout | bytes/record at {'x'.join(map(str, SHAPE))} | x naive | 480p | x naive "
        "| 720p | x naive |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        proj = r["projected"]
        cells = [human(r["bytes"]), f"{r['bytes'] / naive['bytes']:.3f}"]  # type: ignore[operator]
        for size in WAN_SIZES:
            ratio = proj[size] / naive["projected"][size]  # type: ignore[index]
            cells += [human(proj[size]), f"{ratio:.3f}"]  # type: ignore[index]
        print(f"| {name} | " + " | ".join(cells) + " |")
    errs = errors()
    print("\n| stored dtype | field | max abs error | relative RMS |")
    print("|---|---|---:|---:|")
    for choice, row in errs.items():
        for field, (mx, rms) in row.items():
            print(f"| {choice} | {field} | {mx:.3g} | {rms:.3g} |")
    if args.json:
        write_json(args.json, {"layouts": results, "errors": errs})
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
