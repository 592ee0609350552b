"""kill -9 anywhere, resume, and get the very same cache / student as an uninterrupted run.

Kill points are exact and seeded. `WANDISTILL_FAULT` (wandistill/runtime/failures.py) makes
a process SIGKILL itself right after its n-th record (precompute) or right after optimizer step n
/ checkpoint n (train); more kill the process from outside as soon as a progress marker shows up
on disk (a shard's temp file, a journal entry, a checkpoint's temp folder, a metrics row, the
export folder), which lands inside a shard write, a checkpoint save or the export. Each kill
point: one killed run, then the same command again (train: plus --resume), compared with one
uninterrupted reference run per configuration: every record committed exactly once with the
reference's bytes, and byte-identical final student weights (CPU).

Speed: every run is forked from a "zygote" process (tests/zygote.py) that imported torch,
diffusers and wandistill once, so a run costs well under a second instead of seconds of imports.
The child runs
`wandistill.cli.main(argv)`: the real command line, in a real process that really gets SIGKILL.
For 2 ranks the zygote forks one child per rank with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and, like torchrun, SIGTERMs the other ranks when one fails. Real
torchrun runs are in test_signals.py and test_dist_failure.py.

The default run tries 4 seeded kill points per stage; `-m slow` runs the full sweep (>= 20 per
stage). Every test prints its figures (kill points, records lost / duplicated).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import save as st_save

from wandistill.cache.contract import Record
from wandistill.cache.manifest import load_committed, manifest_path
from wandistill.cache.reader import open_cache
from wandistill.cache.wds.reader import WebDatasetSource
from wandistill.train.checkpoint import resolve_latest
from wandistill.train.metrics import read_metrics

from cachefixtures import write_cache
from zygote import HANG_GUARD_S, Zygote, alive, kill, logs

REPO = Path(__file__).parents[2]
SEED = 20240607


def kill_when(z: Zygote, pids: list[int], ready: Callable[[], bool]) -> list[int]:
    """SIGKILL every rank as soon as `ready()` (a marker on disk); the ranks' exit codes."""
    # The run may finish first: then it just was not killed (the caller counts it as missed).
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        if ready():
            for p in pids:
                kill(p, signal.SIGKILL)
            break
        if all(not alive(p) for p in pids):
            break
        time.sleep(0.002)
    return z.wait(pids)


@dataclass
class Tally:
    """What a sweep did: kill points that landed, missed, and what the resumes found."""

    stage: str
    killed: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    mismatched: int = 0

    def report(self) -> str:
        return (
            f"{self.stage}: {len(self.killed)} kill points landed "
            f"({', '.join(self.killed)}); {len(self.missed)} marker kills came after the run "
            f"ended ({', '.join(self.missed) or '-'}); lost {self.lost}, duplicated "
            f"{self.duplicated}, different {self.mismatched}"
        )


# --------------------------------------------------------------------------- precompute

N_PROMPTS = 14  # 7 batches of 2; shards of 3 records: kills land mid-shard and between shards
SHARD = 3


@dataclass(frozen=True)
class PrecomputeSetup:
    teacher: Path
    prompts: Path
    reference: dict[str, bytes]
    """Key -> the record's bytes in its webdataset shard."""
    decoded: dict[str, bytes]
    """Key -> `decoded_bytes` of the record (compares across backends)."""
    backend: str = "webdataset"

    def expected(self) -> dict[str, bytes]:
        return self.reference if self.backend == "webdataset" else self.decoded


def precompute_argv(s: PrecomputeSetup, cache: Path) -> list[str]:
    return [
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(s.teacher),
        "--prompts",
        str(s.prompts),
        "--out",
        str(cache),
        *("--set", "previews=0"),
        *("--set", "sampler.batch_size=2"),
        *("--set", f"cache.shard_records={SHARD}"),
        *("--set", "sampler.height=32"),
        *("--set", "sampler.width=32"),
        *("--set", "sampler.num_inference_steps=4"),
        *("--backend", s.backend),
    ]


@dataclass(frozen=True)
class Committed:
    keys: list[str]
    """Every committed key, repeats kept."""
    blobs: dict[str, bytes]
    shards: dict[str, str]
    """Shard name -> sha256 of the shard file."""
    complete: bool


def decoded_bytes(rec: Record) -> bytes:
    """Every tensor's dtype, shape and bytes, and the metadata, of a record read back."""
    return json.dumps(rec.meta(), sort_keys=True).encode() + st_save(
        dict(sorted(rec.tensors().items()))
    )


def committed(cache: Path, *, decoded: bool = False) -> Committed:
    """What the manifest and the journals commit right now, read back from the shards.

    webdataset: each record's raw bytes in its tar; zarr (or `decoded`): `decoded_bytes`."""
    if not manifest_path(cache).is_file():
        return Committed([], {}, {}, False)
    m = load_committed(cache)
    keys = [k for s in m.shards for k in s.keys]
    digests = ((e.name, getattr(e, "frame_sha256", None) or e.sha256) for e in m.shards)
    shards = {name: json.dumps(digest, sort_keys=True) for name, digest in digests}
    if m.backend == "webdataset" and not decoded:
        src = WebDatasetSource(cache)
        try:
            blobs = {k: src.read_blob(e, i) for e in m.shards for i, k in enumerate(e.keys)}
        finally:
            src.close()
    else:
        with open_cache(cache) as store:
            blobs = {
                k: decoded_bytes(store.read_record(e, i)) for k, (e, i) in store.locate().items()
            }
    return Committed(keys, blobs, shards, m.complete)


@pytest.fixture(scope="module")
def pre(
    zygote: Zygote, tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory
) -> PrecomputeSetup:
    root = tmp_path_factory.mktemp("kill-precompute")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"a tiny scene number {i}\n" for i in range(N_PROMPTS)))
    s = PrecomputeSetup(tiny_teacher, prompts, {}, {})
    ref = root / "reference"
    codes = zygote.run(precompute_argv(s, ref), root / "reference.log")
    assert codes == [0], logs(root / "reference.log")
    c = committed(ref)
    assert c.complete and len(c.keys) == len(set(c.keys)) == N_PROMPTS
    return PrecomputeSetup(s.teacher, s.prompts, c.blobs, committed(ref, decoded=True).blobs)


def check_partial(s: PrecomputeSetup, cache: Path, t: Tally) -> Committed:
    """After a kill: what is committed is a subset of the reference, bytes equal, once each."""
    c = committed(cache)
    assert not c.complete, "a killed run must never leave the cache marked complete"
    t.duplicated += len(c.keys) - len(set(c.keys))
    t.mismatched += sum(c.blobs[k] != s.expected().get(k) for k in c.blobs)
    return c


def resume_and_check(
    z: Zygote, s: PrecomputeSetup, cache: Path, before: Committed, t: Tally, nproc: int = 1
) -> None:
    log = cache.with_suffix(".resume.log")
    codes = z.run(precompute_argv(s, cache), log, nproc=nproc)
    assert codes == [0] * nproc, logs(log, nproc)
    c = committed(cache)
    assert c.complete
    t.lost += len(set(s.expected()) - set(c.keys))
    t.duplicated += len(c.keys) - len(set(c.keys))
    t.mismatched += sum(c.blobs[k] != s.expected().get(k) for k in c.blobs)
    kept = {n: c.shards.get(n) for n in before.shards}
    assert kept == before.shards, "the resume must keep every committed shard as it was"
    with open_cache(cache) as store:
        assert store.verify() == []
    # The resume wrote exactly the records that were not committed: nothing twice. Rank 0
    # prints one summary for the whole job (every rank's records summed).
    written = re.findall(r"(\d+) records written", logs(log, nproc))
    assert len(written) == 1 and int(written[0]) == N_PROMPTS - len(before.keys)


PRE_HOOK_POINTS = list(range(N_PROMPTS + 1))  # after record n of the run (0: writer just opened)
PRE_MARKERS = [("shard-tmp", 1), ("journal", 2), ("shard-tmp", 3)]
random.Random(SEED).shuffle(PRE_HOOK_POINTS)
PRE_FAST = PRE_HOOK_POINTS[:3]


def _shard_tmp(cache: Path, seq: int) -> Callable[[], bool]:
    shards = cache / "shards"
    return lambda: shards.is_dir() and any(shards.glob(f".r00000-{seq:06d}.tar*.tmp"))


def _journal_has(cache: Path, n: int, ranks: tuple[int, ...] = (0,)) -> Callable[[], bool]:
    def ready() -> bool:
        total = 0
        for r in ranks:
            try:
                data = json.loads((cache / "journal" / f"rank-{r:05d}.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            total += len(data["shards"])
        return total >= n

    return ready


def sweep_precompute_1rank(
    z: Zygote, s: PrecomputeSetup, root: Path, points: list[int], markers: list[tuple[str, int]]
) -> Tally:
    t = Tally(f"precompute, 1 rank, {s.backend}")
    for n in points:
        cache = root / f"hook-{n}"
        codes = z.run(
            precompute_argv(s, cache),
            root / f"hook-{n}.log",
            WANDISTILL_FAULT=f"precompute:record:{n}",
        )
        assert codes == [-signal.SIGKILL], f"record {n}: {codes}\n{logs(root / f'hook-{n}.log')}"
        before = check_partial(s, cache, t)
        # Killed right after record n: every full shard before it is committed, nothing else.
        assert len(before.keys) == n - n % SHARD, f"record {n}: {len(before.keys)} committed"
        resume_and_check(z, s, cache, before, t)
        t.killed.append(f"record {n}")
    for kind, k in markers:
        cache = root / f"{kind}-{k}"
        ready = _shard_tmp(cache, k) if kind == "shard-tmp" else _journal_has(cache, k)
        pids = z.start(precompute_argv(s, cache), root / f"{kind}-{k}.log")
        codes = kill_when(z, pids, ready)
        label = f"{kind} {k}"
        if codes == [0]:
            t.missed.append(label)
            continue
        assert codes == [-signal.SIGKILL], f"{label}: {codes}"
        resume_and_check(z, s, cache, check_partial(s, cache, t), t)
        t.killed.append(label)
    return t


def test_precompute_kill_9_at_seeded_points_then_rerun(
    zygote: Zygote, pre: PrecomputeSetup, tmp_path: Path
) -> None:
    t = sweep_precompute_1rank(zygote, pre, tmp_path, PRE_FAST, PRE_MARKERS[:1])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0
    assert len(t.killed) >= 3


@pytest.mark.slow
def test_precompute_kill_9_at_every_record_then_rerun(
    zygote: Zygote, pre: PrecomputeSetup, tmp_path: Path
) -> None:
    t = sweep_precompute_1rank(zygote, pre, tmp_path, PRE_HOOK_POINTS[3:], PRE_MARKERS[1:])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0
    assert len(t.killed) >= len(PRE_HOOK_POINTS) - 3


@pytest.mark.slow
def test_precompute_zarr_kill_9_at_seeded_points_then_rerun(
    zygote: Zygote, pre: PrecomputeSetup, tmp_path: Path
) -> None:
    zarr = dataclasses.replace(pre, backend="zarr")
    points = random.Random(SEED + 4).sample(range(N_PROMPTS + 1), 4)
    t = sweep_precompute_1rank(zygote, zarr, tmp_path, points, [])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0 and len(t.killed) == 4


# 2 ranks: rank r of 2 takes batches r, r+2, ...: rank 0 hands 8 records, rank 1 hands 6.
PRE2_HOOK_POINTS = [(r, n) for r in (0, 1) for n in range(1, (8 if r == 0 else 6) + 1)]
random.Random(SEED + 1).shuffle(PRE2_HOOK_POINTS)
PRE2_FAST = PRE2_HOOK_POINTS[:1]
PRE2_SLOW = PRE2_HOOK_POINTS[1:6]
PRE2_MARKERS = [2, 4]  # SIGKILL both ranks once the journals hold this many shards in all


def sweep_precompute_2ranks(
    z: Zygote, s: PrecomputeSetup, root: Path, points: list[tuple[int, int]], markers: list[int]
) -> Tally:
    t = Tally("precompute, 2 ranks")
    resume_ranks = 1
    for r, n in points:
        cache = root / f"rank{r}-{n}"
        log = root / f"rank{r}-{n}.log"
        codes = z.run(
            precompute_argv(s, cache),
            log,
            nproc=2,
            WANDISTILL_FAULT=f"precompute:record:{n}:{r}",
        )
        # The killed rank dies; the other gets SIGTERM and stops cleanly (143), or had finished
        # and fails at the final barrier (1; if the SIGTERM comes after it restored the default
        # handlers on its way out: -15). Never a complete manifest.
        assert codes[r] == -signal.SIGKILL, f"rank {r} record {n}: {codes}\n{logs(log, 2)}"
        other = codes[1 - r]
        assert other in (143, 1, -signal.SIGTERM), f"rank {r} record {n}: {codes}\n{logs(log, 2)}"
        if other == 143:
            assert "stopped by SIGTERM after" in logs(log, 2)
        before = check_partial(s, cache, t)
        resume_and_check(z, s, cache, before, t, nproc=resume_ranks)
        resume_ranks = 3 - resume_ranks  # alternate: resume with 1 process, then 2
        t.killed.append(f"rank {r} record {n}")
    for k in markers:
        cache = root / f"job-{k}"
        pids = z.start(precompute_argv(s, cache), root / f"job-{k}.log", nproc=2)
        codes = kill_when(z, pids, _journal_has(cache, k, ranks=(0, 1)))
        if codes == [0, 0]:
            t.missed.append(f"job at {k} shards")
            continue
        resume_and_check(z, s, cache, check_partial(s, cache, t), t, nproc=resume_ranks)
        resume_ranks = 3 - resume_ranks
        t.killed.append(f"job at {k} shards")
    return t


@pytest.mark.dist
def test_precompute_2_ranks_one_rank_killed_then_rerun(
    zygote: Zygote, pre: PrecomputeSetup, tmp_path: Path
) -> None:
    t = sweep_precompute_2ranks(zygote, pre, tmp_path, PRE2_FAST, [])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0 and len(t.killed) == 1


@pytest.mark.slow
@pytest.mark.dist
def test_precompute_2_ranks_killed_at_seeded_points_then_rerun(
    zygote: Zygote, pre: PrecomputeSetup, tmp_path: Path
) -> None:
    t = sweep_precompute_2ranks(zygote, pre, tmp_path, PRE2_SLOW, PRE2_MARKERS)
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0
    assert len(t.killed) >= len(PRE2_SLOW)


# --------------------------------------------------------------------------- train

STEPS = 12
EVERY = 3


@dataclass(frozen=True)
class TrainSetup:
    cache: Path
    reference: Path


def train_argv(s: TrainSetup, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--cache",
        str(s.cache),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *("--set", "batch_size=2"),  # 18 samples: 9 steps per epoch, so the run crosses one
        *("--set", f"checkpoint_every={EVERY}"),
        *("--set", "keep_checkpoints=2"),
        *("--set", "log_every=1"),
        *("--set", "loss.final_latent=0.5"),
        *("--set", "optim.warmup_steps=2"),
        *("--set", "student.num_layers=1"),
        *("--set", "student.num_attention_heads=2"),
        *("--set", "student.attention_head_dim=12"),
        *("--set", "student.ffn_dim=32"),
        *("--set", 'device="cpu"'),
        *("--set", "tensorboard=false"),
        *("--set", "data_threads=1"),
        *extra,
    ]


WEIGHTS = [f"{d}/diffusion_pytorch_model.safetensors" for d in ("student", "student_ema")]


def loss_rows(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def trn(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> TrainSetup:
    root = tmp_path_factory.mktemp("kill-train")
    write_cache(root / "cache", range(6))
    s = TrainSetup(root / "cache", root / "reference")
    codes = zygote.run(train_argv(s, s.reference), root / "reference.log")
    assert codes == [0], logs(root / "reference.log")
    assert [step for step, _ in loss_rows(s.reference)] == list(range(1, STEPS + 1))
    return s


def resume_train_and_check(z: Zygote, s: TrainSetup, out: Path, label: str, t: Tally) -> None:
    log = out.with_suffix(".resume.log")
    codes = z.run(train_argv(s, out, "--resume"), log)
    assert codes == [0], f"{label}: {logs(log)}"
    for name in WEIGHTS:
        if (out / name).read_bytes() != (s.reference / name).read_bytes():
            t.mismatched += 1
    # Every step's metrics row exactly once (a resume drops the rows the dead run logged after
    # its checkpoint), with the reference's loss.
    rows = loss_rows(out)
    steps = [step for step, _ in rows]
    t.lost += len(set(range(1, STEPS + 1)) - set(steps))
    t.duplicated += len(steps) - len(set(steps))
    ref = dict(loss_rows(s.reference))
    t.mismatched += sum(loss != ref.get(step) for step, loss in dict(rows).items())


def latest_step(out: Path) -> int:
    latest = resolve_latest(out / "checkpoints")
    return int(latest.name.split("-")[1]) if latest else 0


TRAIN_HOOK_POINTS = [("step", n) for n in range(1, STEPS + 1)] + [
    ("saved", n) for n in range(EVERY, STEPS + 1, EVERY)
]
random.Random(SEED + 2).shuffle(TRAIN_HOOK_POINTS)
TRAIN_FAST = TRAIN_HOOK_POINTS[:4]


def _metrics_row(out: Path, step: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            text = (out / "metrics.jsonl").read_text()
        except FileNotFoundError:
            return False
        return f'"step": {step}, "epoch"' in text

    return ready


TRAIN_MARKERS: list[tuple[str, int]] = [
    *(("metrics", k) for k in sorted(random.Random(SEED + 3).sample(range(1, STEPS), 2))),
    ("ckpt-tmp", 6),
    ("export", STEPS),
]


def sweep_train(
    z: Zygote, s: TrainSetup, root: Path, points: list[tuple[str, int]], markers: list
) -> Tally:
    t = Tally("train, 1 rank")
    for point, n in points:
        out = root / f"{point}-{n}"
        log = root / f"{point}-{n}.log"
        codes = z.run(train_argv(s, out), log, WANDISTILL_FAULT=f"train:{point}:{n}")
        assert codes == [-signal.SIGKILL], f"{point} {n}: {codes}\n{logs(log)}"
        # After step n (before its checkpoint) the newest checkpoint is the one before it.
        want = n if point == "saved" else (n - 1) // EVERY * EVERY
        assert latest_step(out) == want, f"{point} {n}"
        assert not (out / "student").exists()
        resume_train_and_check(z, s, out, f"{point} {n}", t)
        t.killed.append(f"{point} {n}")
    for kind, k in markers:
        out = root / f"{kind}-{k}"
        if kind == "metrics":
            ready = _metrics_row(out, k)
        elif kind == "ckpt-tmp":
            ckpts = out / "checkpoints"
            ready = lambda c=ckpts, k=k: c.is_dir() and any(c.glob(f".checkpoint-{k}.*"))  # noqa: E731
        else:
            ready = lambda o=out: (o / "student").exists()  # noqa: E731
        pids = z.start(train_argv(s, out), root / f"{kind}-{k}.log")
        codes = kill_when(z, pids, ready)
        if codes == [0]:
            t.missed.append(f"{kind} {k}")
            continue
        assert codes == [-signal.SIGKILL], f"{kind} {k}: {codes}"
        resume_train_and_check(z, s, out, f"{kind} {k}", t)
        t.killed.append(f"{kind} {k}")
    return t


def test_train_kill_9_at_seeded_steps_then_resume(
    zygote: Zygote, trn: TrainSetup, tmp_path: Path
) -> None:
    t = sweep_train(zygote, trn, tmp_path, TRAIN_FAST, [])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0 and len(t.killed) == 4


@pytest.mark.slow
def test_train_kill_9_at_every_step_and_checkpoint_then_resume(
    zygote: Zygote, trn: TrainSetup, tmp_path: Path
) -> None:
    t = sweep_train(zygote, trn, tmp_path, TRAIN_HOOK_POINTS[4:], TRAIN_MARKERS)
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0
    assert len(t.killed) >= len(TRAIN_HOOK_POINTS) - 4
