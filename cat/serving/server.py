"""The WebSocket server of `python -m cat.serve`: connections, limits, the web page.

One process serves the page (`GET /`: `cat/serving/static/`, plain HTML and JavaScript),
its status (`GET /status`: JSON of the connections and streams held, and the decoding
thread's busy seconds) and the WebSocket protocol of `cat.serving.protocol` on the same
port, with the `websockets` library. Each connection is a task of the event loop; the
model runs in one decoding thread (`cat.serving.scheduler.Decoder`) over an `Engine`.

Limits (`ServerSettings`, the command's options): connections beyond `max_connections`
are closed at once with 1013 (try again later); a message over `max_message_bytes` with
1009; a connection's audio beyond `max_audio_seconds` ends it (its results are sent, then
1008); a client that sends faster than the server decodes is no longer read once
`max_backlog_seconds` of its audio wait (TCP holds it back), so its memory stays bounded
and it takes no more than its turn; a client that does not read its results is closed with
4002 once `max_queued_results` final results wait for it (partial results replace the
waiting partial of their segment). Each connection sends its results from a task of its
own, so a slow or vanished client holds only itself; a connection that goes away, however
it goes, has its stream's state dropped by the decoding thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http
import json
import logging
import mimetypes
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from cat.serving.engine import Engine
from cat.serving.protocol import CloseCode, ProtocolError, Result, parse_audio, parse_start
from cat.serving.scheduler import Decoder, Session

logger = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
#: The files of the page, by path.
PAGES = {"/": "index.html", "/index.html": "index.html", "/app.js": "app.js",
         "/worklet.js": "worklet.js"}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The server's address and limits (see the module docstring)."""

    host: str = "127.0.0.1"
    port: int = 6006
    max_connections: int = 64
    max_audio_seconds: float = 3600.0
    max_message_bytes: int = 1 << 20
    max_backlog_seconds: float = 10.0
    max_queued_results: int = 100
    start_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_audio_seconds", "max_message_bytes",
                     "max_backlog_seconds", "max_queued_results", "start_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Connection:
    """One client: its session with the decoding thread and the results waiting to be
    sent."""

    def __init__(self, websocket: ServerConnection, settings: ServerSettings) -> None:
        self.websocket, self.settings = websocket, settings
        self.outbox: collections.deque[Result] = collections.deque()
        self.waiting = asyncio.Event()
        self.done = asyncio.Event()
        self.close_code, self.close_reason = CloseCode.DONE, "done"
        #: How the connection closes once its audio is decoded (a limit may have ended it).
        self.end_code, self.end_reason = CloseCode.DONE, "done"

    def on_results(self, results: list[Result]) -> None:
        for result in results:
            last = self.outbox[-1] if self.outbox else None
            if (last is not None and not last.final and not result.final
                    and last.segment == result.segment):
                self.outbox[-1] = result  # the client only needs the latest partial
            else:
                self.outbox.append(result)
        if sum(result.final for result in self.outbox) > self.settings.max_queued_results:
            self.on_done(CloseCode.NOT_READING, "results not read: "
                         f"{self.settings.max_queued_results} final results wait")
        self.waiting.set()

    def on_done(self, code: CloseCode, reason: str) -> None:
        if code == CloseCode.DONE:
            code, reason = self.end_code, self.end_reason
        if not self.done.is_set():
            self.close_code, self.close_reason = code, reason
            self.done.set()
            self.waiting.set()

    async def send_results(self) -> None:
        """Send results as they come until the end (then those still waiting, unless the
        client does not read them)."""
        while True:
            await self.waiting.wait()
            self.waiting.clear()
            while self.outbox and self.close_code != CloseCode.NOT_READING:
                await self.websocket.send(self.outbox.popleft().message())
            if self.done.is_set():
                return


class AsrServer:
    """The server of an `engine` with `settings` (see the module docstring)."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.connections = 0
        self.opened = 0
        self.decoder: Decoder | None = None
        self.started = time.monotonic()

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; logs (and prints) the address it listens on."""
        loop = asyncio.get_running_loop()
        self.decoder = Decoder(self.engine, loop)
        self.decoder.start()
        try:
            async with serve(self.handle, self.settings.host, self.settings.port,
                             process_request=self.http, max_size=self.settings.max_message_bytes,
                             compression=None) as server:
                host, port = next(iter(server.sockets)).getsockname()[:2]
                print(f"serving on http://{host}:{port}/ (WebSocket ws://{host}:{port}/)",
                      flush=True)
                if ready is not None:
                    ready.set()
                await asyncio.Future()
        finally:
            self.decoder.stop()
            self.decoder.join(timeout=10)

    # -- HTTP ---------------------------------------------------------------------------
    def http(self, connection: ServerConnection, request: Request) -> Response | None:
        """The page and the status for plain GET requests; None lets a WebSocket
        handshake through."""
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        path = request.path.split("?", 1)[0]
        if path == "/status":
            return _response(http.HTTPStatus.OK, json.dumps(self.status()).encode(),
                             "application/json")
        name = PAGES.get(path)
        if name is None:
            return _response(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return _response(http.HTTPStatus.OK, (STATIC / name).read_bytes(), mime)

    def status(self) -> dict[str, Any]:
        """The connections and the streams whose state is held, the most audio a stream
        has waiting (seconds), and the decoding thread's steps: how many, the most streams
        in one, their seconds."""
        decoder = self.decoder
        found = {"connections": self.connections, "opened": self.opened,
                 "uptime_seconds": round(time.monotonic() - self.started, 3),
                 "sample_rate": self.engine.sample_rate, "streaming": self.engine.streaming}
        if decoder is not None:
            found.update(streams=decoder.num_streams, steps=decoder.steps,
                         largest_batch=decoder.largest_batch,
                         busy_seconds=round(decoder.busy_seconds, 3),
                         pending_seconds=round(decoder.most_pending() /
                                               self.engine.sample_rate, 3))
        return found

    # -- WebSocket ----------------------------------------------------------------------
    async def handle(self, websocket: ServerConnection) -> None:
        if self.connections >= self.settings.max_connections:
            await websocket.close(CloseCode.TRY_AGAIN_LATER, f"the server holds its maximum "
                                  f"of {self.settings.max_connections} connections")
            return
        self.connections += 1
        self.opened += 1
        try:
            await self._serve(websocket, self.opened)
        finally:
            self.connections -= 1

    async def _serve(self, websocket: ServerConnection, number: int) -> None:
        settings, engine = self.settings, self.engine
        try:
            message = await asyncio.wait_for(websocket.recv(), settings.start_timeout)
            start = parse_start(message, engine.sample_rate)
            state = engine.open(start)
        except TimeoutError:
            await websocket.close(CloseCode.POLICY, f"no start message within "
                                  f"{settings.start_timeout:g} s")
            return
        except ProtocolError as error:
            await websocket.close(error.code, error.reason)
            return
        except ValueError as error:
            await websocket.close(CloseCode.BAD_MESSAGE, ProtocolError(
                CloseCode.BAD_MESSAGE, str(error)).reason)
            return
        except ConnectionClosed:
            return
        connection = Connection(websocket, settings)
        session = Session(number, state, connection.on_results, connection.on_done)
        assert self.decoder is not None
        await websocket.send(json.dumps({"type": "ready", "sample_rate": engine.sample_rate,
                                         "streaming": engine.streaming,
                                         "chunk_seconds": engine.chunk_seconds}))
        self.decoder.add(session)
        sender = asyncio.create_task(connection.send_results())
        try:
            await self._receive(websocket, start, session, connection)
            if session.ended:  # wait for the last results, or for the client to leave
                await _first(connection.done.wait(), websocket.wait_closed())
            connection.on_done(connection.close_code, connection.close_reason)
            await _first(sender, websocket.wait_closed())
            await websocket.close(connection.close_code, connection.close_reason)
        except ConnectionClosed:
            pass
        finally:
            session.closed = True
            self.decoder.notify()
            sender.cancel()

    async def _receive(self, websocket: ServerConnection, start: Any, session: Session,
                       connection: Connection) -> None:
        """Take the connection's audio until its end, its limit, a bad message or the
        server's own end of it (an error, results not read)."""
        rate, settings = self.engine.sample_rate, self.settings
        limit = int(settings.max_audio_seconds * rate)
        backlog = int(settings.max_backlog_seconds * rate)
        received = 0
        while not connection.done.is_set():
            while session.pending_samples > backlog and not connection.done.is_set():
                await _first(asyncio.sleep(0.02), connection.done.wait())
            message = await _first(websocket.recv(), connection.done.wait())
            if connection.done.is_set():  # the server ended the connection
                return
            try:
                samples = parse_audio(message, start)
            except ProtocolError as error:
                connection.on_done(error.code, error.reason)
                return
            if samples is not None and received + len(samples) > limit:
                session.put(samples[:limit - received])
                connection.end_code, connection.end_reason = CloseCode.POLICY, (
                    f"the audio limit of {settings.max_audio_seconds:g} s per connection")
                samples = None
            if samples is None:
                session.ended = True
                self.decoder.notify()
                return
            received += len(samples)
            session.put(samples)
            self.decoder.notify()


async def _first(*awaitables: Any) -> Any:
    """The result of whichever of `awaitables` finishes first (None when it returns
    nothing); the others are cancelled. A `ConnectionClosed` it raises is raised."""
    tasks = [asyncio.ensure_future(item) for item in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
    first = next(task for task in tasks if task in done)
    return first.result()


def _response(status: http.HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status.value, status.phrase, headers, body)
