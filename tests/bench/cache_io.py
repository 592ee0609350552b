#!/usr/bin/env python
"""Cache I/O benchmark: wandistill's cache writers and training reader against the baselines.

    python tests/bench/cache_io.py --records 256 --out /tmp/cache-io

Generates N records with Wan 2.1 480p shapes (latent 16x1x60x104, 8 recorded steps, a ~100-token
x 4096 UMT5 embedding; teacher dtype bf16 by default), once, in memory, then times:

write  CacheWriter(backend="webdataset"), CacheWriter(backend="zarr") (skipped, with the reason,
       when the zarr backend does not import or fails), and the per-record safetensors-files
       baseline (musubi-tuner's layout: one `save_file` per record), with and without fsync.
read   one epoch of (record, recorded step) training samples per backend through TrainingReader,
       against (i) `cat` of the same files (the physical limit), (ii) stock
       `webdataset.WebDataset` + DataLoader(num_workers) decoding the `.safetensors` member with
       `safetensors.torch.load`, each record yielding its 8 samples, and (iii) the per-record
       files read with `safe_open`, slicing one step.

Before every read leg the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`);
where that is not permitted, every file of the leg gets `posix_fadvise(DONTNEED)` (and `fincore`,
when installed, checks what stayed resident); the table says which was used. Write legs start
after a `sync`. Before every write and cold read leg, free memory is touched (`prefault`: on a VM
whose host reclaims free guest memory, filling the page cache otherwise costs one leg a host
fault per page and the next leg nothing; `--no-prefault` turns it off). Every leg runs --repeats
times, interleaved, each round starting with another leg, and the median is reported with its
CPU seconds and the cores other processes used meanwhile (this machine may be shared). Besides
`cat`, each backend's reader is compared with raw `preadv`s of the very ranges it reads, in its
order (what its shuffled access pattern costs the storage). All data lives under --out and is
deleted at the end unless --keep.

Columns: MB/s is record tensor bytes per second (write), bytes the delivered samples needed from
the cache (read: the unpadded embedding + one step of xt/teacher_out + one timestep; a record's
embedding is read once per recorded step), or file bytes (raw cat); dev MB/s is what the block
device read during the leg (/proc/diskstats: device-wide, so other processes' reads count too).

Not a pytest test (tests/bench is excluded from collection).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))  # the harness, next to this script
from harness import (  # noqa: E402
    bootstrap_interval,
    busy_cpu_seconds,
    environment,
    machine_line,
    own_cpu_seconds,
    paired_ratios,
    write_json,
)

from wandistill.cache import CacheWriter, Record, record_key
from wandistill.cache.contract import field_specs, pad_embeds
from wandistill.cache.training import TrainingReader

C, F, H, W = 16, 1, 60, 104  # Wan 2.1 VAE latent of one 480x832 frame (F: --latent-frames)
EMBED_DIM = 4096
MAX_LEN = 512
STEPS = 8
FIELDS = ("prompt_embeds", "xt", "timesteps", "teacher_out")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
TEACHER = {"fingerprint": "b" * 64, "components": {}, "path": "benchmark"}
MB = 1e6


def settings_for(steps: int) -> dict[str, Any]:
    return {
        "max_sequence_length": MAX_LEN,
        "num_inference_steps": 40,
        "record_steps": [round(i * 40 / steps) for i in range(steps)],
        "guidance_scale": 5.0,
        "height": H * 8,
        "width": W * 8,
        "num_frames": 4 * (F - 1) + 1,
    }


# --------------------------------------------------------------------------------- records


def make_records(n: int, steps: int, dtype: torch.dtype, seed: int) -> list[Record]:
    """Records typed as precompute writes them: x_t, teacher output and the embedding in the
    teacher's dtype, noise and final latent float32, timesteps float32."""
    g = torch.Generator().manual_seed(seed)
    settings = settings_for(steps)

    def lat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    out = []
    for i in range(n):
        length = 88 + (i * 7) % 25  # 88..112 tokens
        out.append(
            Record(
                key=record_key(f"benchmark prompt {i}", i, settings),
                prompt=f"benchmark prompt {i}",
                seed=i,
                prompt_embeds=lat(length, EMBED_DIM),
                noise=torch.randn(C, F, H, W, generator=g),
                timesteps=torch.linspace(999.0, 25.0, steps) - i % 7,
                xt=lat(steps, C, F, H, W),
                teacher_out=lat(steps, C, F, H, W),
                final_latent=torch.randn(C, F, H, W, generator=g),
            )
        )
    return out


def record_bytes(r: Record) -> int:
    return sum(t.numel() * t.element_size() for t in r.tensors().values())


# --------------------------------------------------------------------------------- system


def device_of(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def disk_read_bytes(dev: tuple[int, int]) -> int | None:
    """Bytes read from the block device holding the data (/proc/diskstats), None if unknown."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if (int(f[0]), int(f[1])) == dev:
                return int(f[5]) * 512
    return None


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def total_size(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


class CacheDropper:
    """Evict a leg's files from the page cache: drop_caches if permitted, else fadvise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.can_drop: bool | None = None
        self.drop_error = ""

    def __call__(self, files: list[Path]) -> str:
        if not self.enabled:
            return "warm (--warm)"
        os.sync()
        if self.can_drop is not False:
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                self.can_drop = True
                return "cold (drop_caches)"
            except OSError as e:
                self.can_drop = False
                self.drop_error = f"{type(e).__name__}: {e}"
                print(
                    f"page cache could NOT be dropped ({self.drop_error}); trying "
                    "posix_fadvise(DONTNEED) per file, else results are warm-cache",
                    flush=True,
                )
        if not hasattr(os, "posix_fadvise"):
            return "WARM (no drop_caches, no fadvise)"
        failed = 0
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fdatasync(fd)  # dirty pages are not dropped by DONTNEED
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                failed += 1
        if failed:
            return f"WARM? (fadvise failed on {failed}/{len(files)} files)"
        return "cold (fadvise DONTNEED)"


def resident_bytes(files: list[Path]) -> int | None:
    """Page-cache-resident bytes of these files, via util-linux fincore when available."""
    exe = shutil.which("fincore")
    if exe is None or not files:
        return None
    total = 0
    for i in range(0, len(files), 500):
        chunk = [str(p) for p in files[i : i + 500]]
        try:
            out = subprocess.run(
                [exe, "--bytes", "--noheadings", "--raw", "--output", "RES", *chunk],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        total += sum(int(x) for x in out.split())
    return total


def machine_info(out: Path) -> dict[str, str]:
    """What this bench adds to the harness's machine line: the filesystem under --out and the
    storage libraries' versions."""
    fs = "?"
    with contextlib.suppress(OSError):
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if str(out.resolve()).startswith(mnt) and len(mnt) >= len(best):
                best, fs = mnt, f"{typ} on {dev} (mounted at {mnt})"
    versions = []
    for mod in ("webdataset", "safetensors", "zarr", "numpy"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            versions.append(f"{mod} ?")
    return {"libs": ", ".join(versions), "filesystem": fs}


# --------------------------------------------------------------------------------- results


@dataclass
class Leg:
    name: str
    seconds: float
    samples: int = 0
    payload: int = 0
    """Bytes the leg moved: record tensor bytes (write), bytes the samples need (read), file
    bytes (raw cat)."""
    disk: int | None = None
    """Bytes the block device read during the leg (/proc/diskstats, device-wide)."""
    cpu: float = 0.0
    """CPU seconds used by the leg (this process, its threads and its reaped children)."""
    others: float = 0.0
    """Cores busy outside this benchmark during the leg: other processes, kernel threads (e.g.
    writeback) and hypervisor steal (/proc/stat minus our own rusage)."""
    cache: str = ""
    note: str = ""
    runs: list[float] = field(default_factory=list)

    @property
    def mbps(self) -> float:
        return self.payload / MB / self.seconds if self.seconds else 0.0

    @property
    def sps(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def disk_mbps(self) -> float | None:
        return None if self.disk is None else self.disk / MB / self.seconds


def measure(
    name: str, body: Callable[[], tuple[int, int]], dev: tuple[int, int], cache: str = ""
) -> Leg:
    """Time `body` (returns samples, bytes) with its CPU, device reads and others' CPU."""
    d0, b0, c0 = disk_read_bytes(dev), busy_cpu_seconds(), own_cpu_seconds()
    t0 = time.perf_counter()
    samples, payload = body()
    dt = time.perf_counter() - t0
    d1, b1, c1 = disk_read_bytes(dev), busy_cpu_seconds(), own_cpu_seconds()
    disk = None if d0 is None or d1 is None else d1 - d0
    others = max(0.0, (b1 - b0) - (c1 - c0)) / dt if dt else 0.0
    leg = Leg(name, dt, samples, payload, disk, c1 - c0, others, cache)
    print(
        f"  {name}: {dt:.2f} s, cpu {c1 - c0:.1f} s, others {others:.1f} cores"
        + (f", {samples} samples" if samples else ""),
        flush=True,
    )
    return leg


def median_leg(runs: list[Leg]) -> Leg:
    ordered = sorted(runs, key=lambda leg: leg.seconds)
    mid = ordered[len(ordered) // 2]
    mid.runs = [round(leg.seconds, 2) for leg in runs]
    return mid


def prefault(nbytes: int) -> int:
    """Touch and free `nbytes` of anonymous memory; returns the bytes touched.

    Why: this VM hands free guest memory back to its host (free page reporting), and the first
    touch of such a page costs a host fault. After `drop_caches` the page cache of a read leg
    is filled from those pages, so the same `cat` of 1.35 GB took 0.65-2.4 s (0.15-2.1 s of
    system time) depending on how long the memory had been free, whichever leg it was
    (docs/benchmarks-history.md, "The VM's memory taken out of the cold legs"). Touching the memory
    first puts every leg on memory the host backs, as on a machine without a balloon; the page
    cache stays empty."""
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    n = max(0, min(nbytes, int(avail * 0.6)))
    if n:
        buf = np.empty(n, dtype=np.uint8)
        buf[::4096] = 1
        del buf
    return n


def cold(drop: CacheDropper, files: list[Path], prefault_memory: bool = False) -> str:
    """Evict the leg's files and say how; flag what the eviction left resident."""
    how = drop(files)
    if not drop.enabled:
        return how
    resident = resident_bytes(files)
    if resident is not None and resident > 0.05 * max(1, total_size(files)):
        how += f", {resident / MB:.0f} MB still resident"
    if prefault_memory:
        n = prefault(2 * total_size(files) + (1 << 30))
        how += f", {n / 1e9:.1f} GB of free memory touched first"
    return how


# --------------------------------------------------------------------------------- writers


def write_cache(
    records: list[Record], path: Path, backend: str, dtype: torch.dtype, shard_records: int
) -> tuple[int, int]:
    """Everything a precompute rank does with its records: open, write, publish, finalize."""
    steps = records[0].xt.shape[0]
    kw: dict[str, Any] = {}
    if "dims" in inspect.signature(CacheWriter).parameters:  # manifest dims, as precompute does
        kw["dims"] = {
            "text_dim": EMBED_DIM,
            "latent_channels": C,
            "latent_shape": [C, F, H, W],
            "num_recorded_steps": steps,
            "teacher_dtype": {
                torch.bfloat16: "bfloat16",
                torch.float32: "float32",
                torch.float16: "float16",
            }[dtype],
        }
    writer = CacheWriter(
        path,
        backend=backend,
        teacher=TEACHER,
        settings=settings_for(steps),
        fields=field_specs(
            latent_dtype=torch.float32, model_dtype=dtype, embed_dtype=dtype, features=[]
        ),
        shared={
            "negative_prompt_embeds": torch.zeros(8, EMBED_DIM, dtype=dtype),
            "timesteps": torch.linspace(999.0, 0.0, 40),
            "sigmas": torch.linspace(1.0, 0.0, 41),
        },
        shard_records=shard_records,
        **kw,
    )
    for r in records:
        writer.write(r)
    writer.close(finalize=True, complete=True)
    return 0, sum(record_bytes(r) for r in records)


def write_files(records: list[Record], path: Path) -> tuple[int, int]:
    """musubi-tuner-style cache: one safetensors file per record, as it runs (no fsync)."""
    path.mkdir(parents=True)
    for r in records:
        save_file(r.tensors(), str(path / f"{r.key}.safetensors"), metadata={"key": r.key})
    return 0, sum(record_bytes(r) for r in records)


def fsync_tree(path: Path) -> tuple[int, int]:
    """What the per-file baseline would need to be as durable as CacheWriter's shards."""
    for p in [*files_under(path), path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return 0, 0


# --------------------------------------------------------------------------------- readers


def batch_payload(batch: dict[str, Any]) -> int:
    """Bytes of one batch that came from the cache (the embedding without its zero padding)."""
    emb = batch["prompt_embeds"]
    n = int(batch["prompt_len"].sum()) * emb.shape[-1] * emb.element_size()
    for name in ("xt", "teacher_out", "timesteps"):
        t = batch[name]
        n += t.numel() * t.element_size()
    return n


class Checker:
    """Spot-checks delivered samples against the generated records (outside the byte count)."""

    def __init__(self, records: list[Record]) -> None:
        self.by_key = {r.key: r for r in records}
        self.checked = 0

    def __call__(self, batch: dict[str, Any], leg: str) -> None:
        if self.checked >= 4:  # a few per leg is enough; cheap relative to a batch
            return
        key, slot = batch["key"][0], int(batch["step_slot"][0])
        r = self.by_key[key]
        length = int(batch["prompt_len"][0])
        ok = (
            torch.equal(batch["xt"][0], r.xt[slot])
            and torch.equal(batch["teacher_out"][0], r.teacher_out[slot])
            and torch.equal(batch["prompt_embeds"][0, :length], r.prompt_embeds)
            and not bool(batch["prompt_embeds"][0, length:].any())
            and float(batch["timesteps"][0]) == float(r.timesteps[slot])
        )
        if not ok:
            raise AssertionError(f"{leg}: sample {key} step {slot} does not match its record")
        self.checked += 1


def read_training(
    path: Path | str, batch_size: int, threads: int, check: Checker
) -> tuple[int, int]:
    reader = TrainingReader(  # padded as `wandistill train` reads: to the batch, then on device
        path, batch_size=batch_size, fields=FIELDS, num_threads=threads, pad="batch"
    )
    n_batches = reader.batches_per_epoch()
    samples = payload = 0
    check.checked = 0
    it = iter(reader)
    try:
        for k, batch in enumerate(it):
            samples += len(batch["key"])
            payload += batch_payload(batch)
            check(batch, f"TrainingReader {path}")
            if k + 1 == n_batches:
                break
    finally:
        it.close()
        reader.store.close()
    return samples, payload


def _stock_decode(sample: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    # Decode the member bytes ourselves: webdataset's default decoders would unpickle.
    return st_load(sample["safetensors"]), json.loads(sample["json"])


def _stock_steps(src: Iterator[tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> Iterator[dict]:
    for tensors, meta in src:
        emb = tensors["prompt_embeds"]
        padded = pad_embeds(emb, MAX_LEN)
        for s in range(tensors["xt"].shape[0]):
            yield {
                "key": meta["key"],
                "step_slot": s,
                "prompt_embeds": padded,
                "prompt_len": emb.shape[0],
                "xt": tensors["xt"][s],
                "timesteps": tensors["timesteps"][s],
                "teacher_out": tensors["teacher_out"][s],
            }


def drain(batches: Iterable[dict[str, Any]], check: Checker, label: str) -> tuple[int, int]:
    """Every batch of a baseline's loader, checked: (samples, the bytes they needed)."""
    samples = payload = 0
    check.checked = 0
    for batch in batches:
        samples += len(batch["key"])
        payload += batch_payload(batch)
        check(batch, label)
    return samples, payload


def read_stock_wds(
    urls: list[str], batch_size: int, workers: int, check: Checker
) -> tuple[int, int]:
    import webdataset as wds

    ds = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .map(_stock_decode)
        .compose(_stock_steps)
    )
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers)
    return drain(loader, check, "stock webdataset")


class PerFileSteps(Dataset):
    """The per-record-files baseline: one safetensors file per record, `safe_open` per sample."""

    def __init__(self, files: list[Path], keys: list[str], steps: int) -> None:
        pairs = zip(files, keys, strict=True)
        self.items = [(str(p), k, s) for p, k in pairs for s in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, j: int) -> dict[str, Any]:
        path, key, s = self.items[j]
        with safe_open(path, framework="pt") as f:
            emb = f.get_tensor("prompt_embeds")
            return {
                "key": key,
                "step_slot": s,
                "prompt_embeds": pad_embeds(emb, MAX_LEN),
                "prompt_len": emb.shape[0],
                "xt": f.get_slice("xt")[s],
                "timesteps": f.get_slice("timesteps")[s],
                "teacher_out": f.get_slice("teacher_out")[s],
            }


def read_files(
    path: Path, keys: list[str], steps: int, batch_size: int, workers: int, check: Checker
) -> tuple[int, int]:
    ds = PerFileSteps([path / f"{k}.safetensors" for k in keys], keys, steps)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(
        ds, batch_size=batch_size, sampler=order, num_workers=workers, drop_last=True
    )
    return drain(loader, check, "per-file safetensors")


def read_raw(files: list[Path]) -> tuple[int, int]:
    """`cat` every file to /dev/null: the sequential-read limit of the storage."""
    with open(os.devnull, "wb") as null:
        for i in range(0, len(files), 500):
            subprocess.run(["cat", "--", *map(str, files[i : i + 500])], stdout=null, check=True)
    return 0, total_size(files)


# --------------------------------------------------------------------------------- fsspec


class RangeLog:
    """Wraps a cache's Storage to record every byte range the reader asks for (the baseline
    then fetches exactly those bytes)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ranges: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def read_range(self, rel: str, offset: int, size: int) -> bytes:
        self.ranges.append((rel, offset, size))
        return self.store.read_range(rel, offset, size)

    def read_into(self, rel: str, requests: list[tuple[int, Any]]) -> list[int]:
        self.ranges += [(rel, off, memoryview(buf).nbytes) for off, buf in requests]
        return self.store.read_into(rel, requests)


class ZarrRangeLog:
    """The same for the zarr backend: wraps the zarr store under the reader's `_ReadStore`, so
    only what reaches the storage is logged (shard indexes served from its cache are not)."""

    def __init__(self, source: Any) -> None:
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest
        from zarr.storage import WrapperStore

        from wandistill.cache.zarr.store import _ReadStore

        ranges: list[tuple[str, int, int]] = []

        class Log(WrapperStore):  # type: ignore[type-arg]
            def _with_store(self, store: Any) -> Any:
                return type(self)(store)

            async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
                buf = await self._store.get(key, prototype, byte_range)
                if buf is not None and not key.endswith("zarr.json"):
                    off = 0
                    if isinstance(byte_range, RangeByteRequest):
                        off = byte_range.start
                    elif isinstance(byte_range, SuffixByteRequest):
                        off = await self._store.getsize(key) - byte_range.suffix
                    ranges.append((f"data.zarr/{key}", off, len(buf)))
                return buf

        self.ranges = ranges
        source.store = _ReadStore(Log(source.store._store), source.store.indexes.max_size)


def reader_ranges(location: str, batch_size: int, threads: int) -> list[tuple[str, int, int]]:
    """Every (object, offset, size) one epoch of the training reader reads."""
    reader = TrainingReader(  # padded as `wandistill train` reads: to the batch, then on device
        location, batch_size=batch_size, fields=FIELDS, num_threads=threads, pad="batch"
    )
    source = reader.store.source
    if reader.store.manifest.backend == "zarr":
        log: Any = ZarrRangeLog(source)
    else:
        log = RangeLog(source.store)
        source.store = log
    it = iter(reader)
    try:
        for k, _ in enumerate(it):
            if k + 1 == reader.batches_per_epoch():
                break
    finally:
        it.close()
        reader.store.close()
    return log.ranges


def raw_ranges_local(root: Path, ranges: list[tuple[str, int, int]]) -> tuple[int, int]:
    """The same byte ranges with plain `os.pread` (one thread, files opened once)."""
    fds: dict[str, int] = {}
    n = 0
    try:
        for rel, off, size in ranges:
            fd = fds.get(rel) or fds.setdefault(rel, os.open(root / rel, os.O_RDONLY))
            n += len(os.pread(fd, size, off))
    finally:
        for fd in fds.values():
            os.close(fd)
    return 0, n


def raw_ranges_threads(
    root: Path, ranges: list[tuple[str, int, int]], threads: int
) -> tuple[int, int]:
    """The same byte ranges in the reader's order, `threads` `os.preadv` calls at a time, each
    into a buffer of its own: what that access pattern costs the storage, without the reader."""
    fds = {rel: os.open(root / rel, os.O_RDONLY) for rel in {r[0] for r in ranges}}

    def one(r: tuple[str, int, int]) -> int:
        return os.preadv(fds[r[0]], [np.empty(r[2], dtype=np.uint8)], r[1])

    try:
        with ThreadPoolExecutor(threads) as pool:
            return 0, sum(pool.map(one, ranges))
    finally:
        for fd in fds.values():
            os.close(fd)


def raw_ranges_s3(url: str, ranges: list[tuple[str, int, int]]) -> tuple[int, int]:
    """The same byte ranges as ranged GETs, all handed to s3fs at once (`cat_ranges`, its own
    concurrency): the object store's limit for these requests."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    got = fs.cat_ranges(
        [f"{root}/{rel}" for rel, _, _ in ranges],
        [off for _, off, _ in ranges],
        [off + size for _, off, size in ranges],
    )
    return 0, sum(len(g) for g in got)


@contextlib.contextmanager
def moto_process() -> Iterator[str]:
    """moto's S3 server in its own process (not a thread here: it must not share our GIL)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "import sys, time; from moto.server import ThreadedMotoServer; "
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); "
        "s.start(); time.sleep(10**6)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    try:
        import fsspec

        for _ in range(100):
            with contextlib.suppress(Exception):
                fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
                break
            time.sleep(0.1)
        yield "s3://bench/cache"
    finally:
        proc.terminate()
        proc.wait()


def fsspec_legs(args: Any, records: list[Record], out: Path, check: Checker) -> int:
    """Reader vs raw reads of the same bytes, on a local folder and on S3 (warm page cache:
    the S3 server holds the objects in memory)."""
    dtype = DTYPES[args.dtype]
    dev = device_of(out)
    rows: list[tuple[str, Leg, Leg, list[float] | None]] = []
    backends = [b for b in args.backends.split(",") if b]
    with moto_process() as bucket:
        places = [(f"{b} {w}", b, out / b if w == "local" else f"{bucket}-{b}")
                  for b in backends for w in ("local", "s3")]  # fmt: skip
        for where, backend, location in places:
            write_cache(records, location, backend, dtype, args.shard_records)
            ranges = reader_ranges(str(location), args.batch_size, args.threads)
            if isinstance(location, Path):
                raw = functools.partial(raw_ranges_local, location, ranges)
            else:
                raw = functools.partial(raw_ranges_s3, str(location), ranges)
            reads, raws = [], []
            for _ in range(args.repeats):
                body = functools.partial(
                    read_training, location, args.batch_size, args.threads, check
                )
                reads.append(measure(f"{where} TrainingReader", body, dev))
                raws.append(measure(f"{where} raw reads of the same bytes", raw, dev))
            rounds = {"reader": reads, "raw": raws}
            pair = paired_interval(rounds, "reader", "raw", lambda leg: 1 / leg.seconds)
            rows.append((where, median_leg(reads), median_leg(raws), pair))
    # Both legs move the same byte ranges (the raw leg also counts the header bytes, which the
    # reader's MB/s leaves out), so the ratio is one of times: raw seconds / reader seconds.
    print(
        "\n| storage | reader s | reader MB/s | raw same-ranges s | ratio (raw s / reader s) "
        "| paired rounds, 95% interval |"
    )
    print("|---|---|---|---|---|---|")
    found = []
    for where, rd, rw, pair in rows:
        ratio = rw.seconds / rd.seconds if rd.seconds else 0.0
        target = 0.9 if where.endswith("local") else 0.8
        span = "-" if pair is None else f"{pair[0]:.2f}x ({pair[1]:.2f}-{pair[2]:.2f}x)"
        print(
            f"| {where} | {rd.seconds:.2f} {rd.runs} | {rd.mbps:.0f} | {rw.seconds:.3f} {rw.runs} "
            f"| {verdict(ratio, target)} | {span} |"
        )
        found.append({"storage": where, "reader": vars(rd), "raw": vars(rw), "ratio": ratio})
        found[-1]["paired_interval"] = pair
    if args.json:
        write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": found})
    return 0


# --------------------------------------------------------------------------------- report


def read_legs(
    caches: dict[str, Path],
    out: Path,
    keys: list[str],
    args: Any,
    check: Checker,
    notes: dict[str, str],
) -> list[tuple[str, list[Path], Callable[[], tuple[int, int]]]]:
    """One round's read legs: (name, files to evict first, body)."""
    legs: list[tuple[str, list[Path], Callable[[], tuple[int, int]]]] = []
    tars: list[Path] = []
    for backend, path in caches.items():
        files = files_under(path)
        legs.append((f"raw cat {backend} files", files, functools.partial(read_raw, files)))
        ranges = reader_ranges(str(path), args.batch_size, args.threads)
        legs.append(
            (
                f"raw preads {backend} ranges",
                files,
                functools.partial(raw_ranges_threads, path, ranges, args.threads),
            )
        )
        notes[f"raw preads {backend} ranges"] = (
            f"the reader's {len(ranges)} ranges in its order, {args.threads} threads"
        )
        legs.append(
            (
                f"TrainingReader {backend}",
                files,
                functools.partial(read_training, path, args.batch_size, args.threads, check),
            )
        )
        notes[f"TrainingReader {backend}"] = f"{args.threads} threads, shuffled (record, step)"
        if backend == "webdataset":
            tars = [f for f in files if f.suffix == ".tar"]
    if tars:
        if len(tars) < args.workers:
            print(f"  note: {len(tars)} shards < {args.workers} workers: idle workers")
        urls = [str(t) for t in tars]
        legs.append(
            (
                "stock WebDataset+DataLoader",
                tars,
                functools.partial(read_stock_wds, urls, args.batch_size, args.workers, check),
            )
        )
        notes["stock WebDataset+DataLoader"] = f"{args.workers} workers, shard order, whole records"
    ffiles = files_under(out / "files")
    legs.append(("raw cat per-file files", ffiles, functools.partial(read_raw, ffiles)))
    legs.append(
        (
            "per-file safe_open+DataLoader",
            ffiles,
            functools.partial(
                read_files, out / "files", keys, args.steps, args.batch_size, args.workers, check
            ),
        )
    )
    notes["per-file safe_open+DataLoader"] = f"{args.workers} workers, shuffled"
    return legs


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(title: str, legs: list[Leg], *, read: bool) -> None:
    print(f"\n{title}")
    head = f"  {'leg':<30} {'time s':>6} {'MB/s':>6}"
    if read:
        head += f" {'samp/s':>6} {'dev MB/s':>8}"
    print(head + f" {'CPU s':>6} {'others':>6}  cache; notes")
    for leg in legs:
        row = f"  {leg.name:<30} {leg.seconds:6.2f} {leg.mbps:6.0f}"
        if read:
            row += f" {fmt(leg.sps if leg.samples else None):>6} {fmt(leg.disk_mbps):>8}"
        row += f" {leg.cpu:6.1f} {leg.others:6.2f}"
        extra = [x for x in (leg.cache, leg.note) if x]
        if len(leg.runs) > 1:
            extra.append("runs " + "/".join(f"{x:g}" for x in leg.runs) + " s")
        print(row + "  " + "; ".join(extra))


def paired_interval(
    runs: dict[str, list[Leg]], leg: str, base: str, rate: Callable[[Leg], float]
) -> list[float] | None:
    """[median, low, high] of `rate(leg) / rate(base)` per round (both ran in every round, back
    to back, so drift between rounds cancels) with its 95% bootstrap interval; None when either
    leg missed a round."""
    a, b = runs.get(leg, []), runs.get(base, [])
    if not a or len(a) != len(b):
        return None
    ratios = paired_ratios([rate(x) for x in a], [rate(x) for x in b])
    return [statistics.median(ratios), *bootstrap_interval(ratios)]


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:5.2f}x (target >= {target:g}x: {'met' if ratio >= target else 'MISSED'})"


# --------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=256, help="records to generate (default 256)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="scratch directory (created; default a temp dir under /tmp)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="teacher dtype: x_t, teacher_out and the embedding (noise and final "
        "latent are float32, as precompute writes them); default bf16",
    )
    p.add_argument("--steps", type=int, default=STEPS, help="recorded steps per record")
    p.add_argument(
        "--latent-frames",
        type=int,
        default=F,
        help="latent frames per record (default 1; 21 is an 81-frame Wan video, ~85 MB a record)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-records", type=int, default=64, help="records per cache shard")
    p.add_argument("--threads", type=int, default=4, help="TrainingReader num_threads")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the baselines")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of every leg, interleaved; the median is reported (default 3)",
    )
    p.add_argument(
        "--backends", default="webdataset,zarr", help="comma-separated cache backends to benchmark"
    )
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    p.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="do not touch free memory before each write and cold read leg (on a VM whose "
        "host reclaims free guest memory, the legs then pay host faults by turns; see "
        "prefault())",
    )
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--fsspec",
        action="store_true",
        help="only the fsspec legs: the reader of each --backends on a local folder and on a "
        "local S3 server (moto, its own process) against raw reads of the same bytes",
    )
    args = p.parse_args(argv)
    globals()["F"] = args.latent_frames  # make_records and the manifest dims read it
    if args.records * args.steps < args.batch_size:
        p.error("need records x steps >= batch size")

    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="wandistill-cache-io-"))
        created = True
    else:
        out = args.out
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            p.error(f"--out {out} exists and is not an empty directory")
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)

    # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the data under --out is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dtype = DTYPES[args.dtype]
    info = machine_info(out)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    print(f"command: {cmd}")
    print(machine_line())
    for k, v in info.items():
        print(f"{k:>10}: {v}")
    free = shutil.disk_usage(out).free

    t0 = time.perf_counter()
    records = make_records(args.records, args.steps, dtype, seed=0)
    per_record = record_bytes(records[0])
    payload = sum(record_bytes(r) for r in records)
    print(
        f"generated {len(records)} records x {per_record / MB:.2f} MB ({args.dtype}) "
        f"= {payload / MB:.0f} MB in {time.perf_counter() - t0:.1f} s (not timed below)"
    )
    if args.fsspec:
        try:
            return fsspec_legs(args, records, out, check=Checker(records))
        finally:
            if created and not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    backends = [b for b in args.backends.split(",") if b]
    need = payload * (len(backends) + 1) * 1.1
    if need > free:
        p.error(f"need ~{need / 1e9:.1f} GB under {out}, {free / 1e9:.1f} GB free")

    dev = device_of(out)
    drop = CacheDropper(enabled=not args.warm)
    check = Checker(records)
    keys = [r.key for r in records]
    skipped: dict[str, str] = {}
    if "zarr" in backends:
        try:
            import wandistill.cache.zarr.reader  # noqa: F401
        except Exception as e:
            skipped["zarr"] = f"wandistill.cache.zarr does not import: {e!r}"
            print(f"zarr: skipped ({skipped['zarr']})", flush=True)
    w_runs: dict[str, list[Leg]] = {}
    r_runs: dict[str, list[Leg]] = {}
    notes: dict[str, str] = {}
    caches: dict[str, Path] = {}
    on_disk: dict[str, int] = {}

    def run_write(name: str, path: Path, body: Callable[[], tuple[int, int]]) -> Leg | None:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()  # no leg pays for another's writeback
        if args.prefault and not args.warm:  # the page cache it fills: see prefault()
            prefault(2 * per_record * len(records) + (1 << 30))
        try:
            leg = measure(name, body, dev)
        except Exception as e:
            backend = path.name
            skipped[backend] = f"writing failed: {type(e).__name__}: {e}"
            print(f"{backend}: skipped ({skipped[backend]})", flush=True)
            traceback.print_exc(limit=6)
            shutil.rmtree(path, ignore_errors=True)
            return None
        w_runs.setdefault(name, []).append(leg)
        return leg

    def run_read(name: str, files: list[Path], body: Callable[[], tuple[int, int]]) -> None:
        how = cold(drop, files, args.prefault)
        r_runs.setdefault(name, []).append(measure(name, body, dev, how))

    try:

        def write_backend(backend: str) -> None:
            if backend in skipped:
                return
            path = out / backend
            leg = run_write(
                f"CacheWriter {backend}",
                path,
                lambda p=path, b=backend: write_cache(records, p, b, dtype, args.shard_records),
            )
            if leg is not None:
                caches[backend] = path
                on_disk[backend] = total_size(files_under(path))
            else:
                caches.pop(backend, None)

        def write_baseline() -> None:
            leg = run_write(
                "per-file save_file", out / "files", lambda: write_files(records, out / "files")
            )
            sync = measure("  + fsync of every file", lambda: fsync_tree(out / "files"), dev)
            assert leg is not None
            w_runs.setdefault("per-file save_file + fsync", []).append(
                Leg(
                    "per-file save_file + fsync",
                    leg.seconds + sync.seconds,
                    0,
                    leg.payload,
                    None,
                    leg.cpu + sync.cpu,
                    (leg.others * leg.seconds + sync.others * sync.seconds)
                    / max(1e-9, leg.seconds + sync.seconds),
                )
            )
            on_disk["files"] = total_size(files_under(out / "files"))

        writers: list[Callable[[], None]] = [
            *(functools.partial(write_backend, b) for b in backends),
            write_baseline,
        ]
        # Repeats are interleaved (every leg once per round) so that drift and other load on
        # the machine spread over all legs instead of hitting one; the median is reported.
        for rnd in range(args.repeats):
            print(f"\nround {rnd + 1}/{args.repeats}: write", flush=True)
            # Each round starts with another leg: on a VM, whichever leg writes first into page
            # cache memory the guest has not touched lately pays for it
            # (docs/benchmarks-history.md).
            k = rnd % len(writers)
            for write in writers[k:] + writers[:k]:
                write()

            print(f"round {rnd + 1}/{args.repeats}: read", flush=True)
            # Rotated like the writes: whatever a leg leaves behind (memory, device state)
            # must not always fall on the same next leg.
            legs = read_legs(caches, out, keys, args, check, notes)
            k = rnd % max(1, len(legs))
            for name, files, body in legs[k:] + legs[:k]:
                if name.startswith("TrainingReader") and name.split()[-1] in skipped:
                    continue
                try:
                    run_read(name, files, body)
                except Exception as e:
                    if not name.startswith("TrainingReader"):
                        raise
                    backend = name.split()[-1]
                    skipped[backend] = f"reading failed: {type(e).__name__}: {e}"
                    print(f"{backend}: read skipped ({skipped[backend]})", flush=True)
                    traceback.print_exc(limit=6)
                    caches.pop(backend, None)
    finally:
        if not args.keep:
            for sub in ("webdataset", "zarr", "files"):
                shutil.rmtree(out / sub, ignore_errors=True)
            if created and not any(out.iterdir()):
                out.rmdir()

    writes = [median_leg(v) for v in w_runs.values()]
    reads = [median_leg(v) for v in r_runs.values()]
    for leg in writes:
        backend = leg.name.split()[-1] if leg.name.startswith("CacheWriter") else "files"
        if leg.name.startswith("CacheWriter"):
            leg.note = f"{on_disk.get(backend, 0) / MB:.0f} MB on disk, fsync per shard"
        elif "fsync" in leg.name:
            leg.note = "durable like CacheWriter"
        else:
            leg.note = f"musubi-tuner layout, as it runs (page cache only); {len(keys)} files"
    for leg in reads:
        leg.note = notes.get(leg.name, "")

    # ---- report
    n_samples = args.records * args.steps
    print(
        f"\n== Cache I/O: {args.records} records x {args.steps} steps = {n_samples} samples, "
        f"{per_record / MB:.2f} MB/record ({args.dtype} teacher dtype), "
        f"batch {args.batch_size}, median of {args.repeats} run(s)"
    )
    print(f"command: {cmd}")
    print(machine_line() + "; " + "; ".join(f"{k} {v}" for k, v in info.items()))
    print(
        f"page cache before each read leg: {reads[0].cache if reads else '-'}"
        + (f" [drop_caches: {drop.drop_error}]" if drop.drop_error else "")
    )
    print_table("write (MB/s of record tensor bytes)", writes, read=False)
    print_table("read (MB/s: bytes the samples need; raw cat: file bytes)", reads, read=True)
    by = {leg.name: leg for leg in reads}
    wby = {leg.name: leg for leg in writes}
    print("\nratios (same run)")

    def line(backend: str, label: str, value: str) -> None:
        print(f"  {backend + ' ' + label:<48} {value}")

    ratios: dict[str, float] = {}
    intervals: dict[str, list[float]] = {}
    rounds = {**w_runs, **r_runs}

    def paired(key: str, leg: str, base: str, rate: Callable[[Leg], float]) -> None:
        """The same ratio per round, paired: its median and 95% interval under the verdict."""
        got = paired_interval(rounds, leg, base, rate)
        if got is not None and args.repeats > 1:
            intervals[key] = got
            print(f"  {'':<48}   paired rounds: {got[0]:.2f}x, 95% {got[1]:.2f}-{got[2]:.2f}x")

    for backend in backends:
        if backend in skipped or backend not in caches:
            print(f"  {backend}: skipped ({skipped.get(backend, 'not run')})")
            continue
        w = wby[f"CacheWriter {backend}"]
        base, durable = wby["per-file save_file"], wby["per-file save_file + fsync"]
        ratios[f"{backend}.write_vs_files"] = r1 = base.seconds / w.seconds
        ratios[f"{backend}.write_vs_files_fsync"] = r2 = durable.seconds / w.seconds
        ratios[f"{backend}.write_cpu_vs_files"] = r3 = base.cpu / w.cpu
        line(backend, "write vs per-file (no fsync)", verdict(r1, 1.0))
        line(backend, "write vs per-file + fsync", verdict(r2, 1.0))
        paired(
            f"{backend}.write_vs_files_fsync",
            w.name,
            durable.name,
            lambda leg: 1 / leg.seconds,
        )
        line(backend, "write CPU-s vs per-file (no fsync)", f"{r3:5.2f}x (info: CPU efficiency)")
        tr = by.get(f"TrainingReader {backend}")
        if tr is None:
            continue
        raw = by[f"raw cat {backend} files"]
        ratios[f"{backend}.read_vs_raw"] = r = tr.mbps / raw.mbps
        line(backend, "read MB/s vs raw cat", verdict(r, 0.9))
        paired(f"{backend}.read_vs_raw", tr.name, raw.name, lambda leg: leg.mbps)
        same = by.get(f"raw preads {backend} ranges")
        if same is not None:
            ratios[f"{backend}.read_vs_own_ranges"] = r = same.seconds / tr.seconds
            line(backend, "read time vs raw preads of its ranges", f"{r:5.2f}x (info)")
            ratios[f"{backend}.own_ranges_vs_raw"] = r = same.mbps / raw.mbps
            line(backend, "raw preads of its ranges vs raw cat", f"{r:5.2f}x (info: the order)")
        if tr.disk_mbps is not None and raw.disk_mbps:
            ratios[f"{backend}.read_disk_vs_raw"] = r = tr.disk_mbps / raw.disk_mbps
            line(backend, "read device MB/s vs raw cat", f"{r:5.2f}x (info)")
        stock = by.get("stock WebDataset+DataLoader")
        if stock is not None:
            ratios[f"{backend}.read_vs_stock_wds"] = r = tr.sps / stock.sps
            line(backend, "read samples/s vs stock webdataset", verdict(r, 1.5))
            paired(f"{backend}.read_vs_stock_wds", tr.name, stock.name, lambda leg: leg.sps)
        files_leg = by["per-file safe_open+DataLoader"]
        ratios[f"{backend}.read_vs_files"] = r = tr.sps / files_leg.sps
        line(backend, "read samples/s vs per-file safe_open", f"{r:5.2f}x (info)")
    contended = [leg.name for leg in [*writes, *reads] if leg.others > 0.25]
    if contended:
        print(
            f"\nWARNING: other processes used > 0.25 core during: {', '.join(contended)} "
            "(see the 'others' column); those figures are noisy"
        )
    if args.json:
        write_json(
            args.json,
            {
                "command": cmd,
                "environment": environment() | info,
                "args": {k: str(v) for k, v in vars(args).items()},
                "writes": [vars(x) for x in writes],
                "reads": [vars(x) for x in reads],
                "ratios": ratios,
                "paired_intervals": intervals,
                "skipped": skipped,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
