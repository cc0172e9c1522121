"""The server's decoding thread (`cat.serving.scheduler.Decoder`) over a fake engine: one
chunk per stream per round in shared batches (a fast sender waits its turn), a stream
that fails is closed alone, the state of a stream whose client left is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from cat.serving.protocol import CloseCode, Result, Start
from cat.serving.scheduler import Decoder, Session

CHUNK = 100


class FakeState:
    def __init__(self, name: str) -> None:
        self.name, self.samples, self.chunks = name, 0, 0


class FakeEngine:
    """Chunks of 100 samples; a stream named 'bad' fails its steps."""

    sample_rate, streaming, chunk_seconds, max_batch = 16000, True, 0.01, 8

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def open(self, start: Start) -> FakeState:
        raise NotImplementedError

    def accept(self, state: FakeState, samples: np.ndarray) -> None:
        state.samples += len(samples)

    def ready(self, state: FakeState) -> bool:
        return state.samples - state.chunks * CHUNK >= CHUNK

    def backlog(self, state: FakeState) -> int:
        return state.samples - state.chunks * CHUNK

    def step(self, states: Sequence[FakeState]) -> list[list[Result]]:
        self.batches.append([state.name for state in states])
        if any(state.name == "bad" for state in states):
            raise RuntimeError("a broken stream")
        for state in states:
            state.chunks += 1
        return [[Result(0, False, 0.0, str(state.chunks))] for state in states]

    def finish(self, state: FakeState) -> list[Result]:
        return [Result(0, True, 0.0, str(state.chunks))]


class Client:
    def __init__(self) -> None:
        self.results: list[Result] = []
        self.done: tuple[CloseCode, str] | None = None

    def on_results(self, results: list[Result]) -> None:
        self.results.extend(results)

    def on_done(self, code: CloseCode, reason: str) -> None:
        self.done = (code, reason)


async def _until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def _run(scenario) -> None:
    async def main() -> None:
        engine = FakeEngine()
        decoder = Decoder(engine, asyncio.get_running_loop())
        try:
            await scenario(engine, decoder)  # starts the thread once its streams are there
        finally:
            decoder.stop()
            decoder.join(timeout=10)
        assert not decoder.is_alive()

    asyncio.run(main())


def _session(number: int, name: str, client: Client) -> Session:
    return Session(number, FakeState(name), client.on_results, client.on_done)


def test_a_fast_sender_gets_one_chunk_per_round_beside_the_others():
    async def scenario(engine: FakeEngine, decoder: Decoder) -> None:
        fast, slow = Client(), Client()
        fast_session, slow_session = _session(1, "fast", fast), _session(2, "slow", slow)
        fast_session.put(np.zeros(5 * CHUNK, np.float32))  # five chunks at once
        slow_session.put(np.zeros(CHUNK, np.float32))
        decoder.add(fast_session)
        decoder.add(slow_session)
        decoder.start()
        await _until(lambda: len(fast.results) == 5 and len(slow.results) == 1)
        # One shared batch first, then the fast stream's other chunks, one per round.
        assert engine.batches == [["fast", "slow"], ["fast"], ["fast"], ["fast"], ["fast"]]
        for session in (fast_session, slow_session):
            session.ended = True
        decoder.notify()
        await _until(lambda: fast.done is not None and slow.done is not None)
        assert fast.done == slow.done == (CloseCode.DONE, "done")
        assert [r.text for r in fast.results if r.final] == ["5"]
        assert fast_session.pending_samples == 0

    _run(scenario)


def test_a_failing_stream_is_closed_alone_and_left_streams_are_dropped():
    async def scenario(engine: FakeEngine, decoder: Decoder) -> None:
        good, bad, gone = Client(), Client(), Client()
        sessions = [_session(1, "good", good), _session(2, "bad", bad),
                    _session(3, "gone", gone)]
        for session in sessions:
            session.put(np.zeros(CHUNK, np.float32))
            decoder.add(session)
        decoder.start()
        await _until(lambda: bad.done is not None and len(good.results) == 1)
        assert bad.done == (CloseCode.INTERNAL_ERROR, "the server failed to decode this audio")
        assert [r.text for r in good.results] == ["1"] and not bad.results
        # The batch failed, then each stream was stepped alone.
        assert engine.batches[0] == ["good", "bad", "gone"]
        assert sorted(map(tuple, engine.batches[1:])) == [("bad",), ("gone",), ("good",)]
        assert sessions[1].state is None and decoder.num_streams == 2
        sessions[2].closed = True  # its client left
        decoder.notify()
        await _until(lambda: decoder.num_streams == 1)
        assert sessions[2].state is None and gone.done is None
        sessions[0].put(np.zeros(CHUNK, np.float32))
        decoder.notify()
        await _until(lambda: len(good.results) == 2)

    _run(scenario)
