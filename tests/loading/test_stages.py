"""The ids a resume position records (`ShuffleBuffer.sample_ids`, `SortBatcher.buffer_ids`
and `pending_ids`) are those of the samples the stages hold, at every batch."""

from __future__ import annotations

import random

import numpy as np

from cat.loading.stages import BucketBatcher, ShuffleBuffer, SortBatcher, bucket_bounds


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


# ----------------------------------------------------------------------------- buckets


def _frames(samples) -> list[int]:
    return [len(s["features"]) for s in samples]


def test_bucket_bounds_share_the_frames_equally():
    rng = np.random.default_rng(0)
    frames = rng.integers(50, 2000, 20000)
    bounds = bucket_bounds(frames, 10)
    assert len(bounds) == 9 and np.all(np.diff(bounds) > 0)
    shares = [frames[np.searchsorted(bounds, frames, "right") == b].sum() / frames.sum()
              for b in range(10)]
    assert max(shares) < 0.12 and min(shares) > 0.08, shares
    assert bucket_bounds(np.full(100, 7), 5).tolist() == [7]  # repeated lengths: fewer
    assert bucket_bounds(frames, 1).size == 0


def _bucketed(samples, bounds, rng_seed, stop_after=None):
    """Batches of the shuffle buffer and `BucketBatcher` over `samples`; with
    `stop_after`, stop after that many batches and go on from a restored position, as a
    resume does (the reader continuing after the samples it had given)."""
    given = [0]

    def upstream(start):
        for sample in samples[start:]:
            given[0] += 1
            yield sample

    rng = random.Random(rng_seed)
    shuffle, batcher = ShuffleBuffer(30, rng), BucketBatcher(bounds, 8, 600, rng)
    batches = []
    for batch in batcher(shuffle(upstream(0))):
        batches.append(_ids(batch))
        _check(shuffle, batcher)
        if len(batches) == stop_after:
            break
    else:
        return batches
    held = {s["id"]: s for s in samples}
    state = (shuffle.sample_ids(), shuffle.draining, batcher.buffer_ids(),
             [b.copy() for b in batcher.pending_ids], batcher.upstream_done, rng.getstate())
    rng = random.Random()
    shuffle, batcher = ShuffleBuffer(30, rng), BucketBatcher(bounds, 8, 600, rng)
    shuffle.restore([held[i] for i in state[0]], state[1])
    batcher.restore([held[i] for i in state[2]], [[held[i] for i in b] for b in state[3]],
                    state[4])
    rng.setstate(state[5])
    _check(shuffle, batcher)
    for batch in batcher(shuffle(upstream(given[0]))):
        batches.append(_ids(batch))
    return batches


def test_bucketed_batches_stay_in_a_bucket_and_budget_and_resume_exactly():
    samples = _samples(400, seed=5)
    lengths = {s["id"]: len(s["features"]) for s in samples}
    bounds = bucket_bounds(np.array(_frames(samples)), 6)
    batches = _bucketed(samples, bounds, 1)
    assert sorted(i for b in batches for i in b) == [s["id"] for s in samples]
    for batch in batches:
        frames = [lengths[i] for i in batch]
        assert len(batch) <= 8 and max(frames) * len(batch) <= 600
        assert len(set(np.searchsorted(bounds, frames, "right"))) == 1  # one bucket
    for stop in (1, 7, len(batches) - 2):
        assert _bucketed(samples, bounds, 1, stop_after=stop) == batches, stop


def test_bucketing_pads_less_than_the_sort_buffer_on_a_wide_length_mix():
    rng = np.random.default_rng(1)
    # WenetSpeech-like: most utterances 1-5 s, a long tail to 20 s.
    frames = np.clip(rng.lognormal(5.6, 0.6, 3000), 40, 2000).astype(int)
    samples = [{"id": i, "features": np.zeros((n, 1))} for i, n in enumerate(frames)]

    def padding(batcher) -> float:
        batches = list(batcher(ShuffleBuffer(500, random.Random(0))(iter(samples))))
        real = sum(len(s["features"]) for b in batches for s in b)
        return 1 - real / sum(len(b) * max(_frames(b)) for b in batches)

    sort = padding(SortBatcher(100, 32, 20000, random.Random(0)))
    bucketed = padding(BucketBatcher(bucket_bounds(frames, 30), 32, 20000, random.Random(0)))
    assert bucketed < sort / 2, (bucketed, sort)
