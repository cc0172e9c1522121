"""Progress watchdog for distributed training: a stalled rank ends the job, named.

A rank that stops without dying (SIGSTOP, a hung driver or file system, a frozen host)
leaves the other ranks blocked in their next collective until the process-group timeout
(`train.option.dist_timeout_seconds`), which then fails with a message that names no
rank. With `train.option.stall_seconds` > 0, every rank of a distributed run also runs a
`Watchdog`:

* the training loop calls `beat(step)` after each optimizer update, and `pause()` /
  `resume()` around evaluation and checkpointing, which may take long legitimately;
* a heartbeat thread writes `{"step", "beat", "where", "paused"}` for its rank to the
  torch.distributed store (the c10d store torchrun provides) every `interval` seconds,
  and reads the other ranks' records. `beat` counts up as long as the process runs, even
  while its main thread waits in a collective; `where` is the main thread's innermost
  frame in this package (and the innermost frame overall);
* a checker thread ends the process when its own rank has completed no update for
  `stall_seconds` (outside pauses), or when another rank's heartbeat has stopped for
  that long (at any time, pauses included: a stopped process is caught even while the
  others wait for it in a checkpoint's barrier). It logs an error naming the ranks whose
  heartbeat stopped (a stopped or dead process, an unreachable host); when every
  heartbeat goes on, the ranks that are behind; and where each rank is. Then it exits
  with status 1, and torchrun ends the other ranks. A rank that ended training stops its
  watchdog and says so, so it is not taken for a stopped one. The checker never waits on
  the network: a store that stopped answering is reported as such.

Keep `stall_seconds` above the slowest update, including the start of an epoch (loader
workers starting, shuffle buffers filling, storage retries), and below
`dist_timeout_seconds`, so the watchdog speaks before the collective times out.

Usage:
    watchdog = start_watchdog(rank, world_size, options.stall_seconds)
    for step in ...:
        update()
        watchdog.beat(step)
    watchdog.stop()
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEY_PREFIX = "cat/watchdog"
EXIT_STATUS = 1
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_THIS_FILE = Path(__file__).resolve()


def heartbeat_interval(stall_seconds: float) -> float:
    """Seconds between heartbeats: a tenth of the stall limit, within [0.2, 10]."""
    return min(max(stall_seconds / 10, 0.2), 10.0)


def _frame_name(frame: Any) -> str:
    path = Path(frame.f_code.co_filename)
    name = (path.relative_to(_PACKAGE_DIR.parent) if path.is_relative_to(_PACKAGE_DIR)
            else Path(*path.parts[-3:]))
    return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"


def main_thread_location(thread_id: int | None = None) -> str:
    """Where a thread (default: the main thread) is: its innermost frame in this package,
    and the innermost frame overall when that is elsewhere (e.g. in torch.distributed)."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    while frame is not None and Path(frame.f_code.co_filename) == _THIS_FILE:
        frame = frame.f_back
    innermost = frame
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(_PACKAGE_DIR):
            break
        frame = frame.f_back
    if innermost is None:
        return "unknown"
    if frame is None:
        return f"at {_frame_name(innermost)}"
    if frame is innermost:
        return f"at {_frame_name(frame)}"
    return f"at {_frame_name(frame)}, inside {_frame_name(innermost)}"


@dataclasses.dataclass
class PeerRecord:
    """What this rank knows of another rank's heartbeat."""

    step: int
    beat: int
    where: str
    paused: bool
    stopped: bool
    beat_changed: float  # this rank's clock when `beat` last changed


class Watchdog:
    """One rank's watchdog (see the module doc); `store` is a torch.distributed Store."""

    def __init__(self, store: Any, rank: int, world_size: int, stall_seconds: float,
                 interval: float | None = None,
                 on_stall: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stall_seconds <= 0:
            raise ValueError(f"stall_seconds must be positive, got {stall_seconds}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.stall_seconds = stall_seconds
        self.interval = interval or heartbeat_interval(stall_seconds)
        self.on_stall = on_stall or _exit_process
        self.clock = clock
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"{KEY_PREFIX}/{restart}"
        self.step = 0
        self.last_progress = self.started = clock()
        self.paused = 0
        self.beats = 0
        self.peers: dict[int, PeerRecord] = {}
        self.last_exchange = clock()
        self.store_error: str | None = None
        self.fired = False
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._main_thread = threading.main_thread().ident

    # ------------------------------------------------------------------ training loop

    def start(self) -> Watchdog:
        """Publish this rank's first heartbeat and start the threads."""
        self.last_progress = self.last_exchange = self.started = self.clock()
        self.exchange()
        for target, name in ((self._heartbeat_loop, "watchdog-heartbeat"),
                             (self._check_loop, "watchdog-check")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def beat(self, step: int) -> None:
        """Record that this rank completed optimizer update `step`."""
        self.step = step
        self.last_progress = self.clock()

    def pause(self) -> None:
        """Stop checking (evaluation, checkpointing); pauses nest."""
        self.paused += 1

    def resume(self) -> None:
        """Check again, counting the stall time from now."""
        self.paused = max(0, self.paused - 1)
        self.last_progress = self.clock()

    def stop(self) -> None:
        """End the threads (idempotent); the heartbeat thread tells the other ranks this
        rank stopped on purpose, unless the store blocks it (then it is left behind)."""
        self._stopped.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval)
        self._threads = []

    # ------------------------------------------------------------------ threads

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def exchange(self) -> None:
        """Write this rank's heartbeat, read the others' (may block on the store)."""
        try:
            self.beats += 1
            record = {"step": self.step, "beat": self.beats, "paused": self.paused > 0,
                      "stopped": self._stopped.is_set(),
                      "where": main_thread_location(self._main_thread)}
            self.store.set(self._key(self.rank), json.dumps(record))
            for rank in range(self.world_size):
                if rank != self.rank and self.store.check([self._key(rank)]):
                    self._note_peer(rank, json.loads(self.store.get(self._key(rank))))
            self.last_exchange = self.clock()
            self.store_error = None
        except Exception as error:  # any store failure is reported by the checker
            self.store_error = f"{type(error).__name__}: {error}"

    def _note_peer(self, rank: int, record: dict[str, Any]) -> None:
        previous = self.peers.get(rank)
        changed = previous is None or previous.beat != record["beat"]
        self.peers[rank] = PeerRecord(int(record["step"]), int(record["beat"]),
                                      str(record["where"]), bool(record["paused"]),
                                      bool(record.get("stopped")),
                                      self.clock() if changed else previous.beat_changed)

    def _heartbeat_loop(self) -> None:
        while not self._stopped.wait(self.interval):
            self.exchange()
        self.exchange()  # the last record says "stopped"

    def _check_loop(self) -> None:
        while not self._stopped.wait(self.interval):
            if self.check():
                return

    def _silent_ranks(self, now: float, limit: float) -> list[int]:
        """Other ranks that sent no heartbeat for `limit` seconds (those that stopped
        their watchdog on purpose excepted)."""
        silent = []
        for rank in range(self.world_size):
            record = self.peers.get(rank)
            if rank == self.rank or (record is not None and record.stopped):
                continue
            heard = record.beat_changed if record is not None else self.started
            if now - heard > limit:
                silent.append(rank)
        return silent

    def check(self) -> bool:
        """End the job if this rank stalled (no update for `stall_seconds`, outside pauses)
        or another rank's heartbeat stopped for that long (at any time); returns whether
        it did."""
        if self.fired or self._stopped.is_set():
            return False
        now = self.clock()
        stalled = not self.paused and now - self.last_progress > self.stall_seconds
        store_answers = now - self.last_exchange <= self._silence()
        if not stalled and not (store_answers and self._silent_ranks(now, self.stall_seconds)):
            return False
        self.fired = True
        self.on_stall(self.diagnose())
        return True

    # ------------------------------------------------------------------ diagnosis

    def _silence(self) -> float:
        """No heartbeat for this long means a rank (or the store) is not answering."""
        return max(4 * self.interval, 1.0)

    def diagnose(self) -> str:
        """The error message: who stopped, who is behind, where every rank is."""
        now = self.clock()
        silence = self._silence()
        store_silent = now - self.last_exchange > silence
        silent = sorted(set(self._silent_ranks(now, silence))
                        | {rank for rank in range(self.world_size)
                           if rank != self.rank and rank not in self.peers})
        steps = {rank: record.step for rank, record in self.peers.items()} | {
            self.rank: self.step}
        behind = [rank for rank, step in sorted(steps.items()) if step < max(steps.values())]
        if store_silent:
            cause = (f"the heartbeat store has not answered for {now - self.last_exchange:.0f} "
                     f"s ({self.store_error or 'no reply'}): the host holding it (torchrun's "
                     "rendezvous endpoint) may be gone")
        elif silent:
            ages = [now - self.peers[rank].beat_changed for rank in silent if rank in self.peers]
            heard = f"no heartbeat for {min(ages):.0f} s" if ages else "no heartbeat ever"
            cause = (f"{_ranks(silent)} stopped responding ({heard}: a stopped or hung "
                     "process, or an unreachable host)")
        elif behind:
            cause = (f"{_ranks(behind)} fell behind at step {min(steps.values())} (others at "
                     f"step {max(steps.values())})")
        else:
            cause = (f"every rank is alive at step {self.step}, and none completed an update "
                     "(a hang in data loading or in a collective; see where each rank is)")
        details = [f"rank {self.rank}: step {self.step}, "
                   f"{'paused, ' if self.paused else ''}"
                   f"{main_thread_location(self._main_thread)} (this rank)"]
        for rank in range(self.world_size):
            record = self.peers.get(rank)
            if rank == self.rank:
                continue
            if record is None:
                details.append(f"rank {rank}: no heartbeat received")
                continue
            details.append(f"rank {rank}: step {record.step}, heartbeat "
                           f"{now - record.beat_changed:.1f} s ago"
                           f"{', paused' if record.paused else ''}, {record.where}")
        progress = (f"{'paused' if self.paused else 'no training update'} for "
                    f"{now - self.last_progress:.0f} s after step {self.step}")
        return (f"watchdog of rank {self.rank} ({progress}; train.option.stall_seconds="
                f"{self.stall_seconds:g}): {cause}. {'; '.join(details)}. Ending the job.")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exit_process(message: str) -> None:
    """Log `message`, flush the logs, and exit at once (the main thread may be blocked)."""
    logger.error("%s", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


class NoWatchdog:
    """The watchdog of a single-process run, or with `stall_seconds: 0`: does nothing."""

    def start(self) -> NoWatchdog:
        return self

    def beat(self, step: int) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def stop(self) -> None:
        pass


def start_watchdog(rank: int, world_size: int, stall_seconds: float
                   ) -> Watchdog | NoWatchdog:
    """A started `Watchdog` on the default process group's store for a distributed run
    with `stall_seconds` > 0, else a `NoWatchdog`."""
    if world_size <= 1 or stall_seconds <= 0:
        return NoWatchdog()
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    watchdog = Watchdog(store, rank, world_size, stall_seconds)
    logger.info("watchdog: a rank with no update for %g s ends the job (heartbeat every "
                "%.1f s)", stall_seconds, watchdog.interval)
    return watchdog.start()
