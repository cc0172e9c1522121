"""How long a hung store (server SIGSTOPped, its sockets open) takes to end training.

Trains the tiny test experiment from shards served over HTTP (`python -m http.server`)
or S3 (SeaweedFS), with the SHIPPED read defaults (`read_timeout`, `read_retries`,
`read_ahead_mb` of hyper-p.schema.json), stops the server with SIGSTOP once the first
checkpoint is saved, and prints the seconds from the stop to the storage error
(`DataUnavailableError` on stderr) and from the error to the end of the process.

The code measured is the `cat` package found first on PYTHONPATH (set it to another
checkout to measure that one).

Usage:
    python bench/hung_store.py --store http,s3 [--limit 900]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cat
from cat.testing.seaweedfs import seaweedfs_s3
from cat.testing.shards import serve_directory_process
from cat.testing.training import write_tiny_experiment

CODE_ROOT = Path(cat.__file__).resolve().parent.parent
OPTIONS = {"epochs": 6, "check_freq": 1, "shuffle_buffer": 4, "sort_buffer": 4}


def _latest_step(exp_dir: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        return json.loads((exp_dir / "check/checkpoints.json").read_text())["checkpoints"][-1][
            "step"]
    return 0


def stop_and_time(root: Path, exp_dir: Path, environment: dict, pause, limit: float
                  ) -> tuple[float | None, float | None, str]:
    """(seconds from the stop to the error, from the error to the exit, last stderr)."""
    training = subprocess.Popen([sys.executable, "-m", "cat.ctc.train", "exp/tiny"], cwd=root,
                                env=environment, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    error_at: list[float] = []

    def watch() -> None:
        for line in training.stderr:
            lines.append(f"{time.monotonic():.1f} {line}")
            if "DataUnavailableError" in line and not error_at:
                error_at.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        deadline = time.monotonic() + 300
        while _latest_step(exp_dir) < 1:
            if training.poll() is not None:
                raise RuntimeError("".join(lines)[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError("training did not start")
            time.sleep(0.02)
        pause()
        began = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            training.wait(timeout=limit)
        ended = time.monotonic() if training.poll() is not None else None
        watcher.join(1)
        to_error = error_at[0] - began if error_at else None
        to_exit = ended - error_at[0] if ended is not None and error_at else None
        if os.environ.get("HUNG_STORE_LOG"):
            Path(os.environ["HUNG_STORE_LOG"]).write_text(f"stopped at {began:.1f}\n"
                                                          + "".join(lines))
        return to_error, to_exit, "".join(lines[-3:]).strip()[-300:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(training.pid, signal.SIGKILL)


def measure(store: str, work: Path, limit: float) -> tuple[float | None, float | None, str]:
    experiment = write_tiny_experiment(work / store, options=OPTIONS)
    environment = {**os.environ, "PYTHONPATH": str(CODE_ROOT), "OMP_NUM_THREADS": "1"}
    if store == "http":
        with serve_directory_process(work / store / "data/wds/train") as (server, url):
            experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar")
            return stop_and_time(experiment.root, experiment.exp_dir, environment,
                                 lambda: server.send_signal(signal.SIGSTOP), limit)
    with seaweedfs_s3(work / "server") as server:
        server.create_bucket("speech")
        server.upload_folder(work / store / "data/wds/train", "speech", "wds/train")
        experiment.use_shards(trset="s3://speech/wds/train/data-0000{0..7}.tar")
        return stop_and_time(experiment.root, experiment.exp_dir,
                             {**environment, **server.environment()}, server.pause, limit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="http,s3", help="http, s3 or both")
    parser.add_argument("--limit", type=float, default=900,
                        help="seconds to wait for the end after the stop")
    args = parser.parse_args()
    print(f"code: {CODE_ROOT}; load: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as work:
        for store in args.store.split(","):
            to_error, to_exit, tail = measure(store, Path(work), args.limit)
            def fmt(s):
                return ("never" if s is None else f"{s:.1f} s")
            print(f"{store}: stop -> error {fmt(to_error)}; error -> exit {fmt(to_exit)}")
            print(f"  {tail!r}")


if __name__ == "__main__":
    main()
