"""Atomic file writes: a file is either absent or complete, never half-written.

Every durable artefact (shards, manifests, journals, checkpoints) goes through these helpers:
write to a temp name in the same directory, fsync, rename, fsync the directory. What they publish
has the modes of a plain `open` / `mkdir` under the process umask (files 0644, folders 0755 under
the usual 022), so outputs are readable by whoever could read a file the user made by hand.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: str | Path) -> None:
    """Make a rename durable; silently skipped where directories cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder` (not through symlinks: an export's links to the
    teacher), then every directory, then `folder`: a tree about to be renamed into place."""
    for root, dirs, files in os.walk(folder):  # os.walk does not follow directory symlinks
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())
        for name in dirs:
            if not (Path(root) / name).is_symlink():
                fsync_dir(Path(root) / name)
    fsync_dir(folder)


def temp_name(path: Path) -> Path:
    """A sibling temp name that readers ignore (leading dot, `.tmp` suffix, pid-unique)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop a written and fsynced file's pages (`length` bytes from `offset`; 0: to the end)
    from the page cache (`POSIX_FADV_DONTNEED`).

    For bulk data this process writes once and never reads back (cache shards): kept, every
    byte written takes a fresh page-cache page and pushes out what the machine does read (the
    teacher's weights). On a VM that hands freed memory back to its host a fresh page costs a
    host fault: writing 256 MB with fsync took 0.72-1.05 s (0.58-0.88 CPU-s) with the pages
    kept and 0.25 s (0.13-0.15 CPU-s) with them dropped, as dropped pages are reused by the
    next write (2-core Firecracker VM, 2026-11-23). Only clean pages are dropped: call it after
    fsync (over dirty ones it starts their writeback, which `FlushBehindWriter` wants)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


FLUSH_BEHIND_BYTES = 32 << 20
"""A bulk file starts the writeback of what it wrote every this many bytes."""


class FlushBehindWriter(io.BufferedWriter):
    """A buffered file whose writeback starts every `FLUSH_BEHIND_BYTES`, not at its fsync.

    Why: kept dirty until the fsync, a whole shard (hundreds of MB) is written to the device
    only then, while the writer waits; started early, the device writes one window while the
    next is produced (PostgreSQL's `*_flush_after` settings do the same). On Linux
    `POSIX_FADV_DONTNEED` over dirty pages starts their writeback without waiting
    (`WB_SYNC_NONE`) and drops the pages already clean, so each call covers the window before
    too, which is written back by then. Durability is unchanged: `atomic_open` still fsyncs.
    Measured: 4 x 338 MB in 8 MB writes, each then fsynced, 1.19 -> 0.91 s (median of 5,
    2-core VM, 2026-11-24, docs/benchmarks.md "The VM's memory taken out of the cold legs")."""

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__(raw, buffer_size=1 << 20)
        self._written = 0
        self._window = 0
        """Start of the window whose writeback was started last."""
        self._hinted = 0
        """End of what has been hinted."""

    def write(self, data: Any) -> int:
        n = super().write(data)
        self._written += n
        if self._written - self._hinted >= FLUSH_BEHIND_BYTES:
            self.flush()
            drop_cached(self.fileno(), self._window, self._written - self._window)
            self._window, self._hinted = self._hinted, self._written
        return n


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", *, bulk: bool = False) -> Iterator[IO[Any]]:
    """Open a temp sibling for writing; on success fsync and rename it onto `path`. `bulk`
    (mode "wb"): write-once data, written back as it goes (`FlushBehindWriter`) and dropped from
    the page cache once durable (`drop_cached`)."""
    path = Path(path)
    tmp = temp_name(path)
    if bulk and mode != "wb":
        raise ValueError(f"a bulk file is written in mode 'wb', not {mode!r}")
    f: IO[Any] = (
        FlushBehindWriter(io.FileIO(tmp, "w")) if bulk else open(tmp, mode)  # noqa: SIM115
    )
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        if bulk:
            drop_cached(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):  # closing flushes the buffer: ENOSPC again
            f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            name_target(e, path)
        raise


WRITE_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""A write refused for want of room: disk full, quota, or the file size limit (EFBIG)."""


def name_target(e: OSError, path: str | Path) -> None:
    """Make `e` name the file being written: a failed write() names none, and a failed copy
    names its source (shutil sets the destination as `filename2`), which reads as if the input
    were at fault. Where room ran out, the target is what the message must name."""
    if e.filename is None or e.errno in WRITE_FULL:
        e.filename, e.filename2 = str(path), None


class _CopyFailed(Exception):
    """Carries a file copy's OSError out of `shutil.copytree`, which would otherwise collect
    it, go on copying, and raise one `shutil.Error` whose text is a list of tuples."""


def copy_tree(src: str | Path, dst: str | Path) -> None:
    """`shutil.copytree` with `copyfile` (modes from the umask, not the source's), stopping at
    the first failure with that file's own OSError (a full disk names the file being written,
    `name_target`); a directory-level failure is one OSError naming the directory."""

    def copy(s: str, d: str) -> None:
        try:
            shutil.copyfile(s, d)
        except OSError as e:
            name_target(e, d)
            raise _CopyFailed(e) from None

    try:
        shutil.copytree(src, dst, copy_function=copy)
    except _CopyFailed as failed:
        raise failed.args[0] from None
    except shutil.Error as e:
        source, target, why = e.args[0][0]
        raise OSError(errno.EIO, f"could not copy {source} to {target} ({why})") from None


@contextlib.contextmanager
def writing(path: str | Path, *, partial: str | Path | None = None) -> Iterator[None]:
    """Around a plain write of `path`: an OSError names `path` (`name_target`), and `partial`
    (a temp file being filled) is removed, so a full disk leaves no 0-byte file behind."""
    try:
        yield
    except OSError as e:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        name_target(e, path)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def publish(tmp: str | Path, final: str | Path) -> None:
    """Rename a fully written and fsynced temp file (or directory) into place. A directory's
    tree first gets umask modes: libraries filling it may write 0600 files (diffusers'
    `save_pretrained` does), and what we publish is the user's to share."""
    if Path(tmp).is_dir() and not Path(tmp).is_symlink():
        apply_umask(Path(tmp))
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A temp sibling folder to fill and `publish`; it gets the mode a plain mkdir would give
    (0755 under umask 022), not mkdtemp's 0700, since it becomes a user-facing output folder."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{prefix}.", suffix=".tmp", dir=parent))
    path.chmod(0o777 & ~umask())
    return path


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it (links untouched, not followed) the modes a plain
    `mkdir` / `open` would: 0755 / 0644 under umask 022; an owner-executable file stays so."""
    mask = umask()
    paths = [root]
    for folder, dirs, files in os.walk(root):  # does not follow links
        paths += [Path(folder, name) for name in (*dirs, *files)]
    for path in paths:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXUSR else 0o666
        if stat.S_IMODE(st.st_mode) != full & ~mask:
            path.chmod(full & ~mask)


@functools.cache
def umask() -> int:
    """The process umask. Read from /proc where it can be (setting it to read it, the only
    portable way, briefly changes it for every thread), once: wandistill never changes it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
