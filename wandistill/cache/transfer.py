"""How `cache merge` puts one file of an input cache into the merged cache M, by the cheapest
way the two stores allow:

- both on one local filesystem: a hard link (same inode, no byte copied); across filesystems a
  copy through this process (temp name, fsync, rename);
- both on one object store (the same fsspec filesystem: one endpoint, one set of credentials,
  any buckets): the store copies the object itself (`fs.cp_file`; on S3 one CopyObject, or
  UploadPartCopy parts above 5 GiB), so no shard byte passes through this machine;
- anything else (local -> S3, S3 -> local, S3 -> GCS): the object is streamed through this
  process in 8 MiB pieces, never held whole, and written atomically on the destination
  (`Storage.upload`: a multipart upload appears only when completed).

Why copies and not a manifest that points at the inputs' shards in place: a merged cache must be
a self-contained prefix that stock webdataset / zarr (and `cache verify`, `train`) read like any
other, and must not break when an input is deleted or overwritten; a reference into another
prefix would do both. A server-side copy costs no client bandwidth, so in-place references
would save only storage.

Every input file was verified before the merge (`merge.corrupt_shards`); the stamp taken then
(`Storage.stamp`: ETag and size on S3, inode/size/mtime locally) must still be the file's after
it was copied, so a file replaced between its check and its copy is refused, not published.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from wandistill.errors import CacheError
from wandistill.io.fsutil import temp_name, writing
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage

CHUNK = 8 << 20
"""Bytes per read/write of a streamed copy (s3fs uploads parts of 5 MiB and more)."""

LINKED, SERVER, COPIED = "linked", "server", "copied"
"""How a file got into M: hard-linked, copied by the object store, copied through this process."""


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` to `dst` atomically (via a temp name); copy across filesystems. True if
    linked."""
    tmp = temp_name(dst)
    try:
        os.link(src, tmp)
        linked = True
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        with writing(dst, partial=tmp):  # a full disk names M's file, not the input shard
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        linked = False
    os.replace(tmp, dst)
    return linked


class Transfer:
    """Puts input files into the store `out` (module docstring)."""

    def __init__(self, out: Storage) -> None:
        self.out = out
        self.client_bytes = 0
        """Bytes that passed through this process."""

    def put(self, src: Storage, rel: str, dst: str, *, stamp: Any = None) -> tuple[str, int]:
        """Copy (or link) `src`'s `rel` to `dst` in `out`: (how, size in bytes). `stamp`: the
        file's stamp when it was verified; a file changed since is refused."""
        if isinstance(src, LocalStorage) and isinstance(self.out, LocalStorage):
            target = self.out.path(dst)
            target.parent.mkdir(parents=True, exist_ok=True)
            how = LINKED if link_or_copy(src.path(rel), target) else COPIED
        elif (  # one object store (fsspec hands out one filesystem per protocol and options)
            isinstance(src, FsspecStorage)
            and isinstance(self.out, FsspecStorage)
            and src.fs is self.out.fs
        ):
            self.out._call(dst, self.out.fs.cp_file, src.key(rel), self.out.key(dst))
            how = SERVER
        else:
            how = COPIED
            self.out.makedirs(dst.rpartition("/")[0])
            with src.open_read(rel) as f, self.out.upload(dst, bulk=True) as g:
                while piece := f.read(CHUNK):
                    g.write(piece)
        size = self.out.size(dst)
        if stamp is not None and src.stamp(rel) != stamp:
            self.out.rm(dst)
            raise CacheError(
                f"input file {src.name(rel)} changed after it was verified; nothing merged",
                fix="let whatever writes that cache finish, then re-run the merge",
            )
        if size is None:
            raise CacheError(f"{self.out.name(dst)} is missing right after it was written")
        self.client_bytes += size if how == COPIED else 0
        return how, size
