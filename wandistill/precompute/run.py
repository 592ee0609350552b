"""`wandistill precompute`: the only place the teacher is ever loaded.

Phases, so that at most one big model is resident at a time:
1. encode: tokenizer + UMT5 over this rank's prompts (and the negative prompts), then freed; the
   embeddings go to the cache's embedding store as they are made (`encode_phase.py`), so memory
   does not grow with the prompt file and a resume never encodes a prompt twice;
2. denoise: the transformer (Wan 2.2: `transformer` for the high-noise steps of a group of
   batches, then `transformer_2` for their low-noise steps), records written as batches finish;
3. previews: optionally, the VAE decodes the first few final latents to PNG for eval.

What the cache records of the teacher and sampler (settings, steps, manifest header) is
`precompute.header`; phase 3 and the job's summary are `precompute.finish`.

Work is split in global batches of `sampler.batch_size` prompts in file order; rank r of W takes
batches r, r+W, ... so a batch is computed identically whatever W, and the records are the same
bytes as a single-process run. Resume is per batch: a batch whose keys are all committed is
skipped; any other batch is recomputed whole (same inputs, same bits) and the writer drops keys
that were already committed.

SIGTERM / SIGINT (`failures.StopSignals`, installed in `run` only): the batch being computed is
dropped, the open shard is flushed so every complete record is committed, and the run raises
`Stopped` (exit code 143 / 130, "re-run the same command to resume"). Under torchrun every rank
does this for its own shards; the manifest is then never marked complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wandistill.cache import manifest as mf
from wandistill.cache.background import BackgroundWriter
from wandistill.cache.contract import Record, record_key
from wandistill.cache.embeds import EmbedStore, own_negative_name
from wandistill.cache.writer import CacheWriter
from wandistill.checks.finite import NonFiniteError
from wandistill.config import PrecomputeConfig
from wandistill.io import outputs, storage
from wandistill.placement.estimate import SamplerSizes, dtype_from_name
from wandistill.precompute import job, parts
from wandistill.precompute.encode_phase import EncodeJob, TextEncoder, encode_phase, recipe_negative
from wandistill.precompute.finish import Summary, _finalise, _stopped
from wandistill.precompute.header import (
    _dims,
    _header,
    _recorded_experts,
    _spec,
    recorded_steps,
    sampler_settings,
)
from wandistill.precompute.job import prompt_sha256
from wandistill.precompute.numerics import follow_recorded_threads
from wandistill.precompute.parts import Part
from wandistill.precompute.prompts import Prompt, PromptReport, read_prompts
from wandistill.precompute.table import KeyTable, PromptTable
from wandistill.runtime import dist, faults
from wandistill.runtime.failures import StopRequested, StopSignals
from wandistill.runtime.progress import Progress
from wandistill.teacher.folder import TeacherFolder
from wandistill.teacher.sampler import Job, RecordingSampler


def _key(p: Prompt, settings: dict[str, Any]) -> str:
    own = {} if p.negative_prompt is None else {"negative_prompt": p.negative_prompt}
    return record_key(p.text, p.seed, {**settings, **own})


def run(
    cfg: PrecomputeConfig,
    *,
    null_sink: bool = False,
    quiet: bool = False,
    part: Part | None = None,
) -> Summary:
    """Run precompute as this process's rank; rank 0 finalizes the manifest at the end.

    `part` (`--part I/N`, `parts.resolve`): only that slice of the prompt list, into a cache of
    its own under `cache.path` (wandistill/precompute/parts.py)."""
    t0 = time.perf_counter()
    root = storage.describe(cfg.cache.path)
    cfg = job.for_part(cfg, part)
    teacher = TeacherFolder.open(cfg.teacher.path, flow_shift=cfg.sampler.flow_shift)
    recorded_steps(teacher, cfg)  # a K off the teacher's schedule fails before any work
    prompts, report = read_prompts(cfg.prompts, base_seed=cfg.sampler.seed, into=PromptTable())
    with StopSignals.install() as stop, contextlib.ExitStack() as owned:
        info = job.join(cfg)
        try:
            w = _plan(
                cfg, teacher, prompts, info, null_sink=null_sink, quiet=quiet, part=part, root=root
            )
            return _run(w, report, stop, owned, t0)
        except StopRequested:  # before any record: nothing to flush (embeddings commit themselves)
            raise _stopped(stop.signum, 0, info) from None
        finally:
            dist.cleanup()


def _run(
    w: Work, report: PromptReport, stop: StopSignals, owned: contextlib.ExitStack, t0: float
) -> Summary:
    """The phases, in order: own the cache, encode, denoise and write, finalise."""
    if not w.null_sink:  # every input checked: own the cache (one writing job), then write
        inputs = {"--teacher": w.teacher.path, "--prompts": w.cfg.prompts}
        owned.enter_context(outputs.claim(w.cache, "cache", w.info, inputs=inputs))
    enc = _encode(w, stop)
    try:
        _denoise_and_write(w, enc, stop)
    finally:
        enc.store.close_reader()
        if enc.local:
            shutil.rmtree(enc.scratch, ignore_errors=True)
    return _finalise(w, enc, report, stop, t0)


@dataclass(slots=True)
class Work:
    """What every phase needs, resolved once from the config, the teacher folder and the cache
    before any weights load (a bad input fails here, with nothing written)."""

    cfg: PrecomputeConfig
    teacher: TeacherFolder
    info: dist.DistInfo
    prompts: PromptTable
    keys: KeyTable
    settings: dict[str, Any]
    header: mf.Manifest
    shape: tuple[int, ...]
    mine: list[range]
    """This rank's batches (indices into prompts)."""
    todo: list[range]
    """Those of them with a key not yet committed."""
    load_kw: dict[str, Any]
    null_sink: bool
    quiet: bool
    part: Part | None = None
    """This job's part of the prompt list (None: all of it)."""
    present: int = 0
    """Records of this prompt file committed when this rank planned (the summary takes the
    least over ranks: a rank that planned late may see another's first shards of this run)."""
    store: storage.Storage | None = None
    """The cache, opened once when planning: its checks and the writer share it (None with
    --null-sink, which writes no cache)."""

    @property
    def cache(self) -> str:
        """A local folder or an fsspec URL (as text: a Path would fold `s3://` to `s3:/`)."""
        return storage.describe(self.cfg.cache.path)


def _plan(
    cfg: PrecomputeConfig,
    teacher: TeacherFolder,
    prompts: PromptTable,
    info: dist.DistInfo,
    *,
    null_sink: bool,
    quiet: bool,
    part: Part | None = None,
    root: str = "",
) -> Work:
    """This rank's work: the cache header, which batches are still to do, the placement."""
    from wandistill.placement import load as pl

    dtype, sm = dtype_from_name(cfg.teacher.dtype), cfg.sampler
    settings = sampler_settings(teacher, cfg)
    cache = storage.describe(cfg.cache.path)
    st = None if null_sink else storage.open_storage(cache)
    existing = None if st is None else _with_records(st)
    # A cache with records fixes the CPU thread count new records are computed with.
    recorded = (existing.numerics or {}) if existing is not None else {}
    threads_note = follow_recorded_threads(recorded, info.device)
    header = _header(cfg, teacher, info, settings)
    if part is not None and not null_sink:  # before anything of the part is read or written
        if not storage.is_url(cache):  # (a URL is checked by the claim itself)
            inputs = {"--teacher": teacher.path, "--prompts": cfg.prompts}
            outputs.check(cache, "cache", inputs=inputs)
        parts.check_and_record(root, part, header, prompt_sha256(cfg.prompts), cfg.prompts)
    if storage.is_url(cache) and cfg.previews > 0:  # PNG previews need a local folder
        if info.is_main and not quiet:
            print(f"precompute: previews off: {cache} is not a local folder (PNG previews are)")
        cfg = dataclasses.replace(cfg, previews=0)
    if st is not None and existing is not None:  # checked before loading any weights
        mf.check_compatible(st, existing, header)
    done = set() if existing is None else {k for s in existing.shards for k in s.keys}
    if threads_note and info.is_main and not quiet:  # said once the cache accepted this run
        print(threads_note, flush=True)
    keys = KeyTable(_key(p, settings) for p in prompts)
    bs = cfg.sampler.batch_size
    batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
    if part is not None:
        batches = part.take(batches)  # this part's batches; its ranks share them as below
    mine = batches[info.rank :: info.world_size]
    placement = pl.resolve_placement(
        cfg.teacher.placement,
        folder=teacher,
        dtype=dtype,
        sizes=SamplerSizes.from_config(cfg),  # the sizes `wandistill plan` plans for
        world_size=info.world_size,
        local_rank=info.local_rank,
    )
    scratch = Path(cache, ".offload.tmp")  # in a local cache: the next claim cleans its temps
    if storage.is_url(cache):
        scratch = Path(tempfile.gettempdir(), "wandistill.offload.tmp")
    offload = Path(cfg.teacher.offload_folder or scratch)
    load_kw = {"dtype": dtype, "placement": placement, "offload_dir": offload / f"rank{info.rank}"}
    return Work(
        cfg=cfg,
        teacher=teacher,
        info=info,
        prompts=prompts,
        keys=keys,
        settings=settings,
        header=header,
        shape=teacher.latent_shape(num_frames=sm.num_frames, height=sm.height, width=sm.width),
        mine=mine,
        todo=[b for b in mine if not all(keys[i] in done for i in b)],
        load_kw=load_kw,
        null_sink=null_sink,
        quiet=quiet,
        part=part,
        present=sum(k in done for k in keys),
        store=st,
    )


def _with_records(st: storage.Storage) -> mf.Manifest | None:
    """The cache's manifest if it has records: they bind the run to its header. (A cache
    without records binds nothing: a fixed run takes it over.)"""
    existing = mf.load_committed(st) if mf.has_manifest(st) else None
    return existing if existing is not None and existing.shards else None


@dataclass(slots=True)
class Encoded:
    """Phase 1's result: the embedding store, the recipe's negative, the opened cache writer."""

    store: EmbedStore
    scratch: Path
    """Where the store lives: the cache, or a local temp folder with --null-sink or a cache at
    a URL (an interrupted run then encodes again)."""
    default_negative: torch.Tensor
    writer: BackgroundWriter | None
    """None with --null-sink."""
    local: bool = False
    """The store is in a temp folder of its own, removed at the end."""
    prompts_encoded: int = 0


def _encode(w: Work, stop: StopSignals) -> Encoded:
    """Phase 1: text embeddings for the prompts still to do, straight to disk (embeds/). The
    cache (manifest, shared tensors) is created first, so embeds/ only ever lives in a cache."""
    info = w.info
    local = w.null_sink or storage.is_url(w.cache)
    scratch = Path(tempfile.mkdtemp(prefix="wandistill-embeds-")) if local else Path(w.cache)
    store = EmbedStore(scratch, rank=info.rank, flush_records=w.cfg.cache.shard_records)
    job = EncodeJob(
        teacher=w.teacher,
        prompts=w.prompts,
        keys=w.keys,
        batches=w.todo,
        negative_prompt=w.cfg.sampler.negative_prompt,
        max_sequence_length=w.cfg.sampler.max_sequence_length,
        dtype=w.load_kw["dtype"],
        load_kw=w.load_kw,
        rank=info.rank,
        show_progress=info.is_main and not w.quiet,
    )
    encoder = TextEncoder(job, stop.interruptible)
    try:
        negative = recipe_negative(job, store, encoder)
        writer = None if w.null_sink else _open_writer(w, negative)
        enc = Encoded(store, scratch, negative, writer, local=local)
        enc.prompts_encoded = encode_phase(job, store, encoder, stop.check)
        return enc
    except BaseException:
        if local:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        encoder.close()


def _open_writer(w: Work, negative: torch.Tensor) -> BackgroundWriter:
    """Create (or reopen) the cache: manifest and shared tensors, before any record. Records
    are written by a thread (two batches in flight at most) while the next batch denoises."""
    sampler = RecordingSampler(w.teacher.scheduler, _spec(w))
    timesteps, sigmas = sampler.schedule()
    assert w.store is not None  # --null-sink opens no writer
    writer = CacheWriter(
        w.store,
        backend=w.cfg.cache.backend,
        teacher=w.header.block_json("teacher"),
        settings=w.settings,
        fields=w.header.block_json("fields"),
        dims=_dims(w.teacher, w.shape, w.settings) | _recorded_experts(sampler, timesteps),
        numerics=w.header.numerics,
        shared={"negative_prompt_embeds": negative, "timesteps": timesteps, "sigmas": sigmas},
        rank=w.info.rank,
        shard_records=w.cfg.cache.shard_records,
    )
    return BackgroundWriter(writer, depth=2 * w.cfg.sampler.batch_size)


def _job(w: Work, enc: Encoded, i: int) -> Job:
    """Prompt i's denoising job; its embeddings streamed from the store."""
    p, key = w.prompts[i], w.keys[i]
    own = p.negative_prompt is not None
    return Job(
        key=key,
        prompt=p.text,
        seed=p.seed,
        embeds=enc.store.get(key),
        negative=enc.store.get(own_negative_name(key)) if own else enc.default_negative,
        own_negative=own,
        extra={"line": p.line, **({"negative_prompt": p.negative_prompt} if own else {})},
    )


def _denoise_and_write(w: Work, enc: Encoded, stop: StopSignals) -> None:
    """Phase 2: denoise this rank's batches, a group at a time, writing each group's records as
    it finishes. A stop drops the group being computed and commits every complete record."""
    writer, info = enc.writer, w.info
    total = sum(len(b) for b in w.mine)
    progress = Progress(  # records of an earlier run count towards the total, not the rate
        total=total,
        description="precompute",
        enabled=info.is_main and not w.quiet,
        unit="prompts",
        initial=total - sum(len(b) for b in w.todo),
    )
    # Batches per expert swap (Wan 2.2); one expert: one batch at a time, written as it finishes.
    group = max(1, w.cfg.sampler.expert_group_batches) if len(w.teacher.experts) > 1 else 1
    denoiser = _Denoiser(w)
    handed = 0  # records handed to the writer by this run (the test hook counts them)
    faults.at("precompute", "record", 0, info.rank)
    try:
        with progress:
            for g0 in range(0, len(w.todo), group):
                records = denoiser.group(enc, stop, w.todo[g0 : g0 + group])
                handed = _hand_over(records, writer, handed, info.rank, progress)
                stop.check()  # between batches: nothing half-written
            if writer is not None:
                writer.drain()  # a late write error is raised here, under the handlers below
    except (StopRequested, NonFiniteError) as e:
        if writer is not None:  # commit the complete records (before the refused batch)
            writer.close()
        if isinstance(e, StopRequested):
            raise _stopped(stop.signum, writer.records_written if writer else 0, info) from None
        raise
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        denoiser.unload()


def _hand_over(
    records: list[list[Record]],
    writer: BackgroundWriter | None,
    handed: int,
    rank: int,
    progress: Progress,
) -> int:
    """Queue a group's records for the writer thread, batch by batch; returns the number of
    records this run has handed over so far (the test hook's count)."""
    for batch in records:
        for rec in batch:
            if writer is not None:
                writer.write(rec)
            handed += 1
            if writer is not None and faults.wants("precompute", "record", handed, rank):
                writer.drain()  # a test point acts on what is written by then
            faults.at("precompute", "record", handed, rank)
        progress.advance(len(batch), bytes_total=writer.bytes_written if writer else 0)
    return handed


class _Denoiser:
    """The denoiser(s), one in memory at a time (Wan 2.2 swaps `transformer` and
    `transformer_2`, loaded on first use), and the recording sampler that drives them."""

    def __init__(self, w: Work) -> None:
        self.w = w
        self.sampler = RecordingSampler(w.teacher.scheduler, _spec(w))
        self.resident: dict[str, torch.nn.Module] = {}

    def group(self, enc: Encoded, stop: StopSignals, batches: list[range]) -> list[list[Record]]:
        """Every step of every expert over a group of batches; their records, batch by batch.
        A signal inside drops the whole group: none of it was written yet."""
        from wandistill.placement import load as pl

        states = None
        for expert in self.w.teacher.experts:
            with stop.interruptible():
                model = self._load(expert)
                device = pl.execution_device(model)
                if states is None:
                    jobs = [[_job(self.w, enc, i) for i in b] for b in batches]
                    states = [self.sampler.start(j, device) for j in jobs]
                with pl.oom_guard_for(model):
                    for st in states:
                        self.sampler.advance(st, model, expert, device)
        assert states is not None
        return [list(self.sampler.finish(st)) for st in states]

    def _load(self, expert: str) -> torch.nn.Module:
        from wandistill.placement import load as pl

        model = self.resident.get(expert)
        if model is None:
            self.unload()  # one expert in memory at a time
            model = pl.load_component(self.w.teacher, expert, **self.w.load_kw)
            self.resident[expert] = model
        return model

    def unload(self) -> None:
        from wandistill.placement import load as pl

        for other in list(self.resident):
            pl.unload(self.resident.pop(other))
