"""`wandistill precompute`: the only place the teacher is ever loaded.

Phases, so that at most one big model is resident at a time:
1. encode: tokenizer + UMT5 over this rank's prompts (and the negative prompts), then freed; the
   embeddings go to the cache's embedding store as they are made (`encode_phase.py`), so memory
   does not grow with the prompt file and a resume never encodes a prompt twice;
2. denoise: the transformer (Wan 2.2: `transformer` for the high-noise steps of a group of
   batches, then `transformer_2` for their low-noise steps), records written as batches finish;
3. previews: optionally, the VAE decodes the first few final latents to PNG for eval.

Work is split in global batches of `sampler.batch_size` prompts in file order; rank r of W takes
batches r, r+W, ... so a batch is computed identically whatever W, and the records are the same
bytes as a single-process run. Resume is per batch: a batch whose keys are all committed is
skipped; any other batch is recomputed whole (same inputs, same bits) and the writer drops keys
that were already committed.

SIGTERM / SIGINT (`_StopSignals`, installed in `run` only): the batch being computed is dropped,
the open shard is flushed so every complete record is committed, and the run raises `Stopped`
(exit code 143 / 130, "re-run the same command to resume"). Under torchrun every rank does this
for its own shards; the manifest is then never marked complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from wandistill import dist, outputs, storage, testing_hooks
from wandistill.cache import manifest as mf
from wandistill.cache.embeds import EmbedStore, own_negative_name
from wandistill.cache.schema import dtype_name, field_specs, record_key
from wandistill.cache.writer import CacheWriter
from wandistill.config import PrecomputeConfig, to_dict
from wandistill.errors import UsageError, WandistillError
from wandistill.finite import NonFiniteError
from wandistill.placements import Placement
from wandistill.precompute.encode_phase import EncodeJob, TextEncoder, encode_phase, recipe_negative
from wandistill.precompute.numerics import record_numerics
from wandistill.precompute.prompts import Prompt, PromptReport, read_prompts
from wandistill.precompute.table import KeyTable, PromptTable
from wandistill.progress import Progress
from wandistill.teacher.folder import TeacherFolder
from wandistill.teacher.plan import SamplerSizes
from wandistill.teacher.sampler import CFG_FORMULA, Job, RecordingSampler, SamplerSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Summary:
    cache: str
    records_written: int
    records_skipped: int
    bytes_written: int
    seconds: float
    prompts: int
    prompts_encoded: int = 0
    """Prompts this process ran through the text encoder (0 when a resume found them all)."""


Teacher = TeacherFolder
"""What precompute knows of a teacher before loading weights: the folder, opened once."""


def inspect_teacher(path: str | Path, flow_shift: float | None) -> Teacher:
    """The teacher folder, validated (custom code, pickles, bad configs refused), with the
    recipe's flow_shift override applied to its scheduler."""
    return TeacherFolder.open(path, flow_shift=flow_shift)


def latent_shape(teacher: Teacher, cfg: PrecomputeConfig) -> tuple[int, int, int, int]:
    s = cfg.sampler
    c, f, h, w = teacher.latent_shape(num_frames=s.num_frames, height=s.height, width=s.width)
    return c, f, h, w


def sampler_settings(teacher: Teacher, cfg: PrecomputeConfig) -> dict[str, Any]:
    """Everything that changes the teacher's output for a prompt and seed (the cache key)."""
    s = cfg.sampler
    g2 = s.guidance_scale_2 if s.guidance_scale_2 is not None else s.guidance_scale
    return {
        "scheduler": type(teacher.scheduler).__name__,
        "scheduler_config": json.loads(json.dumps(dict(teacher.scheduler.config), default=str)),
        "num_inference_steps": s.num_inference_steps,
        "flow_shift": teacher.scheduler.config.get("flow_shift"),
        "guidance_scale": s.guidance_scale,
        "guidance_scale_2": g2 if teacher.boundary_ratio is not None else None,
        "boundary_ratio": teacher.boundary_ratio,
        "cfg_formula": CFG_FORMULA if s.guidance_scale > 1.0 else "cond (guidance_scale <= 1)",
        "negative_prompt": s.negative_prompt,
        "height": s.height,
        "width": s.width,
        "num_frames": s.num_frames,
        "dtype": cfg.teacher.dtype,
        "max_sequence_length": s.max_sequence_length,
        "record_steps": recorded_steps(teacher, cfg),
        "features": list(s.features),
        "holdout_fraction": cfg.cache.holdout_fraction,
        "expand_timesteps": teacher.expand_timesteps,
    }


def recorded_steps(teacher: Teacher, cfg: PrecomputeConfig) -> list[int]:
    """The steps to record; `sampler.record_for_student_steps` is placed by the teacher's own
    scheduler (wandistill.student.schedule), so it names what the student will sample at."""
    from wandistill.student.schedule import student_steps_for

    s = cfg.sampler
    if not s.record_for_student_steps:
        return s.recorded_steps()
    return s.recorded_steps(student_steps_for(teacher.scheduler, s.num_inference_steps))


def _key(p: Prompt, settings: dict[str, Any]) -> str:
    own = {} if p.negative_prompt is None else {"negative_prompt": p.negative_prompt}
    return record_key(p.text, p.seed, {**settings, **own})


def _device_kind(placement: Placement) -> str:
    """The device torchrun ranks bind to: CPU placements use gloo, the rest the rank's GPU."""
    import torch

    if placement.cpu_only or not torch.cuda.is_available():
        return "cpu"
    return "auto"


class Stopped(WandistillError):
    """Precompute stopped on SIGTERM / SIGINT; what it wrote is committed. Exit 128 + signal."""

    def __init__(self, signum: int, records: int, info: dist.DistInfo | None) -> None:
        where = f" (rank {info.rank} of {info.world_size})" if info and info.distributed else ""
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after {records} records{where}; "
            "re-run the same command to resume"
        )
        self.signum = signum
        self.exit_code = 128 + signum


class _Stop(BaseException):
    """Raised by the signal handler inside an interruptible section (nothing being written)."""


class _StopSignals:
    """SIGTERM / SIGINT -> a graceful stop; installed once, around the whole stage.

    The first signal is recorded. Inside `interruptible()` (teacher loading, text encoding,
    denoising: nothing is being written) it raises `_Stop` at once, dropping the batch being
    computed; elsewhere (cache writes, shard flushes, the final barrier) the run stops at the next
    `check()`, so no shard is ever published half-written. Later signals are ignored, the stop is
    under way (a Ctrl-C under torchrun brings SIGINT from the terminal and SIGTERM from torchrun),
    except a second Ctrl-C: KeyboardInterrupt, at once (the open shard is dropped, not flushed).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self._armed:
                self._armed = False
                raise _Stop
        elif signum == self.signum == signal.SIGINT:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self._armed = True
        try:
            self.check()
            yield
        finally:
            self._armed = False

    def check(self) -> None:
        if self.signum is not None:
            raise _Stop


def run(cfg: PrecomputeConfig, *, null_sink: bool = False, quiet: bool = False) -> Summary:
    """Run precompute as this process's rank; rank 0 finalizes the manifest at the end."""
    t0 = time.perf_counter()
    teacher = inspect_teacher(cfg.teacher.path, cfg.sampler.flow_shift)
    recorded_steps(teacher, cfg)  # a K off the teacher's schedule fails before any work
    prompts, report = read_prompts(cfg.prompts, base_seed=cfg.sampler.seed, into=PromptTable())
    with _StopSignals() as stop, contextlib.ExitStack() as owned:
        info = dist.init(
            _device_kind(cfg.teacher.placement),
            timeout_s=cfg.dist_timeout,
            config=run_identity(cfg),
        )
        try:
            return _run(
                cfg, teacher, prompts, report, info, stop, owned,
                null_sink=null_sink, quiet=quiet, t0=t0,
            )  # fmt: skip
        except _Stop:  # before any record: nothing to flush (embeddings commit themselves)
            raise Stopped(stop.signum or signal.SIGTERM, 0, info) from None
        finally:
            dist.cleanup()


def _run(
    cfg: PrecomputeConfig,
    teacher: Teacher,
    prompts: PromptTable,
    report: PromptReport,
    info: dist.DistInfo,
    stop: _StopSignals,
    owned: contextlib.ExitStack,
    *,
    null_sink: bool,
    quiet: bool,
    t0: float,
) -> Summary:
    from wandistill.teacher import placement as pl

    dtype = DTYPES[cfg.teacher.dtype]
    settings = sampler_settings(teacher, cfg)
    fingerprint = dict(teacher.fingerprint)
    fingerprint["transformer_config"] = teacher.transformer_config
    shape = latent_shape(teacher, cfg)
    cache = storage.describe(cfg.cache.path)  # a path or an fsspec URL (text: Path folds `//`)
    remote = storage.is_url(cache)
    if remote and cfg.previews > 0:
        raise UsageError(
            f"precompute.previews = {cfg.previews}: previews are PNG files written next to a "
            f"local cache, and {cache!r} is an object store",
            fix="set precompute.previews=0 for a cache at a URL",
        )
    header = mf.Manifest(
        backend=cfg.cache.backend,
        teacher=fingerprint,
        settings=settings,
        numerics=record_numerics(batch_size=cfg.sampler.batch_size, device=info.device),
        fields=field_specs(
            latent_dtype=torch.float32,
            model_dtype=dtype,
            embed_dtype=dtype,
            features=list(cfg.sampler.features),
        ),
    )
    done: set[str] = set()
    if not null_sink and mf.has_manifest(cache):
        existing = mf.load_committed(cache)
        if existing.shards:  # a cache without records binds nothing: a fixed run takes it over
            mf.check_compatible(cache, existing, header)  # fail before loading any weights
        done = {k for s in existing.shards for k in s["keys"]}

    keys = KeyTable(_key(p, settings) for p in prompts)
    bs = cfg.sampler.batch_size
    batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
    mine = batches[info.rank :: info.world_size]
    todo = [b for b in mine if not all(keys[i] in done for i in b)]
    placement = pl.resolve_placement(
        cfg.teacher.placement,
        folder=teacher,
        dtype=dtype,
        sizes=SamplerSizes.from_config(cfg),  # the sizes `wandistill plan` plans for
        world_size=info.world_size,
        local_rank=info.local_rank,
    )
    if not null_sink:  # every input checked: own the cache (one writing job), then write
        inputs = {"--teacher": teacher.path, "--prompts": cfg.prompts}
        owned.enter_context(outputs.claim(cache, "cache", info, inputs=inputs))
    load_kw: dict[str, Any] = dict(
        dtype=dtype,
        placement=placement,
        offload_dir=Path(cfg.teacher.offload_folder or _scratch(cache, ".offload.tmp"))
        / f"rank{info.rank}",
    )

    # Phase 1: text embeddings for the prompts still to do, straight to disk (embeds/). The
    # cache (manifest, shared tensors) is created first, so embeds/ only ever lives in a cache.
    # A cache at a URL keeps them in a local temp folder (an interrupted run encodes again).
    local_scratch = null_sink or remote
    scratch = Path(tempfile.mkdtemp(prefix="wandistill-embeds-")) if local_scratch else cache
    store = EmbedStore(scratch, rank=info.rank, flush_records=cfg.cache.shard_records)
    ejob = EncodeJob(
        teacher=teacher,
        prompts=prompts,
        keys=keys,
        batches=todo,
        negative_prompt=cfg.sampler.negative_prompt,
        max_sequence_length=cfg.sampler.max_sequence_length,
        dtype=dtype,
        load_kw=load_kw,
        rank=info.rank,
        show_progress=info.is_main and not quiet,
    )
    encoder = TextEncoder(ejob, stop.interruptible)
    try:
        default_negative = recipe_negative(ejob, store, encoder)
        timesteps, sigmas = RecordingSampler(
            teacher.scheduler, _spec(cfg, teacher, shape)
        ).schedule()
        writer = (
            None
            if null_sink
            else CacheWriter(
                cache,
                backend=cfg.cache.backend,
                teacher=fingerprint,
                settings=settings,
                fields=header.fields,
                dims=_dims(teacher, shape, settings),
                numerics=header.numerics,
                shared={
                    "negative_prompt_embeds": default_negative,
                    "timesteps": timesteps,
                    "sigmas": sigmas,
                },
                rank=info.rank,
                shard_records=cfg.cache.shard_records,
            )
        )
        encoded = encode_phase(ejob, store, encoder, stop.check)
    except BaseException:
        if local_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        encoder.close()

    def job(i: int) -> Job:  # embeddings streamed from the store, one batch at a time
        p = prompts[i]
        own = p.negative_prompt is not None
        return Job(
            key=keys[i],
            prompt=p.text,
            seed=p.seed,
            embeds=store.get(keys[i]),
            negative=store.get(own_negative_name(keys[i])) if own else default_negative,
            own_negative=own,
            extra={"line": p.line, **({"negative_prompt": p.negative_prompt} if own else {})},
        )

    sampler = RecordingSampler(teacher.scheduler, _spec(cfg, teacher, shape))
    progress = Progress(
        total=sum(len(b) for b in mine),
        description="precompute",
        enabled=info.is_main and not quiet,
        unit="prompts",
    )
    progress.advance(sum(len(b) for b in mine) - sum(len(b) for b in todo))
    # Batches per expert swap (Wan 2.2); one expert: one batch at a time, written as it finishes.
    group = max(1, cfg.sampler.expert_group_batches) if len(teacher.experts) > 1 else 1
    resident: dict[str, torch.nn.Module] = {}
    handed = 0  # records handed to the writer by this run (the test hook counts them)
    testing_hooks.at("precompute", "record", 0, info.rank)
    try:
        with progress:
            for g0 in range(0, len(todo), max(1, group)):
                states = None
                for expert in teacher.experts:
                    with stop.interruptible():  # a signal drops these batches: none written yet
                        model = resident.get(expert)
                        if model is None:
                            for other in list(resident):  # one expert in memory at a time
                                pl.unload(resident.pop(other))
                            model = resident[expert] = pl.load_component(teacher, expert, **load_kw)
                        device = pl.execution_device(model)
                        if states is None:
                            states = [
                                sampler.start([job(i) for i in b], device)
                                for b in todo[g0 : g0 + group]
                            ]
                        with pl.oom_guard_for(model):
                            for st in states:
                                sampler.advance(st, model, expert, device)
                assert states is not None
                for st in states:
                    for rec in sampler.finish(st):
                        if writer is not None:
                            writer.write(rec)
                        handed += 1
                        testing_hooks.at("precompute", "record", handed, info.rank)
                    progress.advance(
                        len(st.jobs), bytes_total=writer.bytes_written if writer else 0
                    )
                stop.check()  # between batches: nothing half-written
    except _Stop:
        if writer is not None:
            writer.close()  # commit the open shard's complete records
        written = writer.records_written if writer else 0
        raise Stopped(stop.signum or signal.SIGTERM, written, info) from None
    except NonFiniteError:
        if writer is not None:
            writer.close()  # the records before the refused batch are good: commit them
        raise
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        for m in resident.values():
            pl.unload(m)
        store.close_reader()
        if local_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if writer is not None:
        writer.close()
        if cfg.previews > 0:
            _previews(cfg, teacher, prompts, keys, load_kw, info)
    _barrier(info, stop, writer.records_written if writer else 0)
    if writer is not None and info.is_main:
        mf.finalize(cache, complete=True)
        cut = store.truncated_keys()  # every rank's commits: which prompts were truncated
        report.truncated = [p.line for p, k in zip(prompts, keys, strict=True) if k in cut]
        storage.open_storage(cache).put(REPORT_NAME, _json_bytes(report.to_json()))
        if not remote:
            store.remove()  # every record holds its own embeddings now
    written = writer.records_written if writer else sum(len(b) for b in todo)
    return Summary(
        cache=str(cache),
        records_written=written,
        records_skipped=writer.records_skipped if writer else 0,
        bytes_written=writer.bytes_written if writer else 0,
        seconds=time.perf_counter() - t0,
        prompts=len(prompts),
        prompts_encoded=encoded,
    )


REPORT_NAME = "prompts_report.json"


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def _scratch(cache: str, name: str) -> Path:
    """A local scratch folder for the run: inside a local cache (its temps are cleaned by the
    next claim), in the system temp folder for a cache at a URL."""
    if storage.is_url(cache):
        return Path(tempfile.gettempdir()) / f"wandistill{name}"
    return Path(cache) / name


def run_identity(cfg: PrecomputeConfig) -> dict[str, Any]:
    """What every rank must agree on: the resolved config and the prompt file's bytes (a
    same-named but different file on another node would split the work inconsistently)."""
    sha = hashlib.sha256()
    with contextlib.suppress(OSError), open(cfg.prompts, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return {"precompute": to_dict(cfg), "prompt_file_sha256": sha.hexdigest()}


def _barrier(info: dist.DistInfo, stop: _StopSignals, records: int) -> None:
    """Wait for every rank before rank 0 marks the cache complete; never after a stop, and a
    rank that stopped or died on the way is one clear line, not a gloo traceback. No deadline
    while the others are alive (the last rank may still be denoising); `dist_timeout` once one
    has stopped beating."""
    if stop.signum is None:
        try:
            dist.wait_for_all(info, "precompute-done", lambda: stop.signum is not None)
        except dist.DistTimeout:
            raise
        except Exception as e:
            if stop.signum is None:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:300]  # gloo's "[pair.cc:553]"
                raise WandistillError(
                    f"rank {info.rank}: waiting for the other ranks failed, most likely because "
                    f"another rank stopped (see its error): {first}",
                    fix="fix that rank's error, then re-run the same command to resume",
                ) from None
    if stop.signum is not None:
        raise Stopped(stop.signum, records, info)


def _spec(cfg: PrecomputeConfig, teacher: Teacher, shape: tuple[int, int, int, int]) -> SamplerSpec:
    s = cfg.sampler
    boundary = (
        teacher.boundary_ratio * teacher.scheduler.config.num_train_timesteps
        if teacher.boundary_ratio is not None
        else None
    )
    return SamplerSpec(
        num_inference_steps=s.num_inference_steps,
        guidance_scale=s.guidance_scale,
        guidance_scale_2=s.guidance_scale_2 if s.guidance_scale_2 is not None else s.guidance_scale,
        boundary_timestep=boundary,
        expand_timesteps=teacher.expand_timesteps,
        record_steps=tuple(recorded_steps(teacher, cfg)),
        features=tuple(s.features),
        latent_shape=shape,
        max_sequence_length=s.max_sequence_length,
    )


def _dims(teacher: Teacher, shape: tuple[int, ...], settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "text_dim": int(teacher.transformer_config["text_dim"]),
        "latent_channels": int(shape[0]),
        "latent_shape": list(shape),
        "num_recorded_steps": len(settings["record_steps"]),
        "teacher_dtype": dtype_name(DTYPES[settings["dtype"]]),
    }


def _previews(
    cfg: PrecomputeConfig,
    teacher: Teacher,
    prompts: Sequence[Prompt],
    keys: Sequence[str],
    load_kw: dict[str, Any],
    info: dist.DistInfo,
) -> None:
    """Decode the first `previews` prompts' final latents (whichever rank wrote them)."""
    from wandistill.cache.reader import CacheStore
    from wandistill.teacher import placement as pl
    from wandistill.teacher.decode import decode_to_png

    out = Path(cfg.cache.path) / "previews"
    wanted = [k for k in keys[: cfg.previews] if not (out / f"{k}.png").exists()]
    with CacheStore(cfg.cache.path) as store:
        located = store.locate()
        mine = [k for k in wanted if k in located and located[k][0]["rank"] == info.rank]
        if not mine:
            return
        vae = pl.load_component(teacher, "vae", **load_kw)
        try:
            for k in mine:
                rec = store.read_record(*located[k])
                decode_to_png(vae, rec.final_latent, out / f"{k}.png")
        finally:
            pl.unload(vae)
