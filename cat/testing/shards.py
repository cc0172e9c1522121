"""Factories for tar shards: packed with the real stage-2 writer, uneven, corrupt, served.

`write_uneven_shards` packs a feature corpus into one folder per shard (each with its own
`index.jsonl`), so shards can have any sizes; `truncate_file` cuts a file short;
`claim_member_size` rewrites a tar header's size field (bit rot the checksum passes);
`serve_directory` serves a folder over HTTP on 127.0.0.1 for `http://` shard tests (in a
thread, with injected faults); `serve_directory_process` does it from a process of its
own (`python -m http.server`), which a test can kill or stop, or a benchmark time apart.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from cat.core.io import PathLike, write_table
from cat.formats import prep_wds, shard_format
from cat.testing.features import FeatureCorpus


def write_corpus_subset(corpus: FeatureCorpus, keys: Sequence[str], directory: PathLike
                        ) -> tuple[Path, Path]:
    """A `feats.scp` + `text` of `keys` only (pointing into the corpus arks)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scp = {}
    with open(corpus.feats_scp, encoding="utf-8") as f:
        for line in f:
            key, location = line.rstrip("\n").split(" ", 1)
            scp[key] = location
    write_table(directory / "feats.scp", ((k, scp[k]) for k in keys))
    write_table(directory / "text", ((k, corpus.transcripts[k]) for k in keys))
    return directory / "feats.scp", directory / "text"


def write_shards(corpus: FeatureCorpus, out: PathLike, utts_per_file: int,
                 filter_group: Sequence[str] | None = None, seed: int = 0) -> list[Path]:
    """Pack the whole corpus with `cat.formats.prep_wds.pack_data`; returns the shard paths."""
    out = Path(out)
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out, filter_group=filter_group,
                       utts_per_file=utts_per_file, seed=seed)
    return sorted(out.rglob("*.tar"))


def write_uneven_shards(corpus: FeatureCorpus, out: PathLike, sizes: Sequence[int]
                        ) -> list[Path]:
    """Shards of the given sizes, `out/shard-<i>/data-00000.tar` (glob `out/*/data-*.tar`).

    The corpus keys are used in order; `sum(sizes)` must not exceed the corpus size.
    """
    keys = corpus.keys
    if sum(sizes) > len(keys):
        raise ValueError(f"{sum(sizes)} utterances asked for, the corpus has {len(keys)}")
    out = Path(out)
    paths = []
    start = 0
    for index, size in enumerate(sizes):
        folder = out / f"shard-{index:03d}"
        scp, text = write_corpus_subset(corpus, keys[start:start + size], out / f".lists-{index}")
        prep_wds.pack_data(scp, text, folder, utts_per_file=size)
        paths.append(folder / (prep_wds.DEFAULT_FMT % 0))
        start += size
    return paths


def write_raw_shard(path: PathLike, samples: Sequence[tuple[str, np.ndarray, str]],
                    text_bytes: dict[str, bytes] | None = None,
                    npy_bytes: dict[str, bytes] | None = None,
                    skip: dict[str, str] | None = None) -> Path:
    """A tar of `(utterance id, features, transcript)` written member by member, without
    the checks of the stage-2 writer (for malformed inputs: empty text, wrong dims).

    `text_bytes` / `npy_bytes` replace the members of some keys by raw bytes (non-UTF-8
    text, garbage features); `skip` leaves out one member (`"npy"` or `"txt"`) of a key.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text_bytes, npy_bytes, skip = text_bytes or {}, npy_bytes or {}, skip or {}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key, features, text in samples:
            buffer = io.BytesIO()
            np.save(buffer, features)
            members = (("npy", npy_bytes.get(key, buffer.getvalue())),
                       ("txt", text_bytes.get(key, text.encode("utf-8"))))
            for extension, data in members:
                if skip.get(key) == extension:
                    continue
                info = tarfile.TarInfo(f"{shard_format.encode_key(key)}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def truncate_file(path: PathLike, keep_fraction: float) -> int:
    """Cut `path` to `keep_fraction` of its size; returns the new size."""
    path = Path(path)
    size = int(path.stat().st_size * keep_fraction)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def claim_member_size(path: PathLike, size: int, member: int = 0) -> str:
    """Rewrite the size field of the `member`-th tar header of `path` to `size` (GNU
    base-256 when it does not fit in octal), with a valid checksum: bit rot in a header
    that the checksum cannot catch. Returns the member's name."""
    path = Path(path)
    with tarfile.open(path) as tar:
        info = tar.getmembers()[member]
    with open(path, "r+b") as f:
        f.seek(info.offset)
        header = bytearray(f.read(512))
        header[124:136] = f"{size:011o}\0".encode() if size < 8 ** 11 else \
            b"\x80" + size.to_bytes(11, "big")
        header[148:156] = b" " * 8
        header[148:156] = f"{sum(header):06o}\0 ".encode()
        f.seek(info.offset)
        f.write(header)
    return info.name


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files, and `bytes=a-b` ranges of them when `ranges` is set; `faults[name]`
    lists what the next requests of a file get: "503" (an error status), "cut" (the
    headers of the whole file, then half its bytes and a closed connection), "drop" (the
    connection closed without an answer) or "ok"."""

    faults: ClassVar[dict[str, list[str]]] = {}
    ranges = False
    bytes_per_second = 0  # > 0: every answer is sent at this rate (a slow, live store)
    lock = threading.Lock()

    def _send_slowly(self, data: bytes) -> None:
        step = max(1, self.bytes_per_second // 20)
        for start in range(0, len(data), step):
            self.wfile.write(data[start:start + step])
            self.wfile.flush()
            time.sleep(0.05)

    def _send_file(self, name: str) -> None:
        try:
            data = (Path(self.directory) / name).read_bytes()
        except OSError:
            self.send_error(404, "no such file")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._send_slowly(data)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.split("?", 1)[0].rsplit("/", 1)[-1]
        with self.lock:
            plan = self.faults.get(name)
            fault = plan.pop(0) if plan else "ok"
        if fault == "503":
            self.send_error(503, "try again later")
            return
        if fault == "drop":
            self.close_connection = True
            return
        requested = self.headers.get("Range", "")
        if self.ranges and requested.startswith("bytes=") and fault == "ok":
            data = (Path(self.directory) / name).read_bytes()
            first, last = (int(v) for v in requested[len("bytes="):].split("-"))
            part = data[first:last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{first + len(part) - 1}/"
                                              f"{len(data)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if self.bytes_per_second:
                self._send_slowly(part)
            else:
                self.wfile.write(part)
            return
        if self.bytes_per_second and fault == "ok":
            self._send_file(name)
            return
        if fault == "cut":
            data = (Path(self.directory) / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        super().do_GET()


@contextlib.contextmanager
def serve_directory(directory: PathLike, faults: dict[str, list[str]] | None = None,
                    ranges: bool = False, bytes_per_second: int = 0) -> Iterator[str]:
    """Serve `directory` over HTTP on 127.0.0.1 (a free port); yields the base URL.

    `faults` injects failures per file name, `ranges` answers Range requests,
    `bytes_per_second` sends every answer at that rate in 20 pieces a second (see
    `_QuietHandler`)."""
    handler_class = type("_Handler", (_QuietHandler,), {"faults": dict(faults or {}),
                                                        "ranges": ranges,
                                                        "bytes_per_second": bytes_per_second})
    handler = functools.partial(handler_class, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_directory_process(directory: PathLike, startup_timeout: float = 30.0
                            ) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m http.server` serving `directory` on 127.0.0.1 (a free port), in its own
    process; yields `(process, base URL)` once it answers, and kills it on leaving (after
    a SIGCONT, in case the test stopped it)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                                "--directory", str(directory), str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server for {directory} did not start")
            time.sleep(0.05)
        yield process, f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()
