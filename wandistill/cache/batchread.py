"""How the training reader reads one batch: in place, several caches, corrupt samples, next points.

Why its own module: reading a planned batch is one concept beside planning it. `BatchReading`
is a mixin of `TrainingReader` (cache/training.py), whose settings it uses; each batch runs in
one pool thread. Where the backend can, every tensor is read straight into its row of the batch
(`CacheReader.read_batch` into cache/batch.py's buffers); otherwise each sample is read and
decoded on its own. A sample that cannot be read is refused, or with skip_corrupt skipped and
its row filled with the batch's first good sample.
"""

from __future__ import annotations

from typing import Any

import torch

from wandistill.cache.batch import BatchBuffers, RowsOf
from wandistill.cache.files import Entry
from wandistill.cache.reader import CacheReader
from wandistill.cache.samples import Sample
from wandistill.errors import CacheError, CorruptRecordError
from wandistill.io.storage import is_transient


class BatchReading:
    """`TrainingReader`'s batch reads (see the module docstring)."""

    def _read_batch(self, samples: list[Sample]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(batch tensors, the sample in each row); runs in a pool thread. A skipped corrupt
        sample's row holds the batch's first good sample; no rows when none was good.

        In place when the backend can (`CacheReader.read_batch`): every tensor is read straight
        into its row of the batch, with no per-sample tensor and no stacking copy. Otherwise
        (fields stored in another dtype, a next point) each sample is read and decoded on its own
        and copied into its row."""
        pad = None if self.pad == "batch" else self.store.max_sequence_length
        groups: dict[int, list[int]] = {}
        for b, (entry, _, _) in enumerate(samples):
            groups.setdefault(self._owner.get(id(entry), 0), []).append(b)
        if len(groups) == 1:
            out = BatchBuffers(len(samples), pad)  # one cache
            errors = self._read_into(self.stores[next(iter(groups))], samples, out)
        else:
            out, errors = self._read_mixed(groups, samples, pad)
        for (entry, row, _), e in zip(samples, errors, strict=True):
            if e is not None:
                self._failed(entry, row, e)
        good = [b for b, e in enumerate(errors) if e is None]
        if not good:
            return {}, []
        if "prompt_embeds" in out.lengths:
            out.tensors["prompt_len"] = torch.tensor(out.lengths["prompt_embeds"])
        if len(good) == len(samples):
            return out.tensors, good
        # Keep the batch shape: the first good sample takes the place of each skipped one.
        order = good + [good[0]] * (len(samples) - len(good))
        index = torch.tensor(order)
        tensors = {name: t[index] for name, t in out.tensors.items()}
        if self.pad == "batch":  # padded to the longest good sample only
            for name, lengths in out.lengths.items():
                longest = max(lengths[b] for b in good)
                tensors[name] = tensors[name][:, :longest].contiguous()
        return tensors, order

    def _read_mixed(
        self, groups: dict[int, list[int]], samples: list[Sample], pad: int | None
    ) -> tuple[BatchBuffers, list[BaseException | None]]:
        """A batch drawn from several caches: each cache's backend reads its samples straight
        into their rows of the one batch (`RowsOf`), no copy. Ragged fields are laid out at
        max_sequence_length (the rows are allocated before every cache has said how long its
        prompts are), then trimmed to the longest when the reader pads per batch."""
        out = BatchBuffers(len(samples), self.store.max_sequence_length)
        errors: list[BaseException | None] = [None] * len(samples)
        for n, rows in groups.items():
            view: Any = RowsOf(out, rows)
            errs = self._read_into(self.stores[n], [samples[b] for b in rows], view)
            for b, e in zip(rows, errs, strict=True):
                errors[b] = e
        if pad is None:
            for name, lengths in out.lengths.items():
                longest = max(lengths, default=0)
                if longest < out.tensors[name].shape[1]:
                    out.tensors[name] = out.tensors[name][:, :longest].contiguous()
        return out, errors

    def _read_into(
        self, store: CacheReader, samples: list[Sample], out: BatchBuffers
    ) -> list[BaseException | None]:
        """Samples of one cache into their rows of `out`: in place where the backend can, else
        each read and decoded on its own; each sample's error, or None."""
        errors = None if self.with_next else store.read_batch(samples, self.fields, out)
        return self._read_each(samples, out) if errors is None else errors

    def _read_each(self, samples: list[Sample], out: BatchBuffers) -> list[BaseException | None]:
        """Read and decode each sample on its own, then copy it into its row of `out`; each
        sample's error, or None."""
        results = [self._read_sample(*s) for s in samples]
        errors = [r if isinstance(r, BaseException) else None for r in results]
        shapes = [
            None
            if isinstance(r, BaseException)
            else {n: (tuple(t.shape), t.dtype) for n, t in r.items()}
            for r in results
        ]
        for b, problem in enumerate(out.allocate(shapes)):
            r = results[b]
            if problem is not None:
                errors[b] = ValueError(problem)
            elif not isinstance(r, BaseException):
                for name, t in r.items():
                    out.row(b, name).copy_(t)
        return errors

    def _read_sample(
        self, entry: Entry, row: int, slot: int
    ) -> dict[str, torch.Tensor] | BaseException:
        try:
            out = self._store_of(entry).read_sample(entry, row, slot, self.fields, pad=False)
            if self.with_next:
                out.update(self._read_next(entry, row, slot))
            return out
        except Exception as e:
            return e

    def _failed(self, entry: Entry, row: int, e: BaseException) -> None:
        """A sample that could not be read: refuse it, or with skip_corrupt record it. An error
        about the process, not the record (out of file descriptors or memory), is raised as it
        is: skipping would drop good records."""
        if is_transient(e):
            raise e
        detail = e.detail if isinstance(e, CorruptRecordError) else str(e)
        detail = detail.removeprefix(f"shard {entry.name} record {entry.keys[row]}: ")
        msg = f"corrupt record {entry.keys[row]} in shard {entry.name}: {detail}"
        if not self.skip_corrupt:
            raise CacheError(msg, fix="run `wandistill cache verify`, or pass --skip-corrupt")
        self.corrupt.append(msg)

    def _read_next(self, entry: Entry, row: int, slot: int) -> dict[str, torch.Tensor]:
        """The next point of this sample's trajectory: slot `next_slots[slot]`'s x_t and t, or
        past the last recorded step the final latent (in x_t's dtype) at t = 0."""
        store = self._store_of(entry)
        assert self.next_slots is not None
        ahead = self.next_slots[slot]
        if ahead < self.num_slots:
            nxt = store.read_sample(entry, row, ahead, ["xt", "timesteps"], pad=False)
            return {"xt_next": nxt["xt"], "timesteps_next": nxt["timesteps"]}
        both = store.read_sample(entry, row, slot, ["xt", "final_latent"], pad=False)
        xt = both["final_latent"].to(both["xt"].dtype)
        return {"xt_next": xt, "timesteps_next": torch.zeros((), dtype=torch.float32)}

    def _collate(
        self, tensors: dict[str, torch.Tensor], order: list[int], samples: list[Sample]
    ) -> dict[str, Any]:
        """The batch handed over: `tensors` hold the samples in `order` (empty: every sample of
        the batch was corrupt and skipped)."""
        if not order:
            if self._last_good is None:
                raise CacheError(
                    f"every sample of the first batch was corrupt ({len(samples)} samples; the "
                    f"last: {self.corrupt[-1] if self.corrupt else '?'})",
                    fix="run `wandistill cache verify` and restore the damaged shards",
                )
            # A wholly corrupt batch: repeat the last good one (ranks stay in step; every
            # skipped sample is in self.corrupt).
            return {
                k: v.clone() if isinstance(v, torch.Tensor) else list(v)
                for k, v in self._last_good.items()
            }
        batch: dict[str, Any] = dict(tensors)
        batch["key"] = [samples[b][0].keys[samples[b][1]] for b in order]
        batch["step_slot"] = torch.tensor([samples[b][2] for b in order])
        self._last_good = dict(batch)
        return batch
