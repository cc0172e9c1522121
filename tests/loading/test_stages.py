"""The ids a resume position records (`ShuffleBuffer.sample_ids`, `SortBatcher.buffer_ids`
and `pending_ids`) are those of the samples the stages hold, at every batch."""

from __future__ import annotations

import random

import numpy as np

from cat.loading.stages import ShuffleBuffer, SortBatcher


def _samples(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": 1000 + i, "features": np.zeros((int(rng.integers(1, 50)), 2))}
            for i in range(count)]


def _ids(samples) -> list[int]:
    return [s["id"] for s in samples]


def _check(shuffle: ShuffleBuffer, batcher: SortBatcher) -> None:
    assert shuffle.sample_ids().tolist() == _ids(shuffle.samples)
    assert batcher.buffer_ids().tolist() == _ids(batcher.buffer)
    assert [b.tolist() for b in batcher.pending_ids] == [_ids(b) for b in batcher.pending]


def test_position_ids_follow_the_buffers_through_an_epoch_and_a_restore():
    rng = random.Random(3)
    shuffle, batcher = ShuffleBuffer(40, rng), SortBatcher(25, 4, 0, rng)
    stream = batcher(shuffle(iter(_samples(300))))
    taken = []
    for batch in stream:
        taken += _ids(batch)
        _check(shuffle, batcher)
        if len(taken) == 120:
            break
    # A resume rebuilds both stages from the samples a position names.
    held = {s["id"]: s for s in [*shuffle.samples, *batcher.buffer,
                                 *(s for b in batcher.pending for s in b)]}
    restored_shuffle = ShuffleBuffer(40, random.Random(3))
    restored_shuffle.restore([held[i] for i in shuffle.sample_ids()], shuffle.draining)
    restored_batcher = SortBatcher(25, 4, 0, random.Random(3))
    restored_batcher.restore([held[i] for i in batcher.buffer_ids()],
                             [[held[i] for i in b] for b in batcher.pending_ids],
                             batcher.upstream_done)
    _check(restored_shuffle, restored_batcher)
    for batch in stream:
        taken += _ids(batch)
        _check(shuffle, batcher)
    assert sorted(taken) == list(range(1000, 1300))
    assert not shuffle.sample_ids().size and not batcher.buffer_ids().size
