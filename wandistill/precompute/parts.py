"""Independent parts: `precompute --part I/N` (or a Slurm array task) computes the I-th of N
disjoint, deterministic slices of the prompt list as a job of its own.

The slice is whole global batches: the prompt list is cut into batches of `sampler.batch_size`
prompts in file order (as for torchrun ranks, `run.py`), and batch b belongs to part b mod N;
torchrun ranks inside a part share its batches the same way (rank r of W takes every W-th).
A batch is therefore computed with the same prompts beside it whatever N and W are, so a part's
records are the very bytes one job over the whole list writes for the same keys, and the union
of the N parts is that job's cache, record for record.

Each part writes a complete cache of its own, `OUT/part-IIIII-of-NNNNN/`, under the one shared
`--out` folder: its own claim (lock), journal and sealed manifest, so parts never contend for a
file, a killed part is resumed by re-running only it, and a finished part is a cache that
`cache verify`, `cache merge` and `train` read like any other. `OUT/parts.json` records what
every part must share: N, the prompt file's sha256 and the cache header (teacher, sampler
settings, numerics, fields). The first part to start writes it (an exclusive create); every
later part, and every retry, is checked against it before anything is written, so a part of
another N, another prompt file or other settings is refused in one line. (Only the part that
wrote it may replace it, and only while no part has committed a record: a first run that failed
on a setting, re-run fixed.)

Why not one cache that all parts write into (each part a writer rank of its own): a cache's
`finalize` folds every journal into the manifest and deletes them, which is only safe once every
writer has stopped, so parts finishing at different times would need a new sealing protocol; the
cache's claim is one lock per folder and clears dead writers' temp files, which would delete a
live part's; and a cache without records takes the header of the next run that opens it, which
two parts starting at once with different settings would race on. One cache per part needs none
of that: no change to the writer, the journal, the manifest or the claim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from wandistill.cache import manifest as mf
from wandistill.checks.validate import parse_json
from wandistill.errors import CacheError, UsageError
from wandistill.io.storage import Storage, open_storage

PARTS_NAME = "parts.json"
PARTS_FORMAT = "wandistill-parts"
MAX_PARTS = 99_999
"""Part folders are named with 5 digits."""
_DIR = re.compile(r"part-(\d{5})-of-(\d{5})")
_FLAG = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
SLURM_ID, SLURM_COUNT = "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"
SLURM_MIN, SLURM_MAX = "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX"
ALL = "all"
"""`--part all`: the whole prompt list, even inside a Slurm array task."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Part:
    """Part `index` (0-based) of `count`; `source` says where it came from, for messages."""

    index: int
    count: int
    source: str = "--part"

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_PARTS:
            raise UsageError(
                f"{self.source}: {self.count} parts: must be 1 to {MAX_PARTS}",
                fix="pass --part I/N with N from 1 to 99999",
            )
        if not 0 <= self.index < self.count:
            raise UsageError(
                f"{self.source}: part index {self.index} is out of range for {self.count} parts "
                f"(parts are numbered 0 to {self.count - 1})",
                fix=f"pass --part I/{self.count} with I from 0 to {self.count - 1}",
            )

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def dirname(self) -> str:
        return f"part-{self.index:05d}-of-{self.count:05d}"

    def take(self, batches: Sequence[T]) -> list[T]:
        """This part's batches: b, b + N, b + 2N, ... (deterministic, disjoint, covering)."""
        return list(batches[self.index :: self.count])


def parse(text: str, source: str = "--part") -> Part:
    """`I/N` (0-based I) as a Part; anything else is one line naming the flag."""
    m = _FLAG.fullmatch(text)
    if m is None:
        raise UsageError(
            f"{source} {text!r} is not I/N", fix="pass --part I/N, e.g. --part 0/8 (0-based I)"
        )
    return Part(int(m.group(1)), int(m.group(2)), source)


def resolve(flag: str | None, env: Mapping[str, str]) -> Part | None:
    """The part this process computes: `--part` wins over a Slurm array's environment (an
    explicit flag over what the scheduler set, as torchrun's flags win over its variables);
    `--part all` is the whole list even in an array task; neither: the whole list."""
    if flag is not None:
        return None if flag.strip().lower() == ALL else parse(flag)
    if SLURM_ID not in env:
        return None
    return _from_slurm(env)


def _from_slurm(env: Mapping[str, str]) -> Part:
    """SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT, for an array of
    consecutive ids (`--array=0-7` or `--array=1-8`; a `%` throttle is fine)."""
    fix = "submit with consecutive ids (sbatch --array=0-{N-1}), or pass --part I/N"
    values: dict[str, int] = {}
    for name in (SLURM_ID, SLURM_COUNT, SLURM_MIN, SLURM_MAX):
        raw = env.get(name)
        if raw is None:
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise UsageError(f"{name}={raw!r} is not an integer", fix=fix) from None
    if SLURM_COUNT not in values:
        raise UsageError(
            f"{SLURM_ID} is set but {SLURM_COUNT} is not (Slurm older than 18.08?)",
            fix="pass --part I/N (0-based I), or --part all for the whole prompt list",
        )
    low, count = values.get(SLURM_MIN, 0), values[SLURM_COUNT]
    if SLURM_MAX in values and values[SLURM_MAX] - low + 1 != count:
        raise UsageError(
            f"Slurm array ids {low}..{values[SLURM_MAX]} are not {count} consecutive ids "
            f"({SLURM_COUNT}={count}): a stepped or listed --array leaves parts out",
            fix=fix,
        )
    source = f"{SLURM_ID}={values[SLURM_ID]} (minus {SLURM_MIN}={low}) of {SLURM_COUNT}={count}"
    return Part(values[SLURM_ID] - low, count, source)


# --------------------------------------------------------------------------- the parts folder


def check_and_record(
    root: str, part: Part, header: mf.Manifest, prompts_sha256: str, prompts: str
) -> None:
    """Refuse a part that does not belong with the parts already in `root` (another N, another
    prompt file, other settings), then record the set's identity if this is the first part.
    Called before anything of the part is written; every refusal is one line."""
    st = open_storage(root)
    label = f"--part {part.label} into --out {root!r}"
    others = sorted({int(m.group(2)) for n in st.list("") if (m := _DIR.fullmatch(n))})
    if others and others != [part.count]:
        raise UsageError(
            f"{label}: that folder holds parts of a {'/'.join(map(str, others))}-part run",
            fix=f"run every part with the same N (--part I/{others[0]}), or give a "
            f"{part.count}-part run another --out",
        )
    mine = identity(part, header, prompts_sha256, prompts)
    known = _read_identity(st)
    if known is None or (_differs(known, mine) and _may_take_over(st, part, known)):
        st.makedirs("")
        if known is None and st.create(PARTS_NAME, _dump(mine)):
            return
        if known is not None:  # its own first part, fixed, before any record: takes it over
            st.put(PARTS_NAME, _dump(mine))
            return
        known = _read_identity(st)  # another part created it first: check against it
    problem = _differs(known, mine) if known is not None else None
    if problem:
        raise UsageError(
            f"{label}: {problem} ({st.name(PARTS_NAME)})",
            fix="run every part with the same N, recipe, teacher and prompt file, or give this "
            "run another --out",
        )


def identity(part: Part, header: mf.Manifest, prompts_sha256: str, prompts: str) -> dict[str, Any]:
    """What every part of one run shares (the part index is each part's own)."""
    return {
        "format": PARTS_FORMAT,
        "parts": part.count,
        "first_part": part.index,  # the part that wrote it (`_may_take_over`)
        "prompts_sha256": prompts_sha256,
        "prompts": prompts,
        "header": {  # what `check_compatible` compares (the teacher's path may differ by node)
            "backend": header.backend,
            "teacher": header.teacher.fingerprint,
            "settings": header.block_json("settings"),
            "numerics": header.numerics,
            "fields": header.block_json("fields"),
        },
    }


def _differs(known: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """What differs from the parts already there, in a few words naming the values, or None."""
    if known.get("parts") != mine["parts"]:
        return f"the parts already there are of N = {known.get('parts')}, not {mine['parts']}"
    if known.get("prompts_sha256") != mine["prompts_sha256"]:
        return (
            f"prompt file {mine['prompts']!r} differs from the one the parts already there "
            f"read, {known.get('prompts')!r} (sha256)"
        )
    diffs = mf.mismatches(known.get("header") or {}, mine["header"])
    if diffs:
        shown = "; ".join(d.replace("cache has", "theirs").replace("this run has", "this")
                          for d in diffs[:3])  # fmt: skip
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        return f"other settings than the parts already there ({shown}{more})"
    return None


def _read_identity(st: Storage) -> dict[str, Any] | None:
    if not st.exists(PARTS_NAME):
        return None
    fix = f"restore {PARTS_NAME}, or run the parts into a new --out"
    data = st.read(PARTS_NAME, max_bytes=1 << 24, what=PARTS_NAME, fix=fix, error=CacheError)
    obj = parse_json(data, f"{st.name(PARTS_NAME)} is corrupt", fix=fix, error=CacheError)
    if not isinstance(obj, dict) or obj.get("format") != PARTS_FORMAT:
        raise CacheError(f"{st.name(PARTS_NAME)} is not a wandistill parts record", fix=fix)
    return obj


def _may_take_over(st: Storage, part: Part, known: dict[str, Any]) -> bool:
    """A run of the part that wrote parts.json may replace it while no part has committed a
    record (its first run failed on a setting and is re-run fixed). Any other part is checked
    against it: two parts starting at once with different settings cannot both go on."""
    return known.get("first_part") == part.index and not _any_records(st)


def _any_records(st: Storage) -> bool:
    """Some part under `st` has committed a record (the identity then binds every part)."""
    for name in st.list(""):
        if not _DIR.fullmatch(name):
            continue
        cache = open_storage(st.name(name))  # each part is a cache of its own
        if mf.has_manifest(cache) and mf.load_committed(cache).shards:
            return True
    return False


def _dump(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()
