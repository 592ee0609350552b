"""Benchmark: `cache merge` on an object store, against moto's S3 server on 127.0.0.1.

Writes --caches caches of --records synthetic records each (Wan-like tensors, latents of
--latent C,F,H,W in float32) to S3 and to local folders, then merges them three ways: S3 -> S3
(the store copies each shard: CopyObject), local -> S3 (shards uploaded through the client) and
S3 -> local (shards downloaded through it). For each it reports the wall time, records/s, and
what the S3 server counted: requests by operation and the body bytes clients sent (uploaded)
and received (downloaded), beside the inputs' total shard bytes. The download column includes
the verification of every input shard, which reads each byte once (twice for zarr: its sha256,
then the records).

Moto on localhost has no network and keeps objects in this process's memory: wall times say
nothing about a real S3, and only the byte and request counts transfer.

    python tests/bench/s3_merge.py --caches 3 --records 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from harness import machine_line, write_json  # noqa: E402  (tests/bench)

from wandistill.cache import CacheWriter, Record, record_key  # noqa: E402
from wandistill.cache.contract import field_specs  # noqa: E402
from wandistill.cache.merge import MergeConfig, merge  # noqa: E402

from cachefixtures import SETTINGS, TEACHER  # noqa: E402
from s3server import BUCKET, s3_server, traffic  # noqa: E402


def record(i: int, latent: tuple[int, ...]) -> Record:
    g = torch.Generator().manual_seed(i)
    steps = len(SETTINGS["record_steps"])
    return Record(
        key=record_key(f"prompt {i}", i, SETTINGS),
        prompt=f"prompt {i}",
        seed=i,
        prompt_embeds=torch.randn(8 + i % 9, 32, generator=g).to(torch.bfloat16),
        noise=torch.randn(*latent, generator=g),
        timesteps=torch.tensor([999.0, 500.0, 250.0][:steps]),
        xt=torch.randn(steps, *latent, generator=g),
        teacher_out=torch.randn(steps, *latent, generator=g),
        final_latent=torch.randn(*latent, generator=g),
    )


def write(where: str | Path, keys: range, latent: tuple[int, ...], backend: str) -> None:
    writer = CacheWriter(
        where,
        backend=backend,
        teacher=TEACHER,
        settings=SETTINGS,
        dims={
            "text_dim": 32,
            "latent_channels": latent[0],
            "latent_shape": list(latent),
            "num_recorded_steps": len(SETTINGS["record_steps"]),
        },
        fields=field_specs(latent_dtype=torch.float32, embed_dtype=torch.bfloat16, features=[]),
        shared={"negative_prompt_embeds": torch.zeros(5, 32), "sigmas": torch.linspace(1, 0, 5)},
        shard_records=16,
    )
    for i in keys:
        writer.write(record(i, latent))
    writer.close(finalize=True, complete=True)


def shard_bytes(url: str) -> int:
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return sum(
        fs.size(n) for n in fs.find(root) if "/shards/" in n or ("/data.zarr/" in n and "/c/" in n)
    )


def leg(name: str, inputs: list[str | Path], out: str | Path, total: int) -> dict:
    traffic.reset()
    t0 = time.perf_counter()
    s = merge(MergeConfig(inputs=tuple(inputs), out=out))
    wall = time.perf_counter() - t0
    row = {
        "leg": name,
        "records": s.records,
        "wall_s": round(wall, 2),
        "records_per_s": round(s.records / wall, 1),
        "shards": {"server": s.server_copied, "client": s.copied, "rewritten": s.rewritten},
        "input_shard_bytes": total,
        "uploaded": traffic.uploaded,
        "downloaded": traffic.downloaded,
        "uploaded_x": round(traffic.uploaded / total, 3),
        "downloaded_x": round(traffic.downloaded / total, 3),
        "calls": dict(sorted(traffic.calls.items())),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", type=int, default=3)
    ap.add_argument("--records", type=int, default=64, help="records per input cache")
    ap.add_argument("--latent", default="16,4,32,32", help="C,F,H,W of each latent")
    ap.add_argument("--backend", default="webdataset", choices=["webdataset", "zarr"])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    print(f"# {' '.join(sys.argv)}\n# {machine_line()}", flush=True)
    latent = tuple(int(x) for x in a.latent.split(","))
    spans = [range(n * a.records, (n + 1) * a.records) for n in range(a.caches)]
    with tempfile.TemporaryDirectory() as tmp, s3_server():
        local = [Path(tmp) / f"in{n}" for n in range(a.caches)]
        remote = [f"s3://{BUCKET}/in{n}" for n in range(a.caches)]
        for span, lp, rp in zip(spans, local, remote, strict=True):
            write(lp, span, latent, a.backend)
            write(rp, span, latent, a.backend)
        total = sum(shard_bytes(u) for u in remote)
        rows = [
            leg("s3 -> s3 (server-side copy)", remote, f"s3://{BUCKET}/m1", total),
            leg("local -> s3 (upload)", local, f"s3://{BUCKET}/m2", total),
            leg("s3 -> local (download)", remote, Path(tmp) / "m3", total),
        ]
    meta = {
        "backend": a.backend,
        "caches": a.caches,
        "records_per_cache": a.records,
        "latent": list(latent),
        "store": "moto S3 server on 127.0.0.1 (in-process)",
    }
    if a.json:
        write_json(a.json, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
