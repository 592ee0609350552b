"""Cost of reading one training sample's header (webdataset backend), warm page cache.

    PYTHONPATH=<tree> python tests/bench/header_check.py

Run it against two trees (before/after a change) in the same session: prints the minimum over 7
repeats of 1000 `header()` calls and of 1000 `read_sample()` calls (x_t, teacher output,
embedding, timestep of one recorded step) on a small synthetic cache.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests")

from wandistill.cache import open_cache  # noqa: E402

from cachefixtures import write_cache  # noqa: E402


def main() -> None:
    root = Path(tempfile.mkdtemp())
    write_cache(root, range(8), shard_records=4)
    with open_cache(root) as store:
        entry, source = store.entries[0], store.source
        headers, samples = [], []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(1000):
                source.header(entry, 1)
            headers.append((time.perf_counter() - t) / 1000 * 1e6)
            t = time.perf_counter()
            for _ in range(1000):
                store.read_sample(entry, 1, 1, ["xt", "teacher_out", "prompt_embeds", "timesteps"])
            samples.append((time.perf_counter() - t) / 1000 * 1e6)
    print(f"header: {min(headers):.1f} us, sample: {min(samples):.1f} us")


if __name__ == "__main__":
    main()
