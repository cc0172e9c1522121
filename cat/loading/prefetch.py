"""Batches taken from the loader ahead of the training step, in a thread of the training
process: on the training device, their features computed, when the step asks for them.

Without it, the training process does, between two steps and in the step's way: take the
batch from the DataLoader (unpickle the worker's message, map its ring slot), pin it,
copy it to the device, and compute the fbank of audio whose features the device
computes. `bench/overlap.py` measured these at about a millisecond a batch on the CPU
(the DataLoader's hand-over alone), which is the whole data wait of a loader that keeps
up with short steps. `Prefetcher` does this work for the next `depth` batches while the
step runs (the step's kernels and sleeping threads release the interpreter lock): the
copy from the worker's slot to the device on a side CUDA stream, the fbank there too,
and the step's stream waits for that work only when it takes the batch.

What the trainer takes is still in the loader's order; batches fetched but never taken
(an epoch cut short, a stop) were never noted, so a resume reads them again: exact resume
is unchanged (`cat.loading.stream`, `cat.training.train_data`).

`LoaderRates` says, once a minute, what the loader delivered and what the steps consumed,
and, when the steps waited for data, how many workers would keep up.

Usage:
    batches = Prefetcher(ring_loader, torch.device("cuda", 0), workers=4)
    for batch in batches: ...  # on the device, `feats` computed
    batches.close()
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cat.loading.batch import Batch

logger = logging.getLogger(__name__)

#: Batches the thread prepares ahead of the step.
DEPTH = 2
#: Seconds between two reports of the loader's rates.
REPORT_SECONDS = 60.0
#: Share of the wall time the steps may wait for data before the loader counts as the bound.
DATA_BOUND_SHARE = 0.02
_END = object()
_POLL_SECONDS = 0.1


class LoaderRates:
    """Utterances the loader delivered and the steps consumed, and the steps' wait, over
    the last `interval` seconds; `report` gives the line to log once it has passed."""

    def __init__(self, workers: int, interval: float = REPORT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self.start = now
        self.delivered_utts = 0
        self.consumed_utts = 0
        self.waited = 0.0

    def delivered(self, utterances: int) -> None:
        """The loader handed over a batch of `utterances`."""
        with self._lock:
            self.delivered_utts += utterances

    def consumed(self, utterances: int, waited: float) -> None:
        """The step took a batch of `utterances` after waiting `waited` seconds for it."""
        with self._lock:
            self.consumed_utts += utterances
            self.waited += waited

    def report(self) -> str | None:
        """The report of the interval that has passed (None before it has), and start the
        next: rates in utterances per second, the share of time the steps waited and,
        when above `DATA_BOUND_SHARE`, the workers that would keep up."""
        now = self.clock()
        with self._lock:
            wall = now - self.start
            if wall < self.interval:
                return None
            delivered, consumed, waited = self.delivered_utts, self.consumed_utts, self.waited
            self._reset(now)
        share = waited / wall
        line = (f"data: the loader delivered {delivered / wall:.1f} utt/s, the steps took "
                f"{consumed / wall:.1f} utt/s and waited {share:.1%} of {wall:.0f} s")
        if share <= DATA_BOUND_SHARE or not delivered:
            return line + "; the loader keeps up"
        demand = consumed / max(wall - waited, 1e-9)  # what the steps alone would take
        needed = math.ceil(max(self.workers, 1) * demand / (delivered / wall) - 1e-6)
        return (line + f"; data-bound: the steps alone would take {demand:.1f} utt/s, about "
                f"{needed} workers (now {self.workers}; train.option.workers) would keep up, "
                "given the cores")


class Prefetcher:
    """Iterates `loader` (batches) `depth` batches ahead in a thread, each moved to `device`
    and featurized (`Batch.featurize`); `depth` 0 does it in the caller's thread, when the
    step asks (no prefetching). `workers`: the loader's, for `LoaderRates`, logged when
    `report` (see the module docstring). `close` stops the loader's workers."""

    def __init__(self, loader: Iterable[Batch], device: torch.device, depth: int = DEPTH,
                 workers: int = 0, report: bool = True) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be at least 0, got {depth}")
        self.loader = loader
        self.device = device
        self.depth = depth
        self.rates = LoaderRates(workers)
        self.report = report
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._running: _Fetcher | None = None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def counts(self) -> dict[str, int]:
        """The loader's `RingLoader.counts` (batches through a ring slot, and plain)."""
        return self.loader.counts

    def __iter__(self) -> Iterator[Batch]:
        self._stop_running()
        if self.depth == 0:
            return self._in_turn()
        # The DataLoader starts its workers and installs its signal handlers in the
        # thread that creates the iterator: this one, the main thread.
        fetcher = _Fetcher(iter(self.loader), self._prepare, self.depth)
        self._running = fetcher
        return self._batches(fetcher)

    def _batches(self, fetcher: _Fetcher) -> Iterator[Batch]:
        try:
            while True:
                begin = time.perf_counter()
                item = fetcher.get()
                waited = time.perf_counter() - begin
                if item is _END:
                    return
                batch, event = item
                if event is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(event)
                    batch.feats.record_stream(stream)
                self.rates.consumed(len(batch), waited)
                self._report()
                yield batch
        finally:
            fetcher.stop()
            if self._running is fetcher:
                self._running = None

    def _in_turn(self) -> Iterator[Batch]:
        iterator = iter(self.loader)
        while True:
            begin = time.perf_counter()
            batch = next(iterator, None)
            if batch is None:
                return
            batch = self._prepare(batch)[0]
            self.rates.consumed(len(batch), time.perf_counter() - begin)
            self._report()
            yield batch

    def _prepare(self, batch: Batch) -> tuple[Batch, torch.cuda.Event | None]:
        """(the batch on the device with its features, the event that ends that work)."""
        self.rates.delivered(len(batch))
        if self._stream is None or self.depth == 0:
            return batch.to(self.device, non_blocking=True).featurize(), None
        with torch.cuda.stream(self._stream):
            # From the worker's slot (pageable memory) the copy returns once it has read
            # the slot, which is then free; the fbank runs on this stream.
            batch = batch.to(self.device).featurize()
            event = torch.cuda.Event()
            event.record(self._stream)
        return batch, event

    def _report(self) -> None:
        line = self.rates.report()
        if line is not None and self.report:
            logger.info(line)

    def _stop_running(self) -> None:
        if self._running is not None:
            self._running.stop()
            self._running = None

    def close(self) -> None:
        """Stop the thread, then the loader's workers (`loader.close()`)."""
        self._stop_running()
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


class _Fetcher:
    """The thread: `prepare(batch)` of each batch of `iterator` into a queue of `depth`;
    the end, or the error that ended it, comes last."""

    def __init__(self, iterator: Iterator[Batch], prepare: Callable[[Batch], Any],
                 depth: int) -> None:
        self.iterator = iterator
        self.prepare = prepare
        self.queue: queue.Queue = queue.Queue(depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cat-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.iterator:
                if self.stopping.is_set() or not self._put(self.prepare(batch)):
                    return
            self._put(_END)
        except BaseException as error:  # the trainer raises it where it takes the batch
            self._put(error)

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        """The next prepared batch, `_END`, or the loader's error raised here."""
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop fetching and wait for the thread (it finishes the batch it is taking)."""
        self.stopping.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get(timeout=_POLL_SECONDS)
        self.thread.join()
