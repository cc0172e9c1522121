"""One rank's accounting of a streaming epoch: counts, worker positions, the epoch's cut.

`StreamProgress` runs in the training process. Every batch taken from the loader brings
its utterances (trained, or not when the epoch ends before its update) and the events of
its worker (drops, corrupt shards, finished shards, the worker's `WorkerPosition`). From
these it keeps:

* totals: trained, dropped per reason, lost in corrupt shards (`corrupt_missing`) and in
  shards their storage did not deliver (`unavailable_missing`); kept utterances per note
  (`noted`: audio resampled or down-mixed, transcripts with `<unk>` tokens);
* the position of each worker after its last batch, which is exactly what a checkpoint
  needs to resume the epoch (`state` / `restore`);
* `repeated_keys`: trainings of a key from shards without an index entry beyond its
  first (the loader drops such duplicates within a rank and epoch, `cat.loading.reader.
  SeenKeys`; this counts what it cannot see: a key taken before a resume, or, over the
  ranks' `trained_key_hashes`, by two ranks: `repeated_keys`);
* `resume_reread_shards`: the gzip-compressed shards a resume read again from their
  start (a compressed stream cannot seek to the utterance a position names, nor to the
  buffered samples: `cat.loading.gunzip`), summed over the resumes of the epoch;
* at the end of the epoch, the utterances nobody trained (`not_trained` = expected -
  trained - dropped - lost): what the first rank out of data cut. `cut_ids` lists them
  (the ids still buffered in each worker, the rest of the shard being read, the unread
  shards, the batches taken but not trained), and `length_profile` describes their
  lengths for the coverage report (`exp/<name>/log/coverage.jsonl`).

Nothing is clamped: a negative `not_trained` means the shards hold utterances their
index does not list, and is reported as such.

Usage:
    progress = StreamProgress(shards, [stream.worker_shards(epoch, w, 2) for w in (0, 1)])
    for batch in loader:
        progress.update(batch, trained=True)
    summary = progress.summary()
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cat.core.io import redact_urls
from cat.loading.batch import Batch
from cat.loading.gunzip import is_gzip_shard
from cat.loading.samples import ORDINAL_BITS, WorkerPosition, key_hash, split_ids
from cat.loading.shardlist import ShardList

#: Bin edges of the cut utterances' lengths in the coverage report, in 10 ms frames.
LENGTH_BINS = (0, 200, 400, 600, 800, 1000, 1500, 2000)


class StreamProgress:
    """One rank's accounting of a streaming epoch (see the module docstring).

    `worker_shards[w]` lists the shards worker `w` reads this epoch, in order (one list
    when the loader has no workers).
    """

    def __init__(self, shards: ShardList, worker_shards: Sequence[Sequence[int]]) -> None:
        self.shards = shards
        self.worker_shards = [list(map(int, w)) for w in worker_shards]
        self.rank_shards = [s for w in self.worker_shards for s in w]
        self.positions: dict[int, WorkerPosition] = {}
        self.trained = 0
        self.dropped: collections.Counter = collections.Counter()
        self.corrupt: list[tuple[int, str]] = []
        self.unavailable: list[tuple[int, str]] = []
        self.corrupt_missing = 0
        self.unavailable_missing = 0
        self.retrained = 0
        self.resume_reread_shards = 0
        self.untrained: list[np.ndarray] = []
        self.drop_lines: list[str] = []
        self.noted: collections.Counter = collections.Counter()
        # Hashes of the keys trained from shards without an index entry, in batches.
        self._trained_keys: list[np.ndarray] = []
        self._any_unindexed = bool(shards.estimated.any())

    def update(self, batch: Batch, trained: bool) -> None:
        """Account for a batch: its utterances (trained or not), its events always.

        Drop lines (`<utt> <reason> [detail]`) collect in `drop_lines` for the caller.
        """
        if len(batch):
            if trained:
                self.trained += len(batch)
                self._record_keys(batch)
            else:
                self.untrained.append(np.asarray(batch.ids, np.int64))
        events = batch.events
        if events is None:
            return
        for key, reason, _ in events.dropped:
            self.dropped[reason.split(" ", 1)[0]] += 1
            self.drop_lines.append(redact_urls(f"{key} {reason}"))
        self.corrupt += events.corrupt
        self.unavailable += events.unavailable
        self.noted.update(events.noted)
        unavailable = {shard for shard, _ in events.unavailable}
        for shard, count in events.finished:
            if not self.shards.estimated[shard]:
                missing = max(0, int(self.shards.num_utts[shard]) - count)
                if shard in unavailable:
                    self.unavailable_missing += missing
                else:
                    self.corrupt_missing += missing
        if events.position is not None:
            self.positions[events.position.worker] = events.position

    def _record_keys(self, batch: Batch) -> None:
        if not self._any_unindexed:
            return
        unindexed = self.shards.estimated[split_ids(batch.ids)[0]]
        if unindexed.any():
            self._trained_keys.append(np.fromiter(
                (key_hash(key) for key, own in zip(batch.keys, unindexed, strict=True) if own),
                np.int64))

    def trained_key_hashes(self) -> np.ndarray:
        """Hashes (`key_hash`) of the keys trained from shards without an index entry."""
        return np.concatenate(self._trained_keys) if self._trained_keys \
            else np.zeros(0, np.int64)

    def state(self) -> dict[str, Any]:
        """Checkpoint state: worker positions and the totals so far."""
        return {"positions": [p.to_state() for _, p in sorted(self.positions.items())],
                "trained": self.trained, "dropped": dict(self.dropped),
                "corrupt": [[s, m] for s, m in self.corrupt],
                "unavailable": [[s, m] for s, m in self.unavailable],
                "corrupt_missing": self.corrupt_missing,
                "unavailable_missing": self.unavailable_missing, "retrained": self.retrained,
                "resume_reread_shards": self.resume_reread_shards,
                "noted": dict(self.noted),
                "trained_keys": torch.from_numpy(self.trained_key_hashes())}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after `state()`: the workers resume at these positions."""
        positions = [WorkerPosition.from_state(p) for p in state["positions"]]
        self.positions = {p.worker: p for p in positions}
        self.trained = int(state["trained"])
        self.dropped = collections.Counter(state["dropped"])
        self.corrupt = [(int(s), str(m)) for s, m in state["corrupt"]]
        self.unavailable = [(int(s), str(m)) for s, m in state.get("unavailable", [])]
        self.corrupt_missing = int(state["corrupt_missing"])
        self.unavailable_missing = int(state.get("unavailable_missing", 0))
        self.retrained = int(state.get("retrained", 0))
        self.noted = collections.Counter(state.get("noted", {}))
        keys = state.get("trained_keys")
        self._trained_keys = [] if keys is None else [np.asarray(keys.numpy(), np.int64)]
        self.resume_reread_shards = (int(state.get("resume_reread_shards", 0))
                                     + self._rereads(positions))

    def _rereads(self, positions: Sequence[WorkerPosition]) -> int:
        """Compressed shards that resuming at `positions` reads from their start."""
        shards = set()
        for position in positions:
            own = self.worker_shards[position.worker] \
                if position.worker < len(self.worker_shards) else []
            if position.ordinal and position.shard < len(own):
                shards.add(own[position.shard])
            shards.update(int(s) for s in np.unique(split_ids(position.buffered())[0]))
        return sum(is_gzip_shard(self.shards.urls[s]) for s in shards)

    def expected(self) -> int | None:
        """Utterances in this rank's shards (None when some counts are estimates)."""
        if self.shards.estimated[self.rank_shards].any():
            return None
        return int(self.shards.num_utts[self.rank_shards].sum())

    def summary(self) -> dict[str, Any]:
        """Counts of the epoch so far (per rank)."""
        expected = self.expected()
        not_trained = None
        if expected is not None:
            not_trained = (expected - self.trained - sum(self.dropped.values())
                           - self.corrupt_missing - self.unavailable_missing)
        return {"expected": expected, "trained": self.trained, "dropped": dict(self.dropped),
                "corrupt_missing": self.corrupt_missing,
                "unavailable_missing": self.unavailable_missing,
                "corrupt_shards": [redact_urls(self.shards.urls[s]) for s, _ in self.corrupt],
                "unavailable_shards": [redact_urls(self.shards.urls[s])
                                       for s, _ in self.unavailable],
                "shards": len(self.rank_shards), "not_trained": not_trained,
                "retrained": self.retrained,
                "resume_reread_shards": self.resume_reread_shards, "noted": dict(self.noted),
                "repeated_keys": repeated_keys([self.trained_key_hashes()])}

    def cut_ids(self) -> np.ndarray | None:
        """Ids of the utterances neither trained, dropped nor lost (once the epoch ended:
        what its end cut); None when some shard counts are estimates."""
        if self.expected() is None:
            return None
        parts = list(self.untrained)
        for worker, shards in enumerate(self.worker_shards):
            place, first = 0, 0
            position = self.positions.get(worker)
            if position is not None:
                parts.append(position.buffered())
                place, first = position.shard, position.ordinal
            for offset, shard in enumerate(shards[place:]):
                start = first if offset == 0 else 0
                ordinals = np.arange(start, int(self.shards.num_utts[shard]), dtype=np.int64)
                parts.append((np.int64(shard) << ORDINAL_BITS) | ordinals)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def repeated_keys(hashes: Sequence[np.ndarray]) -> int:
    """Trainings of keys beyond their first over the `trained_key_hashes` of one or more
    ranks (the training loop gathers the ranks' arrays to count keys two ranks trained)."""
    every = np.concatenate([np.asarray(h, np.int64) for h in hashes]) if hashes \
        else np.zeros(0, np.int64)
    return len(every) - len(np.unique(every))


def length_profile(shards: ShardList, ids: np.ndarray) -> dict[str, Any]:
    """Count, mean length and a histogram (`LENGTH_BINS`) of the utterances `ids`."""
    shard_of, ordinals = split_ids(ids)
    frames = shards.utterance_frames(np.unique(shard_of).tolist())
    lengths = np.asarray([frames[int(s)][int(o)] for s, o in zip(shard_of, ordinals,
                                                                  strict=True)
                          if int(s) in frames and int(o) < len(frames[int(s)])], np.int64)
    edges = [*LENGTH_BINS, np.iinfo(np.int64).max]
    counts = np.histogram(lengths, bins=edges)[0] if len(lengths) else np.zeros(len(LENGTH_BINS))
    names = [f"{lo / 100:g}-{hi / 100:g}s" for lo, hi in itertools.pairwise(LENGTH_BINS)]
    names.append(f">={LENGTH_BINS[-1] / 100:g}s")
    return {"count": len(lengths),
            "mean_frames": float(lengths.mean()) if len(lengths) else None,
            "histogram": dict(zip(names, (int(c) for c in counts), strict=True))}
