"""The server's decoding thread: the streams of all connections through one `Engine`.

Connections (the event loop's tasks) put their audio in their `Session`'s inbox and set its
flags; the `Decoder` thread alone touches the engine. Each round it takes in the audio
that came, steps every stream with a chunk ready (one chunk each, in batches of the engine's
`max_batch`: a stream sending faster than real time gets no more than the others, and waits
its turn), finishes the streams whose audio ended, drops those whose client left (their
state is freed), and hands each session its results through the event loop
(`loop.call_soon_threadsafe`), so a slow client never holds the thread. A batch whose step
fails is stepped again a stream at a time, so that only the stream that fails is closed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cat.serving.engine import Engine
from cat.serving.protocol import CloseCode, Result

logger = logging.getLogger(__name__)


class Session:
    """One connection's stream as the decoding thread sees it. The event loop appends audio
    to `inbox` and sets `ended` (the audio is over) or `closed` (the client left); the
    thread sets `backlog` (samples taken in and not yet decoded) and delivers results and
    the end through `on_results(results)` and `on_done(code, reason)`, called in the event
    loop."""

    def __init__(self, number: int, state: Any,
                 on_results: Callable[[list[Result]], None],
                 on_done: Callable[[CloseCode, str], None]) -> None:
        self.number, self.state = number, state
        self.on_results, self.on_done = on_results, on_done
        self.inbox: collections.deque[np.ndarray] = collections.deque()
        # Each counter has one writer (the event loop puts, the thread takes), so that no
        # update is lost between the threads.
        self.put_samples = self.taken_samples = 0
        self.backlog = 0
        self.ended = self.closed = False
        self.finished = False  # set by the thread once its last results are out

    def put(self, samples: np.ndarray) -> None:
        self.put_samples += len(samples)
        self.inbox.append(samples)

    @property
    def pending_samples(self) -> int:
        """Audio taken in and not yet decoded (the thread counts what it takes into the
        engine's backlog before it counts it taken: never less than there is)."""
        return self.put_samples - self.taken_samples + self.backlog


class Decoder(threading.Thread):
    """The decoding thread over `engine` (see the module docstring); results go to each
    session through `loop`. `stop()` ends it."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="decoder", daemon=True)
        self.engine, self.loop = engine, loop
        self.sessions: dict[int, Session] = {}
        self.wake = threading.Condition()
        self.stopping = False
        #: Seconds spent in model steps, the steps, and the most streams one step took.
        self.busy_seconds = 0.0
        self.steps = 0
        self.largest_batch = 0

    # -- called from the event loop -----------------------------------------------------
    def add(self, session: Session) -> None:
        with self.wake:
            self.sessions[session.number] = session
            self.wake.notify()

    def notify(self) -> None:
        with self.wake:
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()

    @property
    def num_streams(self) -> int:
        """Streams whose state the engine holds."""
        return len(self.sessions)

    def most_pending(self) -> int:
        """The most audio (samples) a stream has taken in and not yet decoded."""
        with self.wake:
            sessions = list(self.sessions.values())
        return max((session.pending_samples for session in sessions), default=0)

    # -- the thread -----------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.wake:
                if self.stopping:
                    return
                if not self._has_work():
                    self.wake.wait(timeout=0.5)
                sessions = list(self.sessions.values())
            try:
                self._round(sessions)
            except Exception:  # the thread must not die: the server would stall
                logger.exception("decoding round failed")

    def _has_work(self) -> bool:
        return any(session.inbox or session.closed or (session.ended and not session.finished)
                   or self.engine.ready(session.state) for session in self.sessions.values())

    def _round(self, sessions: list[Session]) -> None:
        live = []
        for session in sessions:
            if session.closed:
                self._drop(session)
                continue
            while session.inbox and not session.closed:
                samples = session.inbox.popleft()
                self._guarded(session, lambda s=session, a=samples: self.engine.accept(
                    s.state, a))
                if not session.closed:
                    session.backlog = self.engine.backlog(session.state)
                session.taken_samples += len(samples)
            if not session.closed:
                live.append(session)
        ready = [session for session in live if self.engine.ready(session.state)]
        batch = self.engine.max_batch
        for start in range(0, len(ready), batch):
            self._step(ready[start:start + batch])
        for session in live:
            if (session.ended and not session.finished and not session.closed
                    and not session.inbox and not self.engine.ready(session.state)):
                results = self._guarded(session, lambda s=session: self.engine.finish(s.state))
                if not session.closed:
                    session.finished = True
                    self._deliver(session, results or [])
                    self._done(session, CloseCode.DONE, "done")
            if not session.closed:
                session.backlog = self.engine.backlog(session.state)

    def _step(self, sessions: list[Session]) -> None:
        start = time.perf_counter()
        try:
            results = self.engine.step([session.state for session in sessions])
        except Exception:
            if len(sessions) == 1:
                self._fail(sessions[0])
                return
            logger.exception("a batch of %d streams failed; stepping them one by one",
                             len(sessions))
            for session in sessions:
                self._step([session])
            return
        finally:
            self.busy_seconds += time.perf_counter() - start
            self.steps += 1
            self.largest_batch = max(self.largest_batch, len(sessions))
        for session, found in zip(sessions, results, strict=True):
            self._deliver(session, found)

    def _guarded(self, session: Session, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:
            self._fail(session)
            return None

    def _fail(self, session: Session) -> None:
        logger.exception("stream %d failed", session.number)
        self._done(session, CloseCode.INTERNAL_ERROR, "the server failed to decode this audio")
        session.closed = True
        self._drop(session)

    def _drop(self, session: Session) -> None:
        with self.wake:
            self.sessions.pop(session.number, None)
        session.state = None  # freed now, whatever still refers to the session

    def _deliver(self, session: Session, results: list[Result]) -> None:
        if results:
            self.loop.call_soon_threadsafe(session.on_results, results)

    def _done(self, session: Session, code: CloseCode, reason: str) -> None:
        self.loop.call_soon_threadsafe(session.on_done, code, reason)
