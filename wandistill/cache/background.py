"""Cache writes off the critical path: a writer thread behind a bounded queue.

Checksumming and writing a record (crc32c, the tar member streamed from the tensors' memory,
the shard's frame sha256, fsync at every shard) is mostly I/O and C code that releases the GIL,
so a thread overlaps it with the next batch's denoising. The queue is bounded (`depth` records):
a slow disk slows the producer down instead of holding every record in memory.

Failures keep their meaning: an error in the thread (disk full, a non-finite record refused) is
re-raised, the same exception object, in the caller's thread at its next `write()` or at
`drain()`; records queued after it are dropped, never written. `close()` writes what is queued
then commits the open shard (a stop commits only complete records, exactly as the synchronous
writer did); `abort()` writes what is queued, then drops the open shard.
"""

from __future__ import annotations

import queue
import threading

from wandistill.cache.contract import Record
from wandistill.cache.writer import CacheWriter

_DONE = object()


class BackgroundWriter:
    """`CacheWriter.write` in a thread; the same counters, read after `drain()`."""

    def __init__(self, writer: CacheWriter, *, depth: int = 8) -> None:
        self.writer = writer
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._failure: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None  # started by the first record

    # ------------------------------------------------------------------ the writer thread

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _DONE:
                    return
                if self._failure is None:
                    self.writer.write(item)  # type: ignore[arg-type]
            except BaseException as e:  # handed to the caller's thread
                self._failure = e
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------ the caller's side

    @property
    def records_written(self) -> int:
        return self.writer.records_written

    @property
    def records_skipped(self) -> int:
        return self.writer.records_skipped

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written

    def write(self, record: Record) -> None:
        """Queue one record (blocks while the queue is full); raises an earlier write's error."""
        self._raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cache-writer", daemon=True)
            self._thread.start()
        self._queue.put(record)

    def drain(self) -> None:
        """Wait until every queued record is written; raises the thread's error, if any."""
        self._queue.join()
        self._raise_failure()

    def close(self) -> None:
        """Write what is queued, stop the thread, commit the open shard. An error not yet
        raised is raised now (after dropping the open shard, as a failed write always did)."""
        self._stop()
        if self._failure is not None and not self._reported:
            self.writer.abort()
            self._raise_failure()
        self.writer.close()

    def abort(self) -> None:
        """Drop the open shard (redone on resume). Records already handed over are written
        first, so the shards committed are those the synchronous writer would have committed."""
        self._stop()
        self.writer.abort()

    def _stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            self._reported = True
            raise self._failure
