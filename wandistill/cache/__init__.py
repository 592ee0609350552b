"""The cache room: records <-> webdataset tar shards or zarr v3 arrays, with a manifest.

Must not import diffusers: a cache is read by `train`, which never touches the teacher.
"""

from wandistill.cache.reader import CacheStore, open_cache
from wandistill.cache.schema import Record, record_key
from wandistill.cache.writer import CacheWriter, open_writer

__all__ = ["CacheStore", "CacheWriter", "Record", "open_cache", "open_writer", "record_key"]
