"""`wandistill cache info | merge | verify`: inspect, join and check caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from wandistill.cli.common import _out_dir, _positive, cache_app, err, option, out
from wandistill.errors import CacheError
from wandistill.io.location import option as loc
from wandistill.runtime.progress import human_bytes

CachePathArg = Annotated[
    str, typer.Argument(help="Cache directory or fsspec URL (s3://...).", **loc("PATH", url=True))
]


@cache_app.command("info")
def cache_info(
    path: CachePathArg,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json/--no-json",
            help="Print the whole manifest as JSON (for scripts) instead of the tables.",
        ),
    ] = False,
    records: Annotated[
        list[int] | None,
        typer.Option(
            "--records",
            help="Project the footprint to N records (repeatable; default: 10,000 and 100,000).",
        ),
    ] = None,
) -> None:
    """Records, bytes, fields, footprint (here and at Wan 480p/720p), settings and shards."""
    from wandistill.cache.files import WdsEntry
    from wandistill.cache.manifest import load_committed, manifest_json

    _positive(records=min(records) if records else None)
    m = load_committed(path)
    if as_json:
        out.print_json(json.dumps(manifest_json(m)))
        return
    head = Table(title=f"cache {path}", show_header=False)
    head.add_row("backend", m.backend)
    head.add_row("complete", str(m.complete))
    head.add_row("records", str(m.num_records))
    head.add_row("shards", str(len(m.shards)))
    head.add_row("bytes", human_bytes(m.num_bytes))
    head.add_row("teacher", m.teacher.fingerprint[:16])
    head.add_row("schema", f"v{m.schema_version} (wandistill {m.wandistill_version})")
    out.print(head)
    fields = Table("name", "dtype", "shape", title="fields")
    for f in m.fields:
        fields.add_row(f.name, f.dtype, f.shape)
    out.print(fields)
    _print_footprint(path, tuple(records or (10_000, 100_000)))
    settings = Table(title="sampler settings", show_header=False)
    below: dict[str, Any] = {}  # long JSON (the scheduler's config) goes under the table
    for k, v in m.block_json("settings").items():
        text = v if isinstance(v, str) else json.dumps(v)
        if isinstance(v, dict) and len(text) > 40:
            below[k] = v
            settings.add_row(k, "(below)")
        else:
            settings.add_row(k, text)
    out.print(settings)
    for k, v in below.items():
        out.print(f"{k}:", highlight=False)
        out.print_json(json.dumps(v))
    shards = Table("name", "records", "bytes", "sha256", title="shards")
    for s in m.shards:
        digest = s.frame_sha256 if isinstance(s, WdsEntry) else s.sha256  # type: ignore[attr-defined]
        sha = digest if isinstance(digest, str) else f"{len(digest)} files"
        shards.add_row(s.name, str(s.records), human_bytes(s.bytes), sha[:16])
    out.print(shards)


def _print_footprint(path: Path, records: tuple[int, ...] = (10_000, 100_000)) -> None:
    """Bytes per record per field, here and at real Wan sizes, for this cache's settings."""
    from wandistill.cache.footprint import WAN_SIZES, footprint

    try:
        fp = footprint(path)
    except CacheError as e:  # info still shows the rest; verify names the damage
        err.print(f"footprint: not computed ({e.message})", highlight=False, soft_wrap=True)
        return
    if fp is None:
        return
    table = Table(title=f"footprint per record (projection: {fp.embed_len:.0f}-token prompts)")
    for col in ("field", "stored as", "here", *WAN_SIZES):
        table.add_column(col, justify="left" if col in ("field", "stored as") else "right")
    for name, n in fp.here.items():
        sizes = [human_bytes(fp.projected[k].get(name, 0)) for k in WAN_SIZES]
        table.add_row(name, fp.fields.get(name, "(scale)"), human_bytes(n), *sizes)
    totals = {k: sum(v.values()) for k, v in fp.projected.items()}
    table.add_row(
        "total", "", human_bytes(sum(fp.here.values())), *map(human_bytes, totals.values())
    )
    for n in records:
        table.add_row(f"x {n:,} records", "", "", *(human_bytes(t * n) for t in totals.values()))
    out.print(table)
    ratio = fp.on_disk / max(1, sum(fp.here.values()))
    out.print(
        f"on disk here: {human_bytes(fp.on_disk)} per record ({ratio:.2f}x the stored tensors: "
        "compression and container overhead; projections are before compression)",
        highlight=False,
    )


@cache_app.command("merge")
def cache_merge(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Input caches (2 or more): directories or object-store URLs.",
            **loc("INPUT", url=True),
        ),
    ],
    out_dir: Annotated[
        str,
        option(
            "--out",
            help="The merged cache (new or empty): a directory or URL.",
            path="--out",
            url=True,
        ),
    ],
    skip_corrupt: Annotated[
        bool,
        typer.Option(
            "--skip-corrupt/--no-skip-corrupt",
            help="Leave out (and count) an input shard that fails verification instead of "
            "refusing the merge.",
        ),
    ] = False,
) -> None:
    """Join finished caches of one teacher and settings into one.

    Every input shard is verified first (checksums of every record); shards are then
    hard-linked where the disk allows, copied by the object store itself where inputs and
    output share one (S3 CopyObject), streamed otherwise; see docs/cache-format.md and
    docs/distributed.md."""
    from wandistill.cache.merge import MergeConfig, merge

    _out_dir(out_dir)
    s = merge(MergeConfig(inputs=tuple(inputs), out=out_dir, skip_corrupt=skip_corrupt))
    if s.corrupt:
        err.print(
            f"--skip-corrupt: left out {len(s.corrupt)} corrupt input shard(s), "
            f"{s.corrupt_records} record(s):",
            highlight=False,
        )
        for line in s.corrupt[:20]:
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    if s.unchanged:
        out.print(
            f"{out_dir} already is this merge ({s.records} records); nothing to do",
            highlight=False,
            soft_wrap=True,
        )
        return
    out.print(
        f"merged {s.records} records ({' + '.join(map(str, s.per_input))}) into {s.shards} "
        f"shards of {out_dir}: {s.linked} hard-linked, "
        + (f"{s.server_copied} copied by the object store, " if s.server_copied else "")
        + f"{s.copied} copied, {s.rewritten} re-written; {s.duplicates} duplicate record(s) "
        "dropped (first input kept)",
        highlight=False,
        soft_wrap=True,
    )


@cache_app.command("verify")
def cache_verify(
    path: CachePathArg,
) -> None:
    """Check every shard's checksum and decode every record; exit 1 if anything is wrong."""
    from wandistill.cache.reader import open_cache

    with open_cache(path, check_entries=False) as store:  # verify reports edited entries itself
        problems = store.verify()
        n, shards = len(store), len(store.entries)
    if problems:
        for p in problems:
            err.print(f"[red]BAD[/red] {escape(p)}", highlight=False, soft_wrap=True)
        err.print(f"{len(problems)} problem(s) in cache {path}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    out.print(f"OK: {n} records in {shards} shards of {path} verified", highlight=False)
