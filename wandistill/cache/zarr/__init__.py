"""zarr v3 backend, read and written through zarr-python's public API.

On-disk layout: one group `<cache>/data.zarr` of per-field arrays indexed by record row. Every
array uses zarr's ShardingCodec; inner chunks carry a crc32c checksum (zarr's Crc32cCodec) and
are not compressed (float latents do not compress: zstd gains ~1.09x)::

    data.zarr/                       group; attrs["wandistill"] = {block_records, token_block, ...}
      noise          (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      final_latent   (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      timesteps      (N,S)           chunk (1,S)          zarr shard (block,S)
      xt             (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      teacher_out    (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      feature.<name> (N,S,...)       chunk (1,1,...)      zarr shard (block,S,...)
      prompt_embeds/values   (T,D)   ragged, NOT padded: every record's tokens back to back
      prompt_embeds/offsets  (N,2)   int64 [start, length] into values; [-1, -1] = no embedding
      negative_prompt_embeds/{values,offsets}   same, once some record carries one

A step field is chunked one (record, step) per inner chunk, so a training sample that wants one
recorded step reads that chunk (plus the zarr shard's index). Dtypes come from the one table in
`schema.DTYPES`: bf16 (fp8) has no zarr dtype and is stored as its uint16 (uint8) bits with array
attribute {"wandistill_dtype": "bfloat16"} ("float8_e4m3fn"). With `cache.compression = "zstd"`
each inner chunk is zstd-compressed (zarr's ZstdCodec) before its crc32c. Dtypes and trailing
shapes are fixed by the first record that creates an array. Per-record metadata (key, prompt,
seed, extra) lives in the shard's manifest entry (`schema.ZarrEntry.meta`), which is the
commit record anyway.

Row ownership and concurrency. zarr 3.1 rewrites a whole zarr shard on every write that touches
it (read-modify-write, no locking), so two partial writes into one zarr shard lose rows, and
`resize` is a metadata rewrite that concurrent processes race on. Hence:

* the sink buffers one writer shard (`begin..end`) in memory, each record copied once into its
  row of a preallocated block per field (reused from shard to shard);
* `end()` takes an exclusive `fcntl.flock` on `<cache>/data.zarr.lock` (on an object store, a
  lease lock object of that name: `claim_lock`), creates missing arrays,
  claims the next free row range (rounded up to whole zarr shards of `block` rows) and token
  range per ragged field (whole zarr shards of `token_block` tokens), grows EVERY record-indexed
  array to the claimed stop (so each `offsets` array has a row for every record; rows no writer
  filled read as the fill value, [-1, -1] for offsets), then releases the lock;
* outside the lock it writes each array with one `setitem(a:b, block)`, arrays together in
  `asyncio.gather`s of at most WRITE_GATHER_BYTES on zarr's event loop (zarr
  `codec_pipeline.batch_size` WRITE_BATCH_CHUNKS): the ranges are disjoint and zarr-shard
  aligned, so no other writer touches those files;
* every byte goes through `_SealingStore`, a `zarr.storage.WrapperStore` that hashes what zarr
  hands to `set` (no file is read back). On a local disk each file is fsynced once: a shard file
  by the hashing worker right after its write (overlapping the other arrays' encoding), the
  metadata rewritten under the lock at the end of `end()`, then the directories. The shard
  files and their sha256 go in the entry; the CacheWriter then commits it in its journal.
  Rows claimed but never committed (a writer killed mid-shard, `abort()`, a failed `end()`)
  are never listed, and readers ignore them.

`block` is the sink's `block_records` (the CacheWriter passes its shard_records; default
BLOCK_RECORDS = 64); once the group exists, its recorded layout wins.

Reads (`ZarrSource`) go through `zarr.AsyncArray.getitem`, all fields of one sample in one
`asyncio.gather` handed to zarr's event loop (one thread hop per sample, not per field); the
training reader's `read_batch` gathers every field of a whole batch at once, each with
`AsyncArray.get_orthogonal_selection(..., out=<its row of the batch tensor>)`, so zarr decodes
each chunk straight into the batch. Reading one inner chunk costs one ranged read of the shard
index and one of the chunk; the index read is served by `zarr.experimental.cache_store.CacheStore`
(in memory, LRU, INDEX_CACHE_BYTES), so each shard file's index is read once. Small per-record
arrays (offsets, timesteps) are read once per shard entry. zarr checks every chunk's crc32c;
`_ReadStore` turns a missing shard file (zarr would read fill values) or a short read into
`ZarrChunkError`, and read errors name the shard entry, the record key, the field and the zarr
shard file(s).

Stock `zarr.open_group(<cache>/data.zarr, mode="r")` reads the same files: see
docs/cache-format.md. This module never pickles. A local cache directory must support flock
(NFSv4 does; Lustre needs -o flock). A cache at an fsspec URL is the same layout through zarr's
`FsspecStore` (`zarr_store`): objects are written whole (nothing to fsync), and the same claim
protocol runs under the lease lock.

Library notes (zarr >= 3.1.6): `zarr.experimental.cache_store` is experimental upstream
(https://zarr.readthedocs.io/en/stable/api/zarr/experimental/); `zarr.core.sync.sync` is the
runner zarr's own synchronous API uses (https://github.com/zarr-developers/zarr-python,
src/zarr/core/sync.py).
"""
