"""Progress bars that worker processes advance: one tqdm bar in the parent, a shared counter.

Decoding and transcription spread their batches over spawned worker processes
(`cat.core.process.process_pool`); each worker reports what it finished with
`advance(n)`, and the parent's bar follows a shared counter. The same call works
in-process (one worker), so the code doing the work does not know where it runs.

Usage:
    with WorkerProgress(total=len(utterances), desc="decoding dev", unit="utt") as progress:
        with process_pool(2, *progress.pool_initializer()) as pool:
            ...  # workers call cat.core.progress.advance(len(batch)) after each batch
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import Any

from tqdm import tqdm

__all__ = ["WorkerProgress", "advance"]

logger = logging.getLogger(__name__)

# The counter of the bar this process reports to: set in the parent while a bar is open,
# and in a pool worker by its initializer. Per process, never shared by import.
_counter: Any = None


def advance(count: int = 1) -> None:
    """Add `count` to the open bar of this process (or of its parent); a no-op without one."""
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += count


def _attach(counter: Any) -> None:
    global _counter
    _counter = counter


class WorkerProgress:
    """A tqdm bar following a counter its workers advance. Without a terminal (a log file,
    a pipe) the bar is off, as the others of the toolkit are (`disable=None`), and a log
    line says how far it got every `log_seconds` instead. Counts are integers; `scale`
    shows them in `unit`s (0.01 with unit "s": counts of 10 ms frames shown as seconds)."""

    def __init__(self, total: int | None, desc: str, unit: str = "utt",
                 interval: float = 0.25, log_seconds: float = 60.0, scale: float = 1) -> None:
        self._value = multiprocessing.get_context("spawn").Value("q", 0)
        self._bar = tqdm(total=total, desc=desc, unit=unit, disable=None, dynamic_ncols=True,
                         unit_scale=scale if scale != 1 else False)
        self._total, self._desc, self._unit, self._scale = total, desc, unit, scale
        self._interval = interval
        self._log_seconds = log_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="progress", daemon=True)

    @property
    def count(self) -> int:
        """What the workers (and this process) reported so far."""
        return self._value.value

    def pool_initializer(self) -> tuple[Any, tuple]:
        """(initializer, initargs) of `process_pool` for workers that report to this bar."""
        return _attach, (self._value,)

    def _refresh(self) -> None:
        done = self._value.value
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def _follow(self) -> None:
        start = last_log = time.monotonic()
        while not self._stop.wait(self._interval):
            self._refresh()
            now = time.monotonic()
            if self._bar.disable and now - last_log >= self._log_seconds:
                last_log = now
                of = f"/{self._total * self._scale:g}" if self._total is not None else ""
                logger.info("%s: %g%s %s in %.0f s", self._desc,
                            self._value.value * self._scale, of, self._unit, now - start)

    def __enter__(self) -> WorkerProgress:
        _attach(self._value)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        _attach(None)
        self._refresh()
        self._bar.close()
