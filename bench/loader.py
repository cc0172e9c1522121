"""Benchmark: training data loading, map-style random access against streaming tar shards.

From feature bytes on storage to the padded batches the training loop consumes, on the
same synthetic features (~4 s utterances, 80-dim float32) packed both ways:

* (a) map     the manager's map-style loader (`MapTrainData`: `PackDataset` over the Kaldi
              arks + `BucketBatchSampler` + DataLoader): one ark read per utterance;
* (b) stream  the manager's streaming loader (`StreamTrainData`: `ShardStream` over the
              tar shards of `pack_data` + DataLoader);
* (c) cat     `cat <shards> > /dev/null`: the storage's sequential limit;
* (d) wds     plain `webdataset.WebDataset(shards, shardshuffle=False).decode()` iterated
              over all samples in one process: the peer baseline.

Local disk: cold (every file's page cache dropped with `posix_fadvise(DONTNEED)` after
`os.sync()`, before every timed pass) and warm (the files read once before timing).
Network storage: the same files served over HTTP on 127.0.0.1 by a threaded server (its
own process) that sleeps a fixed latency before every response; (a) sends one Range
request per utterance (`HttpMapPack`, keep-alive connection per process), (b) one request
per shard (`http://` shard URLs through the real `ShardStream`); the baseline is `curl`
fetching every shard in turn. At the larger latencies the map path reads a prefix of its
batches (`--http-map-seconds`), since its rate does not depend on how many it reads.

Peak resident memory (VmHWM) of the loading process and of its DataLoader workers is
printed at 1x and 10x corpus size; 10x lists the same shards (symbolic links) and ark
entries (new utterance ids) ten times, read warm.

Each loader runs in a fresh process (so that its peak RSS is its own) with persistent
workers as in training: an untimed warm-up epoch, then `--repeats` timed passes (one
epoch each), median kept. Rates: utterances/s and MB/s of float32 feature bytes
(1 MB = 1e6 bytes; `cat`/`curl` are credited with the feature bytes of the shards they
read), so every ratio compares the same utterances. Generated data is cached under
`bench/out/` (keyed by size and shard size).

Usage:
    python bench/loader.py --size-mb 380 --workers 1 --latency-ms 2,20
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import http.server
import io
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kaldiio
import numpy as np
import webdataset

from cat.core.config import TrainOptions, train_option_defaults
from cat.core.io import atomic_write, write_table
from cat.formats import prep_wds, shard_format
from cat.formats.mappack import MapPack, write_map_pack
from cat.loading.batch import LengthFilter
from cat.loading.shardlist import load_shard_list
from cat.testing.features import utterance_ids, write_feature_corpus
from cat.text import tokenizer as tokenizers
from cat.training.distributed import DistributedContext
from cat.training.train_data import MapTrainData, StreamTrainData, TrainData

MEGABYTE = 1e6
FEAT_DIM = 80
FRAME_RANGE = (300, 500)  # ~4 s utterances at a 10 ms frame shift
NUM_ARKS = 8
SCALE = 10
# Kaldi binary float matrix: "\0B" "FM " then the rows and columns as (size byte, int32).
KALDI_FLOAT_HEADER_BYTES = 15
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
# Map-style vs streaming targets per latency (ms); other latencies print no target.
HTTP_TARGETS = {2.0: 3.0, 20.0: 20.0}


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class BenchData:
    """The generated corpus in both layouts (paths absolute), written by `prepare_data`."""

    root: str
    tokenizer: str
    pack: str
    pack_x10: str
    shards: list[str]
    shards_x10: list[str]
    arks: list[str]
    num_utts: int
    feature_bytes: int

    @property
    def shard_bytes(self) -> int:
        """Bytes of the tar shards (1x)."""
        return sum(os.path.getsize(p) for p in self.shards)


def _manifest_path(out_root: Path, size_mb: float, utts_per_shard: int) -> Path:
    return out_root / f"loader-{size_mb:g}mb-{utts_per_shard}ups" / "bench.json"


def prepare_data(out_root: Path, size_mb: float, utts_per_shard: int) -> BenchData:
    """Generate (or reuse) the corpus: arks, map packs (1x, 10x), tar shards (1x, 10x)."""
    manifest = _manifest_path(out_root, size_mb, utts_per_shard)
    if manifest.is_file():
        return BenchData(**json.loads(manifest.read_text(encoding="utf-8")))
    root = manifest.parent
    shutil.rmtree(root, ignore_errors=True)  # what an interrupted run left
    mean_bytes = (FRAME_RANGE[0] + FRAME_RANGE[1]) / 2 * FEAT_DIM * 4
    num_utts = max(2, round(size_mb * MEGABYTE / mean_bytes))
    print(f"generating {num_utts} utterances ({size_mb:g} MB) under {root} ...", flush=True)
    corpus = write_feature_corpus(root / "corpus", keys=utterance_ids(num_utts, 100),
                                  frame_range=FRAME_RANGE, dim=FEAT_DIM, num_arks=NUM_ARKS)
    feature_bytes = sum(f.nbytes for f in corpus.features.values())
    frames = {key: len(f) for key, f in corpus.features.items()}
    del corpus.features  # the arks hold them
    tokenizer = root / "tokenizer.tknz"
    tokenizers.save(tokenizers.train_sentencepiece([corpus.text], "char"), tokenizer)
    write_map_pack(corpus.feats_scp, corpus.text, tokenizer, root / "pack" / "train.npz")
    prep_wds.pack_data(corpus.feats_scp, corpus.text, root / "shards",
                       utts_per_file=utts_per_shard)
    x10 = _write_x10_lists(root, corpus.feats_scp, corpus.transcripts, frames)
    write_map_pack(x10 / "feats.scp", x10 / "text", tokenizer, root / "pack" / "train_x10.npz")
    shards = [str(p) for p in sorted((root / "shards").glob("data-*.tar"))]
    data = BenchData(
        root=str(root), tokenizer=str(tokenizer), pack=str(root / "pack" / "train.npz"),
        pack_x10=str(root / "pack" / "train_x10.npz"), shards=shards,
        shards_x10=_write_x10_shards(root / "shards", root / "shards_x10"),
        arks=[str(p) for p in sorted((root / "corpus").glob("feats.*.ark"))],
        num_utts=num_utts, feature_bytes=feature_bytes)
    with atomic_write(manifest) as f:
        json.dump(dataclasses.asdict(data), f, indent=1)
    return data


def _write_x10_lists(root: Path, feats_scp: Path, transcripts: dict[str, str],
                     frames: dict[str, int]) -> Path:
    """feats.scp/text/utt2num_frames listing every utterance 10 times (`r<i>-` ids)."""
    scp = dict(line.rstrip("\n").split(" ", 1)
               for line in feats_scp.read_text(encoding="utf-8").splitlines())
    folder = root / "corpus_x10"
    copies = [(f"r{r}-{key}", key) for r in range(SCALE) for key in scp]
    write_table(folder / "feats.scp", ((new, scp[key]) for new, key in copies))
    write_table(folder / "text", ((new, transcripts[key]) for new, key in copies))
    write_table(folder / "utt2num_frames", ((new, frames[key]) for new, key in copies))
    return folder


def _write_x10_shards(shard_dir: Path, folder: Path) -> list[str]:
    """Links naming every shard 10 times, with an index.jsonl describing them."""
    index = shard_format.read_index(shard_dir)
    folder.mkdir(parents=True, exist_ok=True)
    header = dict(index.header)
    for field in ("num_shards", "num_utts", "num_frames"):
        header[field] *= SCALE
    lines = [json.dumps(header)]
    paths = []
    for copy in range(SCALE):
        for record in index.shards:
            name = f"r{copy}-{record['shard']}"
            (folder / name).symlink_to(Path("..") / shard_dir.name / record["shard"])
            lines.append(json.dumps({**record, "shard": name}, ensure_ascii=False))
            paths.append(str(folder / name))
    with atomic_write(folder / shard_format.INDEX_NAME) as f:
        f.write("\n".join(lines) + "\n")
    return sorted(paths)


# --------------------------------------------------------------------------- page cache


def evict(paths: Sequence[str]) -> None:
    """Drop the page cache of `paths` (after writing back dirty pages)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: Sequence[str]) -> None:
    """Read `paths` once, so that they are in the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


# --------------------------------------------------------------------------- HTTP storage


class _LatencyHandler(http.server.BaseHTTPRequestHandler):
    """GET with Range support from `directory`, each response after `latency` seconds."""

    protocol_version = "HTTP/1.1"  # keep-alive, as object stores and NFS clients do
    directory = "."
    latency = 0.0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        time.sleep(self.latency)
        relative = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        path = os.path.realpath(os.path.join(self.directory, relative))
        if not path.startswith(self.directory + os.sep) or not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        start, end = 0, size - 1
        spec = self.headers.get("Range", "")
        if spec.startswith("bytes="):
            first, _, last = spec[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) if last else size - 1, size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        with open(path, "rb") as f:
            self.request.sendfile(f, start, end - start + 1)


def _serve(directory: str, latency: float, connection: Any) -> None:
    handler = type("Handler", (_LatencyHandler,),
                   {"directory": os.path.realpath(directory), "latency": latency})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    connection.send(server.server_address[1])
    server.serve_forever()


@contextlib.contextmanager
def latency_server(directory: str, latency_ms: float) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 from another process; yields the base URL."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(directory, latency_ms / 1000, sender),
                              daemon=True)
    process.start()
    try:
        yield f"http://127.0.0.1:{receiver.recv()}"
    finally:
        process.terminate()
        process.join()


class HttpMapPack(MapPack):
    """A map pack whose arks are read over HTTP: one Range request per utterance.

    The arks must hold uncompressed float32 matrices of `feat_dim` columns (what
    `kaldiio.save_ark` writes), so each utterance's byte range follows from its frames.
    """

    def __init__(self, path: str, base_url: str, served_root: str, feat_dim: int) -> None:
        self.base_url = base_url
        self.served_root = served_root
        self.feat_dim = feat_dim
        super().__init__(path)

    def _load(self) -> None:
        super()._load()
        root = Path(self.served_root)
        self.ark_urls = ["/" + urllib.parse.quote(str(Path(p).relative_to(root)))
                         for p in self.ark_paths]
        self._connection: http.client.HTTPConnection | None = None
        self._connection_pid = -1

    def _get(self, url: str, start: int, size: int) -> bytes:
        if self._connection is None or self._connection_pid != os.getpid():
            address = urllib.parse.urlsplit(self.base_url)
            self._connection = http.client.HTTPConnection(address.hostname, address.port,
                                                          timeout=60)
            self._connection_pid = os.getpid()
        self._connection.request("GET", url,
                                 headers={"Range": f"bytes={start}-{start + size - 1}"})
        response = self._connection.getresponse()
        body = response.read()
        if response.status != 206 or len(body) != size:
            raise OSError(f"{self.base_url}{url}: HTTP {response.status}, {len(body)} of "
                          f"{size} bytes at offset {start}")
        return body

    def features(self, index: int) -> np.ndarray:
        """Feature matrix of entry `index`, fetched with one Range request."""
        rows = int(self.num_frames[index])
        size = KALDI_FLOAT_HEADER_BYTES + rows * self.feat_dim * 4
        url = self.ark_urls[self.ark_index[index]]
        body = self._get(url, int(self.ark_offsets[index]), size)
        matrix = kaldiio.matio.read_kaldi(io.BytesIO(body))
        if matrix.shape != (rows, self.feat_dim):
            raise ValueError(f"{url}:{self.ark_offsets[index]}: matrix of shape "
                             f"{matrix.shape}, expected ({rows}, {self.feat_dim})")
        return matrix

    def close(self) -> None:
        """Close the connection and any ark handles."""
        if self._connection is not None and self._connection_pid == os.getpid():
            self._connection.close()
        self._connection = None
        super().close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "base_url": self.base_url,
                "served_root": self.served_root, "feat_dim": self.feat_dim}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.base_url = state["base_url"]
        self.served_root = state["served_root"]
        self.feat_dim = state["feat_dim"]
        super().__setstate__(state)


# --------------------------------------------------------------------------- loaders


@dataclasses.dataclass(frozen=True)
class Job:
    """One loader measured in its own process: `modes` are cold, warm or remote."""

    path: str  # "map", "stream" or "wds"
    data: BenchData
    modes: tuple[str, ...]
    workers: int
    repeats: int
    scale: int = 1
    base_url: str | None = None
    limit_utts: int = 0  # 0 = whole epochs
    start_method: str = "fork"  # of the DataLoader workers: what training would use


def _train_options(job: Job, trset: list[str]) -> TrainOptions:
    """The manager's defaults (`hyper-p.json` schema) with this job's data and workers."""
    return TrainOptions(**{**train_option_defaults(), "large_dataset": job.path == "stream",
                           "trset": trset, "devset": [], "tokenizer": job.data.tokenizer,
                           "workers": job.workers})


def _length_filter() -> LengthFilter:
    # A Conformer's 4x subsampling; every ~4 s utterance passes it.
    frames = np.arange(FRAME_RANGE[1] + 1)
    return LengthFilter(None, np.maximum(((frames - 1) // 2 - 1) // 2, 0), 4, ctc=True)


class _TrainDataLoader:
    """A manager training-data object iterated as the training loop does."""

    data: TrainData
    files: list[str]  # what the cold passes evict

    def epoch(self, epoch: int) -> Iterator[tuple[int, int]]:
        """(utterances, frames) of each batch of `epoch`."""
        self.data.start_epoch(epoch, None)
        for batch in self.data:
            self.data.note(batch, trained=True)
            yield len(batch), batch.num_frames

    def close(self) -> None:
        """Release files."""
        self.data.close()


class MapLoader(_TrainDataLoader):
    """(a): `MapTrainData` over the map pack, local arks or `HttpMapPack`."""

    def __init__(self, job: Job, log_dir: str) -> None:
        path = job.data.pack_x10 if job.scale > 1 else job.data.pack
        pack = (MapPack(path) if job.base_url is None
                else HttpMapPack(path, job.base_url, job.data.root, FEAT_DIM))
        self.data = MapTrainData(_train_options(job, [path]), _length_filter(), FEAT_DIM,
                                 DistributedContext(), Path(log_dir), pack)
        self.files = sorted({os.path.realpath(p) for p in pack.ark_paths})


class StreamLoader(_TrainDataLoader):
    """(b): `StreamTrainData` over local or `http://` shards."""

    def __init__(self, job: Job, log_dir: str) -> None:
        paths = job.data.shards_x10 if job.scale > 1 else job.data.shards
        self.files = sorted({os.path.realpath(p) for p in paths})
        urls = paths
        if job.base_url is not None:
            urls = [f"{job.base_url}/{Path(p).relative_to(job.data.root)}" for p in paths]
        self.data = StreamTrainData(_train_options(job, urls), _length_filter(), FEAT_DIM,
                                    DistributedContext(), Path(log_dir), load_shard_list(urls))


class WebDatasetLoader:
    """(d): plain webdataset, decoded with its default decoders, in this process."""

    def __init__(self, job: Job, log_dir: str) -> None:
        self.shards = job.data.shards_x10 if job.scale > 1 else job.data.shards
        self.files = sorted({os.path.realpath(p) for p in self.shards})

    def epoch(self, epoch: int) -> Iterator[tuple[int, int]]:
        """(1, frames) of every sample."""
        for sample in webdataset.WebDataset(self.shards, shardshuffle=False).decode():
            yield 1, len(sample["npy"])

    def close(self) -> None:
        """Nothing to release."""


LOADERS = {"map": MapLoader, "stream": StreamLoader, "wds": WebDatasetLoader}


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Run:
    """One timed pass."""

    seconds: float
    utts: int
    frames: int

    @property
    def utts_per_second(self) -> float:
        """Utterances per second."""
        return self.utts / self.seconds

    @property
    def megabytes_per_second(self) -> float:
        """Float32 feature MB per second."""
        return self.frames * FEAT_DIM * 4 / MEGABYTE / self.seconds


def timed_pass(items: Iterator[tuple[int, int]], limit_utts: int = 0) -> Run:
    """Time `items` to their end (or until `limit_utts` utterances)."""
    utts = frames = 0
    start = time.perf_counter()
    for count, num_frames in items:
        utts += count
        frames += num_frames
        if limit_utts and utts >= limit_utts:
            break
    seconds = time.perf_counter() - start
    items.close()
    return Run(seconds, utts, frames)


def _peak_rss_mb(pid: int | str) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MEGABYTE
    return float("nan")


def peak_rss() -> dict[str, float]:
    """Peak RSS (MB) of this process and the largest of its live child processes."""
    workers = [_peak_rss_mb(p.pid) for p in multiprocessing.active_children()]
    return {"main": _peak_rss_mb("self"), "worker": max(workers, default=0.0)}


def _measure(job: Job) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as log_dir:
        loader = LOADERS[job.path](job, log_dir)
        try:
            # Starts the persistent workers and fills what they keep across epochs.
            timed_pass(loader.epoch(0), job.limit_utts)
            runs: dict[str, list[Run]] = {}
            epoch = 1
            for mode in job.modes:
                if mode != "cold":
                    read_files(loader.files)
                runs[mode] = []
                for _ in range(job.repeats):
                    if mode == "cold":
                        evict(loader.files)
                    runs[mode].append(timed_pass(loader.epoch(epoch), job.limit_utts))
                    epoch += 1
            rss = peak_rss()  # workers are persistent: still alive here
        finally:
            loader.close()
    return {"runs": runs, "rss": rss}


def _measure_in_child(job: Job, connection: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    # A spawned process defaults to spawning its own children; training does not.
    multiprocessing.set_start_method(job.start_method, force=True)
    try:
        connection.send(_measure(job))
    except BaseException:
        connection.send({"error": traceback.format_exc()})


def measure(job: Job) -> dict[str, Any]:
    """Run `job` in a fresh process; returns its runs per mode and peak RSS."""
    job = dataclasses.replace(job, start_method=multiprocessing.get_start_method())
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_in_child, args=(job, sender))
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:
        result = {"error": "the measuring process died"}
    process.join()
    if "error" in result:
        raise RuntimeError(f"measuring {job.path} ({', '.join(job.modes)}) failed:\n"
                           f"{result['error']}")
    return result


def time_command(commands: Sequence[Sequence[str]], data: BenchData, repeats: int,
                 cold_files: Sequence[str] = ()) -> list[Run]:
    """Run `commands` in turn, `repeats` times; `cold_files` are evicted before each."""
    runs = []
    for _ in range(repeats):
        if cold_files:
            evict(cold_files)
        start = time.perf_counter()
        for command in commands:
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        runs.append(Run(time.perf_counter() - start, data.num_utts,
                        data.feature_bytes // (FEAT_DIM * 4)))
    return runs


# --------------------------------------------------------------------------- report


@dataclasses.dataclass
class Row:
    """A line of the table: median of the runs, and the peak RSS of the loading process."""

    section: str
    name: str
    runs: list[Run]
    rss: dict[str, float] | None = None

    @property
    def utts_per_second(self) -> float:
        """Median utterances per second."""
        return statistics.median(r.utts_per_second for r in self.runs)

    @property
    def megabytes_per_second(self) -> float:
        """Median feature MB per second."""
        return statistics.median(r.megabytes_per_second for r in self.runs)


def _runs(result: dict[str, Any], mode: str) -> list[Run]:
    return result["runs"][mode]


def print_table(rows: Sequence[Row]) -> None:
    """The measurements, one line per path and storage."""
    print(f"{'storage':<15} {'path':<38} {'utts/s':>8} {'MB/s':>8} {'utts':>6} "
          f"{'RSS main':>9} {'RSS worker':>11}")
    for row in rows:
        rss = row.rss or {}
        main_rss = f"{rss['main']:.0f} MB" if rss else "-"
        worker_rss = f"{rss['worker']:.0f} MB" if rss.get("worker") else "-"
        print(f"{row.section:<15} {row.name:<38} {row.utts_per_second:>8.0f} "
              f"{row.megabytes_per_second:>8.1f} {row.runs[0].utts:>6} {main_rss:>9} "
              f"{worker_rss:>11}")


def print_ratios(ratios: Sequence[tuple[str, float, float | None]]) -> None:
    """`(name, value, target)` lines with whether each target is met."""
    print(f"{'ratio':<48} {'value':>7} {'target':>8}  met")
    for name, value, target in ratios:
        if target is None:
            print(f"{name:<48} {value:>7.2f} {'-':>8}  -")
        else:
            print(f"{name:<48} {value:>7.2f} {'>= ' + format(target, 'g'):>8}  "
                  f"{'yes' if value >= target else 'NO'}")


def _parse_latencies(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got "
                                         f"{text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=380.0,
                        help="float32 feature bytes of the corpus in MB (default %(default)s)")
    parser.add_argument("--utts-per-shard", type=int, default=250,
                        help="utterances per tar shard (default %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="DataLoader workers of both loaders (default %(default)s)")
    parser.add_argument("--latency-ms", type=_parse_latencies, default=[2.0, 20.0],
                        help="HTTP latencies per request, comma-separated (default 2,20)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per measurement; the median is kept")
    parser.add_argument("--http-map-seconds", type=float, default=5.0,
                        help="about how long one map-style pass over HTTP may take: it "
                             "reads a prefix of its batches (default %(default)s)")
    parser.add_argument("--no-x10", action="store_true", help="skip the 10x corpus")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 32 MB, 25 utterances per shard, one repeat")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="cache of generated data (default bench/out)")
    return parser


def _local_rows(data: BenchData, args: argparse.Namespace) -> dict[str, dict[str, Row]]:
    rows: dict[str, dict[str, Row]] = {"cold": {}, "warm": {}}
    names = {"map": "(a) map-style (MapTrainData)", "stream": "(b) streaming (StreamTrainData)",
             "wds": "(d) plain webdataset, 1 process"}
    for path in ("map", "stream", "wds"):
        result = measure(Job(path, data, ("cold", "warm"), args.workers, args.repeats))
        for mode in ("cold", "warm"):
            rows[mode][path] = Row(f"local {mode}", names[path], _runs(result, mode),
                                   result["rss"])
    files = [os.path.realpath(p) for p in data.shards]
    for mode in ("cold", "warm"):
        read_files(files)
        runs = time_command([["cat", *files]], data, args.repeats,
                            files if mode == "cold" else ())
        rows[mode]["cat"] = Row(f"local {mode}", "(c) cat shards > /dev/null", runs)
    return rows


def _http_rows(data: BenchData, args: argparse.Namespace, latency_ms: float) -> dict[str, Row]:
    section = f"http {latency_ms:g} ms"
    rows = {}
    with latency_server(data.root, latency_ms) as base_url:
        read_files([os.path.realpath(p) for p in data.shards] + data.arks)
        per_request = latency_ms / 1000 + 0.0005
        limit = max(256, int(args.http_map_seconds / per_request) * max(1, args.workers))
        limit = 0 if limit >= data.num_utts else limit
        result = measure(Job("map", data, ("http",), args.workers, args.repeats,
                             base_url=base_url, limit_utts=limit))
        rows["map"] = Row(section, "(a) map-style, 1 Range request/utt", _runs(result, "http"),
                          result["rss"])
        result = measure(Job("stream", data, ("http",), args.workers, args.repeats,
                             base_url=base_url))
        rows["stream"] = Row(section, "(b) streaming, 1 request/shard", _runs(result, "http"),
                             result["rss"])
        urls = [f"{base_url}/{Path(p).relative_to(data.root)}" for p in data.shards]
        runs = time_command([["curl", "-s", url, "-o", "/dev/null"] for url in urls], data,
                            args.repeats)
        rows["curl"] = Row(section, "curl each shard in turn", runs)
    return rows


def _x10_rows(data: BenchData, args: argparse.Namespace) -> dict[str, Row]:
    rows = {}
    names = {"map": "(a) map-style, 10x corpus", "stream": "(b) streaming, 10x corpus"}
    for path, name in names.items():
        result = measure(Job(path, data, ("warm",), args.workers, args.repeats, scale=SCALE))
        rows[path] = Row("local warm 10x", name, _runs(result, "warm"), result["rss"])
    return rows


def _ratios(local: dict[str, dict[str, Row]], http: dict[float, dict[str, Row]],
            workers: int) -> list[tuple[str, float, float | None]]:
    def rate(row: Row) -> float:
        return row.utts_per_second

    cold, warm = local["cold"], local["warm"]
    ratios = [
        ("local cold  b/c  streaming / cat", rate(cold["stream"]) / rate(cold["cat"]), 0.8),
        ("local warm  b/c  streaming / cat", rate(warm["stream"]) / rate(warm["cat"]), None),
        ("local cold  b/d  streaming / webdataset", rate(cold["stream"]) / rate(cold["wds"]),
         None),
        (f"local warm  b/d per worker ({max(workers, 1)})",
         rate(warm["stream"]) / max(workers, 1) / rate(warm["wds"]), 2.0),
        ("local cold  b/a  streaming / map-style", rate(cold["stream"]) / rate(cold["map"]), 1.0),
        ("local warm  b/a  streaming / map-style", rate(warm["stream"]) / rate(warm["map"]), 1.0),
    ]
    for latency, rows in http.items():
        ratios.append((f"http {latency:g} ms  b/a  streaming / map-style",
                       rate(rows["stream"]) / rate(rows["map"]), HTTP_TARGETS.get(latency)))
        ratios.append((f"http {latency:g} ms  b/curl", rate(rows["stream"]) / rate(rows["curl"]),
                       0.8))
    return ratios


def _print_rss(local: dict[str, dict[str, Row]], x10: dict[str, Row]) -> None:
    for path, label in (("map", "(a) map-style"), ("stream", "(b) streaming")):
        small, large = local["warm"][path].rss, x10[path].rss
        print(f"peak RSS {label:<14} 1x -> 10x: main {small['main']:.0f} -> "
              f"{large['main']:.0f} MB, worker {small['worker']:.0f} -> "
              f"{large['worker']:.0f} MB")


def main(argv: Sequence[str] | None = None) -> None:
    """Generate or reuse the corpus, measure every path, print the table and the ratios."""
    args = _build_parser().parse_args(argv)
    if args.quick:
        args.size_mb, args.utts_per_shard, args.repeats = 32.0, 25, 1
        args.http_map_seconds = 1.0
    logging.basicConfig(level=logging.WARNING)
    data = prepare_data(args.out, args.size_mb, args.utts_per_shard)
    print(f"corpus: {data.num_utts} utterances, {data.feature_bytes / MEGABYTE:.0f} MB of "
          f"float32 features ({FEAT_DIM}-dim, {FRAME_RANGE[0]}-{FRAME_RANGE[1]} frames), "
          f"{len(data.shards)} shards ({data.shard_bytes / MEGABYTE:.0f} MB), "
          f"{len(data.arks)} arks; {args.workers} loader worker(s); {os.cpu_count()} CPUs; "
          f"median of {args.repeats}", flush=True)
    local = _local_rows(data, args)
    http = {latency: _http_rows(data, args, latency) for latency in args.latency_ms}
    x10 = {} if args.no_x10 else _x10_rows(data, args)
    rows = [*local["cold"].values(), *local["warm"].values(),
            *(row for rows in http.values() for row in rows.values()), *x10.values()]
    print()
    print_table(rows)
    print()
    print_ratios(_ratios(local, http, args.workers))
    if x10:
        print()
        _print_rss(local, x10)


if __name__ == "__main__":
    main()
