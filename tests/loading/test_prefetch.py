"""Batches taken ahead of the step (`cat.loading.prefetch`): the order, the errors and the
end of the loader are the trainer's to see; a loader faster than the steps is never waited
for; the loader's rates are reported."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cat.loading.batch import Utterance, collate
from cat.loading.prefetch import LoaderRates, Prefetcher

STEP_SECONDS = 0.04
BATCH_SECONDS = 0.02  # the loader is twice as fast as the steps
BATCHES = 40


class SlowBatches(torch.utils.data.IterableDataset):
    """`count` batches of 2 utterances, each `seconds` to make (a sleep: no CPU taken), the
    one numbered `fail_at` raising instead."""

    def __init__(self, count: int, seconds: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__()
        self.count, self.seconds, self.fail_at = count, seconds, fail_at

    def __iter__(self):
        for number in range(self.count):
            time.sleep(self.seconds)
            if number == self.fail_at:
                raise ValueError(f"shard 7: batch {number} is broken")
            label = np.array([number + 1], np.int32)
            yield collate([Utterance(f"b{number}-u{i}", np.full((3 + i, 2), number, np.float32),
                                     label) for i in range(2)])


def _loader(dataset, workers: int) -> torch.utils.data.DataLoader:
    extra = {"prefetch_factor": 2, "persistent_workers": True} if workers else {}
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, **extra)


def _wait_share(batches, steps: int) -> float:
    """Share of the wall time after the first batch spent waiting for the next one, with a
    step of STEP_SECONDS (a sleep) after each."""
    iterator = iter(batches)
    next(iterator)
    waited, start = 0.0, time.perf_counter()
    for _ in range(steps - 1):
        time.sleep(STEP_SECONDS)
        begin = time.perf_counter()
        next(iterator)
        waited += time.perf_counter() - begin
    return waited / (time.perf_counter() - start)


def test_batches_come_in_the_loaders_order_on_the_device_each_once():
    prefetcher = Prefetcher(_loader(SlowBatches(9), 1), torch.device("cpu"), report=False)
    for _ in range(2):  # a second epoch over the same persistent worker
        keys = [batch.keys[0] for batch in prefetcher]
        assert keys == [f"b{n}-u0" for n in range(9)]
    prefetcher.close()


def test_a_loader_twice_as_fast_as_the_steps_is_not_waited_for():
    """Prefetched (a worker, and the thread): the steps wait under 5 % of the time.
    Without prefetching (the batch made when the step asks), about a third."""
    dataset = SlowBatches(BATCHES, BATCH_SECONDS)
    prefetched = Prefetcher(_loader(dataset, 1), torch.device("cpu"), report=False)
    share = _wait_share(prefetched, BATCHES)
    prefetched.close()
    assert share < 0.05, f"waited {share:.1%} of the time with prefetching"
    in_turn = Prefetcher(_loader(dataset, 0), torch.device("cpu"), depth=0, report=False)
    share = _wait_share(in_turn, BATCHES)
    assert share > 0.2, f"waited only {share:.1%} of the time without prefetching"


def test_the_loaders_error_is_raised_where_its_batch_is_taken():
    prefetcher = Prefetcher(_loader(SlowBatches(9, fail_at=5), 0), torch.device("cpu"),
                            report=False)
    taken = []
    with pytest.raises(ValueError, match="shard 7: batch 5 is broken"):
        for batch in prefetcher:
            taken.append(batch.keys[0])
    assert taken == [f"b{n}-u0" for n in range(5)]


def test_leaving_an_epoch_early_stops_the_thread_and_the_next_epoch_starts_over():
    prefetcher = Prefetcher(_loader(SlowBatches(20, 0.01), 1), torch.device("cpu"),
                            report=False)
    iterator = iter(prefetcher)
    assert [next(iterator).keys[0] for _ in range(3)] == ["b0-u0", "b1-u0", "b2-u0"]
    del iterator  # what the trainer does at a stop or a DDP epoch end
    assert not any(t.name == "cat-prefetch" for t in threading.enumerate())
    assert [batch.keys[0] for batch in prefetcher][:2] == ["b0-u0", "b1-u0"]
    prefetcher.close()
    assert not any(t.name == "cat-prefetch" for t in threading.enumerate())


def test_rates_say_when_the_loader_is_the_bound_and_how_many_workers_would_keep_up():
    now = [0.0]
    rates = LoaderRates(workers=4, interval=60.0, clock=lambda: now[0])
    for _ in range(100):
        rates.delivered(10)
        rates.consumed(10, waited=0.3)  # 30 s of 60 waiting: 1,000 utts in 30 s of steps
    now[0] = 30.0
    assert rates.report() is None  # not a minute yet
    now[0] = 60.0
    line = rates.report()
    assert "delivered 16.7 utt/s" in line and "waited 50.0%" in line
    assert "steps alone would take 33.3 utt/s, about 8 workers (now 4" in line
    for _ in range(10):
        rates.delivered(10)
        rates.consumed(10, waited=0.001)
    now[0] = 120.0
    assert rates.report().endswith("the loader keeps up")
