"""The cache room: records <-> webdataset tar shards or zarr v3 arrays, with a manifest.

Must not import diffusers: a cache is read by `train`, which never touches the teacher. The
re-exports below load on first use (`runtime.lazy`): a recipe check that needs one constant
of this room (`cache.choices`) does not load torch, webdataset and zarr with it.
"""

from typing import TYPE_CHECKING

from wandistill.runtime.lazy import exports

if TYPE_CHECKING:
    from wandistill.cache.contract import Record, record_key
    from wandistill.cache.reader import CacheReader, open_cache
    from wandistill.cache.writer import CacheWriter, open_writer

__all__ = ["CacheReader", "CacheWriter", "Record", "open_cache", "open_writer", "record_key"]
__getattr__, __dir__ = exports(
    __name__,
    {
        "CacheReader": "wandistill.cache.reader",
        "open_cache": "wandistill.cache.reader",
        "Record": "wandistill.cache.contract",
        "record_key": "wandistill.cache.contract",
        "CacheWriter": "wandistill.cache.writer",
        "open_writer": "wandistill.cache.writer",
    },
)
