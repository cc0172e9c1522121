"""The progress watchdog: who it names when a rank stalls, pauses, and its real threads.

Most cases drive two ranks' watchdogs by hand on one in-process store with a fake clock;
one case runs the real threads. The end-to-end case (a rank stopped with SIGSTOP under
torchrun) is in tests/faults/test_distributed.py.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from cat.training.watchdog import NoWatchdog, Watchdog, main_thread_location, start_watchdog

STALL = 10.0

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BrokenStore:
    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Connection reset by peer")


def _pair(store=None, world_size: int = 2):
    clock = Clock()
    store = store if store is not None else dist.HashStore()
    messages: list[str] = []
    dogs = [Watchdog(store, rank, world_size, STALL, interval=1.0, on_stall=messages.append,
                     clock=clock) for rank in range(world_size)]
    return clock, dogs, messages


def _run(clock: Clock, dogs: list[Watchdog], seconds: float, exchanging: list[Watchdog]) -> None:
    """Advance the clock second by second; the `exchanging` watchdogs beat each second."""
    for _ in range(int(seconds)):
        clock.now += 1.0
        for dog in exchanging:
            dog.exchange()


def test_a_rank_whose_heartbeat_stopped_is_named():
    clock, (rank0, rank1), messages = _pair()
    rank0.beat(6)
    rank1.beat(6)
    rank1.exchange()
    rank0.exchange()
    _run(clock, [rank0, rank1], STALL - 1, exchanging=[rank0])  # rank 1 is stopped
    assert not rank0.check() and not messages
    _run(clock, [rank0, rank1], 2, exchanging=[rank0])
    assert rank0.check()
    message = messages[0]
    assert "watchdog of rank 0 (no training update for 11 s after step 6" in message
    assert "rank 1 stopped responding (no heartbeat for 11 s" in message
    assert "stall_seconds=10" in message
    assert "rank 1: step 6, heartbeat 11.0 s ago" in message
    assert not rank0.check() and len(messages) == 1  # fires once


def test_a_rank_that_never_reported_is_named():
    clock, (rank0, _), messages = _pair()
    _run(clock, [], STALL + 1, exchanging=[rank0])
    assert rank0.check()
    assert "rank 1 stopped responding (no heartbeat ever" in messages[0]
    assert "rank 1: no heartbeat received" in messages[0]


def test_a_live_rank_behind_the_others_is_named():
    clock, dogs, messages = _pair(world_size=3)
    for dog, step in zip(dogs, (8, 7, 8), strict=True):
        dog.beat(step)
    _run(clock, dogs, STALL + 1, exchanging=dogs)
    assert dogs[0].check()
    assert "rank 1 fell behind at step 7 (others at step 8)" in messages[0]


def test_all_ranks_alive_at_the_same_step_says_where_each_rank_is():
    clock, (rank0, rank1), messages = _pair()
    _run(clock, [rank0, rank1], STALL + 1, exchanging=[rank0, rank1])
    assert rank0.check()
    message = messages[0]
    assert "every rank is alive at step 0" in message
    assert "rank 0: step 0, at " in message and "rank 1: step 0, heartbeat 0.0 s ago, at " \
        in message


def test_progress_and_pauses_hold_it_back():
    clock, (rank0, rank1), messages = _pair()
    both = [rank0, rank1]
    for step in range(1, 4):  # one update every 9 s: never a stall
        _run(clock, both, STALL - 1, exchanging=both)
        rank0.beat(step)
        assert not rank0.check()
    rank0.pause()  # a long checkpoint
    _run(clock, both, 5 * STALL, exchanging=both)
    assert not rank0.check()
    rank0.resume()  # the stall time counts from here
    _run(clock, both, STALL - 1, exchanging=both)
    assert not rank0.check() and not messages
    _run(clock, both, 2, exchanging=both)
    assert rank0.check() and "no training update for 11 s after step 3" in messages[0]


def test_a_stopped_rank_is_named_even_during_a_pause():
    clock, (rank0, rank1), messages = _pair()
    rank0.pause()
    _run(clock, [rank0, rank1], 3, exchanging=[rank0, rank1])
    _run(clock, [rank0, rank1], STALL, exchanging=[rank0])  # rank 1 stops
    assert not rank0.check()
    _run(clock, [rank0, rank1], 2, exchanging=[rank0])
    assert rank0.check()
    assert "watchdog of rank 0 (paused for 15 s after step 0" in messages[0]
    assert "rank 1 stopped responding (no heartbeat for 11 s" in messages[0]


def test_a_rank_that_finished_is_not_taken_for_a_stopped_one():
    clock, (rank0, rank1), messages = _pair()
    rank1.stop()  # training ended on rank 1 first
    rank1.exchange()
    for step in range(1, 4):
        _run(clock, [rank0, rank1], STALL - 1, exchanging=[rank0])
        rank0.beat(step)
        assert not rank0.check()
    assert not messages
    rank0.stop()
    _run(clock, [rank0, rank1], 3 * STALL, exchanging=[])
    assert not rank0.check() and not messages


def test_a_store_that_stopped_answering_is_reported():
    clock, (rank0, _), messages = _pair(store=BrokenStore())
    _run(clock, [], STALL + 1, exchanging=[rank0])
    assert rank0.check()
    assert "the heartbeat store has not answered for 11 s (RuntimeError: Connection reset " \
        "by peer)" in messages[0]


def test_threads_end_a_stalled_rank_in_bounded_time():
    store = dist.HashStore()
    fired = threading.Event()
    messages: list[str] = []

    def on_stall(message: str) -> None:
        messages.append(message)
        fired.set()

    watchdog = Watchdog(store, 0, 2, stall_seconds=0.5, interval=0.05, on_stall=on_stall)
    watchdog.start()
    try:
        assert fired.wait(timeout=30), "the watchdog did not fire"
    finally:
        watchdog.stop()
    assert "rank 1 stopped responding" in messages[0]
    # The record this rank published says where its main thread was.
    assert b'"where": "at ' in store.get("cat/watchdog/0/0")


def test_single_process_and_disabled_runs_have_no_watchdog():
    assert isinstance(start_watchdog(0, 1, 60), NoWatchdog)
    assert isinstance(start_watchdog(0, 2, 0), NoWatchdog)
    with pytest.raises(ValueError, match="stall_seconds must be positive"):
        Watchdog(dist.HashStore(), 0, 2, 0)


def test_location_names_the_innermost_frame_of_the_package():
    location = main_thread_location()
    assert location.startswith("at ") and "test_location_names" in location
