"""kill -9 inside precompute's encode phase: what was encoded is kept, and never encoded again.

The encode phase commits text embeddings to `embeds/` as it goes (wandistill/cache/embeds.py).
Kill points: right after the n-th prompt embedding of the run was handed to the embedding store
(`WANDISTILL_FAULT=precompute:encoded:<n>`, counted by the process itself, so exact), and
from outside while an embedding shard's temp file exists (inside a flush). After each kill the
same command runs again; it must encode exactly the prompts no committed embedding shard held
(the run prints "<k> prompts encoded"), then finish the cache byte-identical to an uninterrupted
run, and remove `embeds/` once the cache is complete. Runs are forked from the kill sweep's
zygote (tests/zygote.py): the real command line in a real process.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest
from test_kill_resume import (  # noqa: F401 - the pre fixture is used by name
    N_PROMPTS,
    SEED,
    PrecomputeSetup,
    Tally,
    check_partial,
    kill_when,
    pre,
    precompute_argv,
    resume_and_check,
)

from wandistill.cache.embeds import EMBED_DIR, EmbedStore

from zygote import Zygote, logs

ENCODE_POINTS = list(range(1, N_PROMPTS + 1))
random.Random(SEED + 10).shuffle(ENCODE_POINTS)
ENCODE_FAST = ENCODE_POINTS[:2]
ENCODE_SLOW_END = int(os.environ.get("WANDISTILL_SWEEP_ALL", "0") == "1") * 6 + 8
"""The slow test takes 6 more seeded points (CI time); WANDISTILL_SWEEP_ALL=1 takes all 14."""


def committed_prompt_embeddings(cache: Path) -> int:
    """Prompt embeddings (not negative prompts) held by committed embedding shards."""
    store = EmbedStore(cache)
    return sum(1 for name in store.index.names() if "negative" not in name)


def encoded_by(log: Path, nproc: int = 1) -> int:
    found = re.findall(r"(\d+)\s+prompts\s+encoded", logs(log, nproc))
    assert len(found) == 1, logs(log, nproc)  # rank 0's summary: every rank's prompts summed
    return int(found[0])


def resume_without_reencoding(
    z: Zygote, s: PrecomputeSetup, cache: Path, t: Tally, nproc: int = 1
) -> int:
    """Rerun after a kill; the rerun encodes exactly what was not committed. Returns that."""
    kept = committed_prompt_embeddings(cache)
    before = check_partial(s, cache, t)
    resume_and_check(z, s, cache, before, t, nproc=nproc)
    again = encoded_by(cache.with_suffix(".resume.log"), nproc)
    assert again == N_PROMPTS - len(before.keys) - kept, (again, kept, len(before.keys))
    assert not (cache / EMBED_DIR).exists(), "a complete cache keeps no embedding store"
    return kept


def sweep_encode(
    z: Zygote, s: PrecomputeSetup, root: Path, points: list[int], markers: list[int]
) -> Tally:
    t = Tally("precompute encode phase, 1 rank")
    for n in points:
        cache = root / f"encoded-{n}"
        log = root / f"encoded-{n}.log"
        codes = z.run(precompute_argv(s, cache), log, WANDISTILL_FAULT=f"precompute:encoded:{n}")
        assert codes == [-signal.SIGKILL], f"encoded {n}: {codes}\n{logs(log)}"
        assert not list((cache / "shards").glob("*.tar")), "killed while encoding: no records yet"
        kept = resume_without_reencoding(z, s, cache, t)
        t.killed.append(f"encoded {n} (kept {kept})")
    for k in markers:
        cache = root / f"embed-tmp-{k}"
        embeds = cache / EMBED_DIR
        pids = z.start(precompute_argv(s, cache), root / f"embed-tmp-{k}.log")
        ready = lambda e=embeds, k=k: e.is_dir() and any(e.glob(f".r00000-{k:06d}.*.tmp"))  # noqa: E731
        codes = kill_when(z, pids, ready)
        if codes == [0]:
            t.missed.append(f"embedding shard {k} being written")
            continue
        kept = resume_without_reencoding(z, s, cache, t)
        t.killed.append(f"inside embedding shard {k} (kept {kept})")
    return t


def test_precompute_kill_9_while_encoding_then_rerun_encodes_only_the_rest(
    zygote: Zygote,  # noqa: F811
    pre: PrecomputeSetup,  # noqa: F811
    tmp_path: Path,
) -> None:
    t = sweep_encode(zygote, pre, tmp_path, ENCODE_FAST, [1])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0 and len(t.killed) >= 2


@pytest.mark.slow
def test_precompute_kill_9_at_more_encoded_prompts_then_rerun(
    zygote: Zygote,  # noqa: F811
    pre: PrecomputeSetup,  # noqa: F811
    tmp_path: Path,
) -> None:
    t = sweep_encode(zygote, pre, tmp_path, ENCODE_POINTS[2:ENCODE_SLOW_END], [0, 2])
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0
    assert len(t.killed) >= ENCODE_SLOW_END - 2


@pytest.mark.slow
@pytest.mark.dist
def test_precompute_2_ranks_killed_while_encoding_then_one_process_reuses_every_embedding(
    zygote: Zygote,  # noqa: F811
    pre: PrecomputeSetup,  # noqa: F811
    tmp_path: Path,
) -> None:
    t = Tally("precompute encode phase, 2 ranks")
    for rank, n in ((1, 4), (0, 6)):
        cache = tmp_path / f"rank{rank}-encoded-{n}"
        log = tmp_path / f"rank{rank}-encoded-{n}.log"
        codes = zygote.run(
            precompute_argv(pre, cache),
            log,
            nproc=2,
            WANDISTILL_FAULT=f"precompute:encoded:{n}:{rank}",
        )
        assert codes[rank] == -signal.SIGKILL, f"{codes}\n{logs(log, 2)}"
        kept = resume_without_reencoding(zygote, pre, cache, t, nproc=1)
        t.killed.append(f"rank {rank} encoded {n} (kept {kept} of both ranks)")
    print(t.report())
    assert t.lost == t.duplicated == t.mismatched == 0 and len(t.killed) == 2
