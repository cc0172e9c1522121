"""Factories for the server's tests and benchmark: a tiny streaming model that recognises
something (tones), `python -m cat.serve` as a child process, and a WebSocket client.

The tone corpus: each of `TONES`' characters is spoken as a tone of its own frequency
(with its octave), a quarter of a second or so, the characters of an utterance apart by
short pauses, over a faint noise floor. A one-block Conformer learns it in a few hundred
updates, so its hypotheses are the transcripts and stay the same when the audio is cut,
shifted or resampled a little (a browser's microphone path), and its pauses are blank.

Usage:
    experiment, checkpoint = train_tone_experiment(tmp_path)
    with ServerProcess([experiment.name, "--chunk-size", "4"], cwd=experiment.root) as server:
        messages, code, reason = asyncio.run(stream_audio(server.ws_url, samples))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from cat.core.io import PathLike, write_table
from cat.core.process import parent_death_preexec
from cat.testing.audio import write_audio
from cat.testing.audio_experiment import AudioExperiment, write_audio_experiment

SAMPLE_RATE = 16000
#: The tone corpus's characters and their frequencies (Hz).
TONES = {"天": 300.0, "地": 520.0, "人": 850.0, "山": 1300.0, "水": 1900.0, "火": 2700.0}
NOISE_FLOOR = 0.002
#: The chunk (encoder frames) the tone model streams in: 160 ms.
CHUNK_SIZE = 4


def tone_audio(text: str, rng: np.random.Generator, lead: float = 0.15,
               tail: float = 0.3) -> np.ndarray:
    """The tones of `text` (characters of `TONES`), float32 at 16 kHz."""
    parts = [np.zeros(int(lead * SAMPLE_RATE), np.float32)]
    for index, char in enumerate(text):
        seconds = rng.uniform(0.22, 0.32)
        time_axis = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        frequency = TONES[char] * rng.uniform(0.97, 1.03)
        envelope = np.minimum(1.0, np.minimum(time_axis, seconds - time_axis) / 0.02)
        tone = (np.sin(2 * np.pi * frequency * time_axis)
                + 0.3 * np.sin(4 * np.pi * frequency * time_axis)) * envelope
        parts.append((rng.uniform(0.2, 0.4) * tone).astype(np.float32))
        if index + 1 < len(text):
            parts.append(np.zeros(int(rng.uniform(0.08, 0.16) * SAMPLE_RATE), np.float32))
    parts.append(np.zeros(int(tail * SAMPLE_RATE), np.float32))
    audio = np.concatenate(parts)
    return (audio + NOISE_FLOOR * rng.standard_normal(len(audio))).astype(np.float32)


def with_digital_silence(audio: np.ndarray, rng: np.random.Generator, lead: float,
                         tail: float) -> np.ndarray:
    """`audio` with its first samples (up to `lead` seconds) or its last (up to `tail`),
    or both, or neither, set to zero: what a microphone path gives before and after the
    sound (a model that never heard digital zeros may take them for a token)."""
    audio = audio.copy()
    if rng.random() < 0.5:
        audio[:int(rng.uniform(0, lead) * SAMPLE_RATE)] = 0.0
    if rng.random() < 0.5:
        audio[len(audio) - int(rng.uniform(0, tail) * SAMPLE_RATE):] = 0.0
    return audio


def tone_text(rng: np.random.Generator, min_chars: int = 2, max_chars: int = 5) -> str:
    chars = list(TONES)
    return "".join(chars[i] for i in rng.integers(0, len(chars),
                                                  int(rng.integers(min_chars, max_chars + 1))))


def tone_corpus(root: Path, durations: Sequence[float], seed: int) -> Path:
    """A Kaldi data dir of `len(durations)` tone utterances (their lengths follow their
    transcripts), as `write_audio_experiment`'s `corpus`."""
    rng = np.random.default_rng(seed)
    wav_scp, text, utt2spk = {}, {}, {}
    for index in range(len(durations)):
        speaker = f"S{index % 2 + 1:04d}"
        utt = f"{speaker}W{index + 1:04d}"
        transcript = tone_text(rng)
        lead, tail = rng.uniform(0.15, 0.5), rng.uniform(0.3, 0.8)
        audio = with_digital_silence(tone_audio(transcript, rng, lead, tail), rng, lead, tail)
        path = write_audio(root / "audio" / f"{utt}.wav", audio, SAMPLE_RATE)
        wav_scp[utt], text[utt], utt2spk[utt] = str(path), transcript, speaker
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_table(data / "wav.scp", wav_scp.items())
    write_table(data / "text", text.items())
    write_table(data / "utt2spk", utt2spk.items())
    return data


def train_tone_experiment(root: PathLike, epochs: int = 40, num_train: int = 48,
                          num_test: int = 6) -> tuple[AudioExperiment, Path]:
    """A tiny U2 CTC experiment (causal convolutions, chunks of 1 to 8 encoder frames)
    trained on the tone corpus under `root`: (the experiment, its last checkpoint)."""
    from cat.training.cli import train

    root = Path(root)
    with contextlib.chdir(root), mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        experiment = write_audio_experiment(root, kind="ctc", epochs=epochs,
                                            train_durations=[1.0] * num_train,
                                            test_durations=[1.0] * num_test, corpus=tone_corpus)
        config_path = experiment.exp_dir / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["encoder"]["kwargs"].update(hdim=32, causal_conv=True, max_chunk_size=8)
        config["scheduler"]["kwargs"].update(peak_lr=1e-2, warmup_steps=20)
        config_path.write_text(json.dumps(config), encoding="utf-8")
        train(experiment.name, "cat.ctc.train")
    checkpoints = sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))
    return experiment, checkpoints[-1]


@dataclasses.dataclass
class ServerProcess:
    """`python -m cat.serve ARGS --port 0` as a child process (killed with its parent),
    from `cwd`: `with` waits (at most `timeout` seconds) for the address it prints, and
    stops it by its pid at the end."""

    args: Sequence[str]
    cwd: PathLike = "."
    timeout: float = 180.0
    env: dict[str, str] | None = None

    def __enter__(self) -> ServerProcess:
        command = [sys.executable, "-m", "cat.serve", *self.args, "--port", "0"]
        self.process = subprocess.Popen(
            command, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(self.env or {})},
            preexec_fn=parent_death_preexec())
        self.lines: list[str] = []
        found = threading.Event()
        self.address = ""

        def read() -> None:  # the server's output, kept for the test's messages
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line)
                match = re.search(r"serving on http://([\d.]+:\d+)/", line)
                if match and not found.is_set():
                    self.address = match.group(1)
                    found.set()
            found.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(self.timeout) or not self.address:
            self.stop()
            raise RuntimeError(f"the server did not start within {self.timeout:g} s:\n"
                               + "".join(self.lines[-30:]))
        return self

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.address}/"

    def status(self) -> dict[str, Any]:
        """The server's `/status`."""
        import urllib.request

        with urllib.request.urlopen(self.url + "status", timeout=10) as response:
            return json.loads(response.read())

    def wait_for(self, condition: Callable[[dict[str, Any]], bool], timeout: float,
                 what: str) -> dict[str, Any]:
        """The first `/status` that satisfies `condition` (polled); TimeoutError naming
        `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if condition(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s (status {status})")
            time.sleep(0.05)

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self.reader.join(timeout=5)

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass
class Transcript:
    """What a client got: the server's messages (JSON), and how the connection closed."""

    messages: list[dict[str, Any]]
    code: int | None
    reason: str

    @property
    def finals(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("type") == "final"]

    @property
    def partials(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("type") == "partial"]

    @property
    def text(self) -> str:
        """The final texts joined."""
        return "".join(m["text"] for m in self.finals)


async def stream_audio(url: str, samples: np.ndarray, piece_seconds: float = 0.1,
                       realtime: float = 1.0, start: dict[str, Any] | None = None,
                       end: bool = True, timeout: float = 120.0) -> Transcript:
    """Stream `samples` (16 kHz float32) to the server at `url` in pieces of
    `piece_seconds`, at `realtime` times real time (0: as fast as the server reads), then
    the end message; collect the server's messages until it closes."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    messages: list[dict[str, Any]] = []

    async def session() -> Transcript:
        async with connect(url, max_size=None) as websocket:
            await websocket.send(json.dumps(start or {"sample_rate": SAMPLE_RATE}))

            async def receive() -> None:
                with contextlib.suppress(ConnectionClosed):
                    async for message in websocket:
                        messages.append(json.loads(message))

            receiver = asyncio.create_task(receive())
            piece = max(1, int(piece_seconds * SAMPLE_RATE))
            began = time.monotonic()
            try:
                for index, first in enumerate(range(0, len(samples), piece)):
                    await websocket.send(samples[first:first + piece].astype("<f4").tobytes())
                    if realtime:
                        delay = began + (index + 1) * piece_seconds / realtime - time.monotonic()
                        await asyncio.sleep(max(0.0, delay))
                if end:
                    await websocket.send(json.dumps({"type": "end"}))
            except ConnectionClosed:
                pass
            await receiver
        return Transcript(messages, websocket.close_code, websocket.close_reason or "")

    return await asyncio.wait_for(session(), timeout)
