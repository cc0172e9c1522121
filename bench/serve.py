"""Load benchmark of `python -m cat.serve`: N clients at once streaming real-time audio from a
test set, against sherpa-onnx's `OnlineRecognizer` in a loop over the same export.

Rows, for each N of `--clients`:

* `cat.serve EXP` (PyTorch): the server over the experiment's streaming model (U2 streams
  batched into one encoder call per step);
* `cat.serve EXPORT` (sherpa-onnx): the same server over the export folder
  (`streaming_wenet_ctc.onnx`, `decode_streams`);
* `sherpa-onnx loop`: the peer, sherpa-onnx's own `OnlineRecognizer` over the same export,
  N streams fed in real time and decoded with `decode_streams` in one loop, what its
  streaming server does, without a network or a client.

Each client streams utterances of the set one after another (a connection each, its own
order), in 0.1 s pieces paced by the wall clock, the end message right after the last
piece, for `--seconds` of audio; clients start within the first second. Latencies: a
partial result's is the time from sending the audio it decodes (its `decoded` seconds) to
receiving it; a final's, from sending the last piece to receiving the final. RTF: the
server process's CPU seconds (all its threads) over the audio seconds; CPU: that process's
share of one core over the run (the clients run in this process and take their own, in the
`client CPU` column; the loop has none). A row holds real time when the p95 of both its
partial and its final latency are under 1 s (a server that falls behind sees its latencies
grow through the run). With `--find-max`, N is raised past the last row that holds (or
bisected below the first that does not) to the largest N that holds, within 10 %.

With `--cycles C`, before the load rows, the PyTorch server takes C rounds of 8 clients
that stream an utterance as fast as it reads, half of them vanishing mid-utterance (the
connection aborted, no end message), and the server's resident memory (VmRSS) is printed
every tenth of the rounds, with the streams it still holds: memory that grows with the
connections served shows there.

Usage (from the recipe directory, after stage 3 of a chunk-trained experiment):
    python ../../bench/serve.py exp/synth-ctc-stream --chunk-size 16 --clients 1,4,16,64 \
        --seconds 20 --find-max
    python ../../bench/serve.py exp/synth-ctc-stream --chunk-size 16 --cycles 1000 \
        --runtimes none
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from cat.core.io import read_table
from cat.decoding.export import export_main
from cat.features.fbank import read_audio
from cat.testing.serving import ServerProcess

PIECE_SECONDS = 0.1
HOLD_SECONDS = 1.0


@dataclasses.dataclass
class Run:
    """What one runtime did with N clients."""

    runtime: str
    clients: int
    audio_seconds: float
    wall_seconds: float
    cpu_seconds: float
    client_cpu_seconds: float | None
    partial: list[float]
    final: list[float]
    errors: int

    @property
    def holds(self) -> bool:
        return (not self.errors and bool(self.final)
                and _p(self.partial, 95) < HOLD_SECONDS and _p(self.final, 95) < HOLD_SECONDS)

    def row(self) -> str:
        client = ("-" if self.client_cpu_seconds is None
                  else f"{100 * self.client_cpu_seconds / self.wall_seconds:.0f} %")
        return (f"| {self.runtime} | {self.clients} | {self.audio_seconds:.0f} | "
                f"{self.cpu_seconds / self.audio_seconds:.4f} | "
                f"{_p(self.partial, 50):.3f} / {_p(self.partial, 95):.3f} | "
                f"{_p(self.final, 50):.3f} / {_p(self.final, 95):.3f} | "
                f"{100 * self.cpu_seconds / self.wall_seconds:.0f} % | {client} | "
                f"{'yes' if self.holds else 'no'}"
                f"{f' ({self.errors} errors)' if self.errors else ''} |")


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- clients of the WebSocket server ------------------------------------------------------
async def _utterance(url: str, samples: np.ndarray, rate: int, partial: list[float],
                     final: list[float]) -> None:
    """Stream one utterance in real time; add its latencies."""
    from websockets.asyncio.client import connect

    piece = int(PIECE_SECONDS * rate)
    sent: list[float] = []
    async with connect(url, max_size=None) as websocket:
        await websocket.send(json.dumps({"sample_rate": rate}))
        assert json.loads(await websocket.recv())["type"] == "ready"

        async def receive() -> None:
            async for message in websocket:
                now = time.monotonic()
                result = json.loads(message)
                index = min(len(sent) - 1, max(0, int(np.ceil(result["decoded"] * rate)) - 1)
                            // piece)
                if result["type"] == "partial":
                    partial.append(now - sent[index])
                elif len(sent) * piece >= len(samples):
                    final.append(now - sent[-1])

        receiver = asyncio.create_task(receive())
        began = time.monotonic()
        for index, start in enumerate(range(0, len(samples), piece)):
            await asyncio.sleep(max(0.0, began + index * PIECE_SECONDS - time.monotonic()))
            sent.append(time.monotonic())
            await websocket.send(samples[start:start + piece].astype("<f4").tobytes())
        await websocket.send(json.dumps({"type": "end"}))
        await receiver
    if websocket.close_code != 1000:
        raise RuntimeError(f"closed with {websocket.close_code} {websocket.close_reason}")


async def _client(url: str, utterances: list[tuple[np.ndarray, int]], seconds: float,
                  delay: float, partial: list[float], final: list[float]) -> tuple[float, int]:
    await asyncio.sleep(delay)
    audio, errors = 0.0, 0
    for samples, rate in utterances:
        if audio >= seconds:
            break
        try:
            await _utterance(url, samples, rate, partial, final)
        except Exception:
            errors += 1
        audio += len(samples) / rate
    return audio, errors


def run_server(runtime: str, args: list[str], audio: list[tuple[np.ndarray, int]],
               counts: list[int], seconds: float, seed: int) -> list[Run]:
    """The server of `args` under each number of clients."""
    runs = []
    with ServerProcess(args) as server:
        pid = server.process.pid
        for count in counts:
            runs.append(_load(runtime, server, pid, audio, count, seconds, seed))
            print(runs[-1].row(), flush=True)
    return runs


def _load(runtime: str, server: ServerProcess, pid: int, audio: list, count: int,
          seconds: float, seed: int) -> Run:
    rng = np.random.default_rng(seed + count)
    orders = [[audio[i] for i in rng.permutation(len(audio))] for _ in range(count)]
    delays = rng.uniform(0, 1, count)
    partial: list[float] = []
    final: list[float] = []

    async def everyone() -> list[tuple[float, int]]:
        return await asyncio.gather(*(_client(server.ws_url, order, seconds, delay, partial,
                                              final)
                                      for order, delay in zip(orders, delays, strict=True)))

    cpu, client_cpu, wall = _process_cpu(pid), time.process_time(), time.monotonic()
    done = asyncio.run(everyone())
    wall = time.monotonic() - wall
    cpu, client_cpu = _process_cpu(pid) - cpu, time.process_time() - client_cpu
    return Run(runtime, count, sum(a for a, _ in done), wall, cpu, client_cpu, partial, final,
               sum(e for _, e in done))


# -- memory over many connections ---------------------------------------------------------
def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status: no VmRSS line")


async def _vanish(url: str, samples: np.ndarray, rate: int) -> None:
    """Stream half of an utterance, then drop the connection without a close frame."""
    from websockets.asyncio.client import connect

    websocket = await connect(url, max_size=None)
    await websocket.send(json.dumps({"sample_rate": rate}))
    await websocket.recv()
    piece = int(PIECE_SECONDS * rate)
    for start in range(0, len(samples) // 2, piece):
        await websocket.send(samples[start:start + piece].astype("<f4").tobytes())
    await asyncio.sleep(0.05)
    websocket.transport.abort()


def run_cycles(args: list[str], audio: list[tuple[np.ndarray, int]], cycles: int,
               seed: int) -> None:
    """`cycles` rounds of 8 clients, half of them vanishing; the server's RSS as it goes."""
    from cat.testing.serving import stream_audio

    rng = np.random.default_rng(seed)
    with ServerProcess(args) as server:
        pid = server.process.pid

        async def one_round() -> None:
            picks = [audio[i] for i in rng.integers(0, len(audio), 8)]
            await asyncio.gather(*(
                _vanish(server.ws_url, samples, rate) if index % 2
                else stream_audio(server.ws_url, samples, realtime=0)
                for index, (samples, rate) in enumerate(picks)))

        began = time.monotonic()
        print("| rounds | connections | server RSS MiB | streams held | seconds |\n"
              "|---:|---:|---:|---:|---:|", flush=True)
        for done in range(cycles + 1):
            if done % max(1, cycles // 10) == 0 or done == cycles:
                status = server.wait_for(lambda s: s["streams"] == 0, 60, "streams freed")
                print(f"| {done} | {status['opened']} | {_rss_mib(pid):.1f} | "
                      f"{status['streams']} | {time.monotonic() - began:.0f} |", flush=True)
            if done < cycles:
                asyncio.run(one_round())


# -- the peer: sherpa-onnx's OnlineRecognizer in a loop -----------------------------------
def run_sherpa_loop(export_dir: Path, audio: list[tuple[np.ndarray, int]], counts: list[int],
                    seconds: float, seed: int) -> list[Run]:
    from cat.models.registry import family

    meta = json.loads((export_dir / "export.json").read_text(encoding="utf-8"))
    recognizer = family(meta["family"], "export").sherpa_online_recognizer(export_dir)
    rate = int(meta["sample_rate"])
    chunk = round(int(meta["stride"]) * float(meta["frame_shift_ms"]) / 1000 * rate)
    window = round(float(meta["frame_length_ms"]) / 1000 * rate)
    runs = []
    for count in counts:
        runs.append(_sherpa_load(recognizer, audio, rate, chunk, window, count, seconds,
                                 seed))
        print(runs[-1].row(), flush=True)
    return runs


@dataclasses.dataclass
class _Stream:
    """A simulated client of the loop: its utterances, the current one's stream."""

    utterances: list
    start: float
    audio: float = 0.0
    index: int = -1
    stream: object = None
    samples: np.ndarray | None = None
    fed: int = 0
    decoded: int = 0
    sent: list = dataclasses.field(default_factory=list)
    text: str = ""
    finishing: bool = False


def _sherpa_load(recognizer, audio: list, rate: int, chunk: int, window: int, count: int,
                 seconds: float, seed: int) -> Run:
    """N streams fed 0.1 s pieces at wall-clock times, decoded in batches as they are
    ready (what a streaming server's loop does); the latencies as the clients measure (a
    chunk decodes the audio of its frames and of one more frame, as the server's
    `cat.serving.sherpa` says)."""
    rng = np.random.default_rng(seed + count)
    now0 = time.monotonic()
    streams = [_Stream([audio[i] for i in rng.permutation(len(audio))], now0 + delay)
               for delay in rng.uniform(0, 1, count)]
    piece = int(PIECE_SECONDS * rate)
    partial: list[float] = []
    final: list[float] = []
    total = 0.0
    cpu, wall = time.process_time(), time.monotonic()
    while any(s.audio < seconds or s.stream is not None for s in streams):
        now = time.monotonic()
        for s in streams:
            if now < s.start:
                continue
            if s.stream is None:
                if s.audio >= seconds:
                    continue
                s.index += 1
                s.samples = s.utterances[s.index][0]
                s.stream, s.fed, s.decoded, s.sent = recognizer.create_stream(), 0, 0, []
                s.text = ""
                s.finishing, s.start = False, now
            due = int((now - s.start) / PIECE_SECONDS) + 1  # pieces due by now
            while not s.finishing and len(s.sent) < due and s.fed < len(s.samples):
                s.stream.accept_waveform(rate, s.samples[s.fed:s.fed + piece])
                s.fed += piece
                s.sent.append(time.monotonic())
            if not s.finishing and s.fed >= len(s.samples):
                s.stream.accept_waveform(rate, np.zeros(chunk + int(0.3 * rate), np.float32))
                s.stream.input_finished()
                s.finishing = True
        ready = [s for s in streams if s.stream is not None and recognizer.is_ready(s.stream)]
        while ready:
            recognizer.decode_streams([s.stream for s in ready[:32]])
            received = time.monotonic()
            for s in ready[:32]:
                s.decoded += chunk
                text = recognizer.get_result(s.stream)
                if text != s.text and not s.finishing:
                    index = min(len(s.sent) - 1, (min(s.decoded + window, s.fed) - 1) // piece)
                    partial.append(received - s.sent[index])
                s.text = text
            ready = [s for s in streams
                     if s.stream is not None and recognizer.is_ready(s.stream)]
        received = time.monotonic()
        for s in streams:
            if s.stream is not None and s.finishing and not recognizer.is_ready(s.stream):
                final.append(received - s.sent[-1])
                s.audio += len(s.samples) / rate
                total += len(s.samples) / rate
                s.stream, s.finishing = None, False
        time.sleep(max(0.0, 0.01 - (time.monotonic() - now)))
    wall = time.monotonic() - wall
    return Run("sherpa-onnx loop", count, total, wall, time.process_time() - cpu, None,
               partial, final, 0)


# -- the largest N ------------------------------------------------------------------------
def find_max(measure, runs: list[Run], limit: int) -> int:
    """The largest N that holds real time, from `runs` and more runs of `measure(N)`."""
    held = [r.clients for r in runs if r.holds]
    failed = [r.clients for r in runs if not r.holds]
    low = max(held, default=0)
    high = min((n for n in failed if n > low), default=None)
    while high is None:
        probe = min(limit, low * 2 or 1)
        if probe == low:
            return low
        run = measure(probe)
        runs.append(run)
        low, high = (probe, None) if run.holds else (low, probe)
    while high - low > max(1, low // 10):
        probe = (low + high) // 2
        run = measure(probe)
        runs.append(run)
        low, high = (probe, high) if run.holds else (low, probe)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exp", help="a chunk-trained experiment")
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--set", default="test", help="data/<set>/wav.scp")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="audio each client streams (whole utterances)")
    parser.add_argument("--find-max", action="store_true")
    parser.add_argument("--max-clients", type=int, default=256)
    parser.add_argument("--runtimes", default="pytorch,sherpa-server,sherpa-loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cycles", type=int, default=0,
                        help="rounds of connect / disconnect first, with the server's RSS")
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    audio = [read_audio(spec) for _, spec in sorted(read_table(
        Path(f"data/{args.set}/wav.scp")).items())]
    print(f"{datetime.date.today()}, {platform.node()}: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.exp}, chunk "
          f"{args.chunk_size}; {len(audio)} utterances of data/{args.set}, "
          f"{sum(len(s) / r for s, r in audio):.0f} s; {args.seconds:g} s per client",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = Path(tmp) / "export"
        assert export_main("cat.export", [args.exp, "--chunk-size", str(args.chunk_size),
                                          "--out", str(export_dir)]) == 0
        servers = {"pytorch": ("cat.serve EXP (PyTorch)",
                               [args.exp, "--chunk-size", str(args.chunk_size)]),
                   "sherpa-server": ("cat.serve EXPORT (sherpa-onnx)", [str(export_dir)])}
        if args.cycles:
            run_cycles([args.exp, "--chunk-size", str(args.chunk_size)], audio, args.cycles,
                       args.seed)
        runtimes = [r for r in args.runtimes.split(",") if r not in ("", "none")]
        if runtimes:
            print("| runtime | clients | audio s | RTF | partial latency p50 / p95 s | "
                  "final latency p50 / p95 s | server CPU (of 1 core) | client CPU | "
                  "real time |\n|---|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
        largest = {}
        for runtime in runtimes:
            if runtime == "sherpa-loop":
                runs = run_sherpa_loop(export_dir, audio, counts, args.seconds, args.seed)
                name = runs[0].runtime

                def measure(n: int) -> Run:
                    run = run_sherpa_loop(export_dir, audio, [n], args.seconds, args.seed)[0]
                    return run
            else:
                name, server_args = servers[runtime]
                server_args = [*server_args, "--max-connections", "10000"]
                runs = run_server(name, server_args, audio, counts, args.seconds, args.seed)

                def measure(n: int, server_args=server_args, name=name) -> Run:
                    return run_server(name, server_args, audio, [n], args.seconds,
                                      args.seed)[0]
            if args.find_max:
                largest[name] = find_max(measure, runs, args.max_clients)
        for name, n in largest.items():
            print(f"{name}: holds real time up to {n} clients")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
