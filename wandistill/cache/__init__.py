"""The cache room: records <-> webdataset tar shards or zarr v3 arrays, with a manifest.

Must not import diffusers: a cache is read by `train`, which never touches the teacher.
"""

from wandistill.cache.contract import Record, record_key
from wandistill.cache.reader import CacheReader, open_cache
from wandistill.cache.writer import CacheWriter, open_writer

__all__ = ["CacheReader", "CacheWriter", "Record", "open_cache", "open_writer", "record_key"]
