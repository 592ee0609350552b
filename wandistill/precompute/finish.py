"""Precompute's end: phase 3 (commit the last shard, previews, wait for every rank, mark the
cache complete, write the prompts report) and the job's `Summary`; a stop is `Stopped`, with
the records already committed."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wandistill.cache import manifest as mf
from wandistill.errors import UsageError, WandistillError
from wandistill.io import storage
from wandistill.precompute.prompts import PromptReport
from wandistill.runtime import dist
from wandistill.runtime.failures import Stopped, StopSignals
from wandistill.runtime.progress import SUMMARY_WIDTH, human_bytes, plural, summary_lines

if TYPE_CHECKING:
    from wandistill.precompute.run import Encoded, Work


@dataclass(slots=True)
class Summary:
    """The whole job's outcome (every rank's counts summed; every rank returns the same one),
    over this run and the runs of the same cache before it."""

    cache: str
    records_written: int
    """Records this run committed."""
    records_skipped: int
    """Records this run recomputed (a batch partly committed before) that the writer dropped."""
    bytes_written: int
    seconds: float
    prompts: int
    prompts_encoded: int = 0
    """Prompts this run ran through the text encoder (0 when a resume found them all)."""
    records_present: int = 0
    """Records of this prompt file already committed when this run started."""
    prompts_truncated: int = 0
    """Prompts cut to max_sequence_length tokens, by this run or an earlier one."""
    ranks: int = 1
    is_main: bool = True
    """Rank 0 (or a single process): the one that prints the summary."""

    def lines(self, width: int = SUMMARY_WIDTH) -> list[str]:
        """The closing summary, wrapped to `width` columns."""
        cached = self.records_present + self.records_written
        on = f" on {plural(self.ranks, 'rank')}" if self.ranks > 1 else ""
        return summary_lines(
            [
                f"cache: {self.records_written} records written this run,",
                f"{self.records_present} already there,",
                f"{self.records_skipped} recomputed and skipped;",
                f"{cached} of {plural(self.prompts, 'prompt')} in the cache,",
                f"{self.prompts_truncated} truncated;",
                f"{self.prompts_encoded} prompts encoded,",
                f"{human_bytes(self.bytes_written)} in {self.seconds:.1f} s{on};",
                f"cache folder {self.cache}",
            ],
            width,
        )


def _stopped(signum: int | None, records: int, info: dist.DistInfo | None) -> Stopped:
    """Precompute stopped on SIGTERM / SIGINT; what it wrote is committed."""
    progress = f"after {records} records"
    return Stopped(signum or signal.SIGTERM, progress, info, "re-run the same command to resume")


def _finalise(w: Work, enc: Encoded, report: PromptReport, stop: StopSignals, t0: float) -> Summary:
    """Phase 3: commit the last shard, previews, wait for every rank, sum every rank's counts;
    rank 0 marks the cache complete and writes the prompts report."""
    writer, info = enc.writer, w.info
    if writer is not None:
        writer.close()
        if w.cfg.previews > 0:
            _previews(w)
    _barrier(info, stop, writer.records_written if writer else 0)
    views = dist.all_gather_json(info, _rank_counts(w, enc))  # a collective: every rank
    cut = {k for v in views for k in v["truncated"]}
    if writer is not None and info.is_main:
        store = w.store  # the cache as the writer opened it
        mf.finalize(store, complete=True)
        cut |= set(_earlier_truncations(store))
        report.truncated_keys = [k for k in w.keys if k in cut]
        report.truncated = [p.line for p, k in zip(w.prompts, w.keys, strict=True) if k in cut]
        store.put(REPORT_NAME, (json.dumps(report.to_json(), indent=1) + "\n").encode())
        if not enc.local:
            enc.store.remove()  # every record holds its own embeddings now
    return Summary(
        cache=str(w.cache),
        records_written=sum(v["written"] for v in views),
        records_skipped=sum(v["skipped"] for v in views),
        bytes_written=sum(v["bytes"] for v in views),
        seconds=time.perf_counter() - t0,
        prompts=_prompts_in(w),
        prompts_encoded=sum(v["encoded"] for v in views),
        records_present=min(v["present"] for v in views),
        prompts_truncated=sum(k in cut for k in w.keys),
        ranks=info.world_size,
        is_main=info.is_main,
    )


def _prompts_in(w: Work) -> int:
    """The prompts this job owns: the whole file, or its part's batches."""
    if w.part is None:
        return len(w.prompts)
    n, bs = len(w.prompts), w.cfg.sampler.batch_size
    return sum(min(bs, n - b * bs) for b in w.part.take(range(-(-n // bs))))


def _rank_counts(w: Work, enc: Encoded) -> dict[str, Any]:
    """This rank's share of the summary, and the truncations it can see (its own commits at
    least: another rank's may not be visible yet on a network file system)."""
    writer = enc.writer
    return {
        "written": writer.records_written if writer else sum(len(b) for b in w.todo),
        "skipped": writer.records_skipped if writer else 0,
        "bytes": writer.bytes_written if writer else 0,
        "encoded": enc.prompts_encoded,
        "present": w.present,  # a rank that planned late may also count another's new records
        "truncated": enc.store.truncated_keys().names(),
    }


REPORT_NAME = "prompts_report.json"


def _earlier_truncations(store: storage.Storage) -> list[str]:
    """Truncated keys an earlier run of this cache recorded (its embedding store is gone)."""
    try:
        if not store.exists(REPORT_NAME):
            return []
        data = store.read(
            REPORT_NAME, max_bytes=1 << 30, what="prompts report", fix="", error=UsageError
        )
        keys = json.loads(data).get("truncated_keys", [])
    except (OSError, ValueError, AttributeError, WandistillError):
        return []  # a report we cannot read is rewritten from what this run knows
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def _barrier(info: dist.DistInfo, stop: StopSignals, records: int) -> None:
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
                raise WandistillError(
                    f"rank {info.rank}: waiting for the other ranks failed, most likely because "
                    f"another rank stopped (see its error): {dist.first_line(e)}",
                    fix="fix that rank's error, then re-run the same command to resume",
                ) from None
    if stop.signum is not None:
        raise _stopped(stop.signum, records, info)


def _previews(w: Work) -> None:
    """Decode the first `previews` prompts' final latents (whichever rank wrote them)."""
    from wandistill.cache.reader import CacheReader
    from wandistill.placement import load as pl
    from wandistill.teacher.decode import decode_to_png

    out = Path(w.cfg.cache.path) / "previews"
    wanted = [k for k in w.keys[: w.cfg.previews] if not (out / f"{k}.png").exists()]
    with CacheReader(w.cfg.cache.path) as store:
        located = store.locate()
        mine = [k for k in wanted if k in located and located[k][0].rank == w.info.rank]
        if not mine:
            return
        vae = pl.load_component(w.teacher, "vae", **w.load_kw)
        try:
            for k in mine:
                rec = store.read_record(*located[k])
                decode_to_png(vae, rec.final_latent, out / f"{k}.png")
        finally:
            pl.unload(vae)
