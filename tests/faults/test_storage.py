"""The shard server fails in the middle of an epoch: killed (SIGKILL) or stopped (SIGSTOP).

Training must stop with an error naming the storage, in bounded time, with a non-zero
exit status, never "succeed" through epochs without data; under the shipped read
settings a hung store ends training within 60 s and the process within seconds of its
error, while a slow store that keeps sending trains everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cat
from cat.testing.seaweedfs import seaweedfs_s3
from cat.testing.shards import serve_directory, serve_directory_process
from cat.testing.training import write_tiny_experiment

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
NAME = "exp/tiny"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _latest_step(exp_dir: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        return json.loads((exp_dir / "check/checkpoints.json").read_text())["checkpoints"][-1][
            "step"]
    return 0


def _break_storage_during_training(root: Path, exp_dir: Path, environment: dict,
                                   break_storage) -> tuple[int, str, float]:
    """Starts training, calls `break_storage()` once the first checkpoint is saved and
    returns (exit status, stderr, seconds from the fault to the end of training)."""
    training = subprocess.Popen([sys.executable, "-m", "cat.ctc.train", NAME], cwd=root,
                                env=environment, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _latest_step(exp_dir) < 1:
            assert training.poll() is None, training.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        break_storage()
        began = time.monotonic()
        _, errors = training.communicate(timeout=150)
        return training.returncode, errors, time.monotonic() - began
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(training.pid, signal.SIGKILL)


@pytest.mark.parametrize(("fault", "strict"), [("kill", False), ("stop", False),
                                                ("kill", True)])
def test_shard_server_failing_mid_epoch_stops_training_with_an_error(tmp_path, fault, strict):
    experiment = write_tiny_experiment(tmp_path, options={
        "epochs": 3, "check_freq": 1, "shuffle_buffer": 4, "sort_buffer": 4})
    with serve_directory_process(tmp_path / "data/wds/train") as (server, url):
        experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar", read_ahead_mb=0,
                              read_timeout=2, strict_shards=strict)
        environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        returncode, errors, seconds = _break_storage_during_training(
            tmp_path, experiment.exp_dir, environment,
            lambda: server.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP))
    assert returncode != 0
    assert "DataUnavailableError" in errors and url in errors, errors[-3000:]
    if strict:
        assert "strict_shards is set" in errors
    else:
        assert "more than bad_shard_limit=0.1" in errors
    # One shard: 4 attempts 1, 2 and 4 s apart, each up to read_timeout (2 s) when stopped.
    assert seconds < 60, seconds
    print(f"server {fault}{' (strict)' if strict else ''}: training stopped {seconds:.1f} s "
          f"later: {errors.strip().splitlines()[-1][:200]}")


def test_training_from_s3_trains_everything_and_a_dead_store_stops_it(tmp_path):
    """The tiny experiment trains from `s3://` shards on a SeaweedFS server (every
    utterance once per epoch); killed mid-epoch, the store stops training with an error
    naming the bucket and the shard."""
    complete = write_tiny_experiment(tmp_path / "complete", options={"epochs": 2})
    broken = write_tiny_experiment(tmp_path / "broken", options={
        "epochs": 3, "check_freq": 1, "shuffle_buffer": 4, "sort_buffer": 4})
    with seaweedfs_s3(tmp_path / "server") as server:
        server.create_bucket("speech")
        server.upload_folder(tmp_path / "complete/data/wds/train", "speech", "wds/train")
        environment = {**os.environ, **server.environment(), "PYTHONPATH": str(REPO_ROOT),
                       "OMP_NUM_THREADS": "1"}
        trset = "s3://speech/wds/train/data-0000{0..7}.tar"
        complete.use_shards(trset=trset, read_timeout=2)
        run = subprocess.run([sys.executable, "-m", "cat.ctc.train", NAME], cwd=complete.root,
                             env=environment, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        coverage = [json.loads(line) for line in
                    (complete.exp_dir / "log/coverage.jsonl").read_text().splitlines()]
        assert [c["trained"] for c in coverage] == [len(complete.train.keys)] * 2

        broken.use_shards(trset=trset, read_ahead_mb=0, read_timeout=2)
        returncode, errors, seconds = _break_storage_during_training(
            broken.root, broken.exp_dir, environment, server.stop)
    assert returncode != 0
    assert "DataUnavailableError" in errors and "storage: s3://speech at http://127.0.0.1:" \
        in errors and "s3://speech/wds/train/data-0000" in errors, errors[-3000:]
    assert seconds < 60, seconds
    print(f"S3 store killed: training stopped {seconds:.1f} s later: "
          f"{errors.strip().splitlines()[-1][:200]}")


def test_training_from_an_fsspec_store_trains_everything_and_a_lost_store_stops_it(tmp_path):
    """The tiny experiment trains from `file://` shards read through fsspec (every
    utterance once per epoch); when the store's folder goes away mid-epoch, training
    stops with the DataUnavailableError naming the store and the shards that S3 and HTTP
    stores give."""
    complete = write_tiny_experiment(tmp_path / "complete", options={"epochs": 2})
    broken = write_tiny_experiment(tmp_path / "broken", options={
        "epochs": 3, "check_freq": 1, "shuffle_buffer": 4, "sort_buffer": 4})
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    store = tmp_path / "complete/data/wds/train"
    complete.use_shards(trset=f"file://{store}/data-0000{{0..7}}.tar", read_timeout=2)
    run = subprocess.run([sys.executable, "-m", "cat.ctc.train", NAME], cwd=complete.root,
                         env=environment, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    coverage = [json.loads(line) for line in
                (complete.exp_dir / "log/coverage.jsonl").read_text().splitlines()]
    assert [c["trained"] for c in coverage] == [len(complete.train.keys)] * 2
    assert all(c["unavailable_shards"] == [] for c in coverage)

    shards = tmp_path / "broken/data/wds/train"
    broken.use_shards(trset=f"file://{shards}/data-*.tar", read_ahead_mb=0, read_timeout=2)
    returncode, errors, seconds = _break_storage_during_training(
        broken.root, broken.exp_dir, environment, lambda: shards.rename(shards.with_name("gone")))
    assert returncode != 0
    assert "DataUnavailableError" in errors and f"storage: file://{str(shards).split('/')[1]}" \
        in errors and f"file://{shards}/data-0000" in errors, errors[-3000:]
    assert seconds < 60, seconds
    print(f"fsspec store lost: training stopped {seconds:.1f} s later: "
          f"{errors.strip().splitlines()[-1][:200]}")
def _hang_storage_during_training(root: Path, exp_dir: Path, environment: dict,
                                  hang) -> tuple[str, float, float]:
    """Starts training, calls `hang()` once the first checkpoint is saved and returns
    (stderr, seconds from the fault to the storage error on stderr, seconds from that
    error to the end of the process)."""
    training = subprocess.Popen([sys.executable, "-m", "cat.ctc.train", NAME], cwd=root,
                                env=environment, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    error_at: list[float] = []

    def watch() -> None:
        for line in training.stderr:
            lines.append(line)
            if "DataUnavailableError" in line and not error_at:
                error_at.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        deadline = time.monotonic() + 120
        while _latest_step(exp_dir) < 1:
            assert training.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        hang()
        began = time.monotonic()
        training.wait(timeout=150)
        ended = time.monotonic()
        watcher.join(5)
        assert training.returncode != 0 and error_at, "".join(lines)[-3000:]
        return "".join(lines), error_at[0] - began, ended - error_at[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(training.pid, signal.SIGKILL)


@pytest.mark.parametrize("store", ["http", "s3"])
def test_a_hung_store_ends_training_in_time_under_the_shipped_defaults(tmp_path, store):
    """SIGSTOP of the server (its sockets stay open, nothing answers), with the shipped
    read_timeout, read_retries and read_ahead_mb: the storage error within 60 s, and the
    process gone within 10 s after it (no reader thread left to join)."""
    experiment = write_tiny_experiment(tmp_path, options={
        "epochs": 8, "check_freq": 1, "shuffle_buffer": 4, "sort_buffer": 4})
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        if store == "http":
            server, url = stack.enter_context(
                serve_directory_process(tmp_path / "data/wds/train"))
            experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar")
            storage, hang = url, lambda: server.send_signal(signal.SIGSTOP)
        else:
            server = stack.enter_context(seaweedfs_s3(tmp_path / "server"))
            server.create_bucket("speech")
            server.upload_folder(tmp_path / "data/wds/train", "speech", "wds/train")
            environment.update(server.environment())
            experiment.use_shards(trset="s3://speech/wds/train/data-0000{0..7}.tar")
            storage, hang = "storage: s3://speech at http://127.0.0.1:", server.pause
        errors, to_error, to_exit = _hang_storage_during_training(
            tmp_path, experiment.exp_dir, environment, hang)
    assert "DataUnavailableError" in errors and storage in errors, errors[-3000:]
    print(f"{store} store stopped: the error {to_error:.1f} s later, the process gone "
          f"{to_exit:.1f} s after it: {errors.strip().splitlines()[-1][:200]}")
    assert to_error < 60, errors[-3000:]
    assert to_exit < 10


def test_a_slow_store_that_keeps_sending_trains_every_utterance(tmp_path, monkeypatch):
    """A store sending 50 KB/s (about 2 s per shard of the tiny experiment, slower than the
    training consumes it) is not timed out: every utterance is trained in every epoch."""
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 2})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with serve_directory(tmp_path / "data/wds/train", ranges=True,
                         bytes_per_second=50_000) as url:
        experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar")
        run = subprocess.run([sys.executable, "-m", "cat.ctc.train", NAME], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                             capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    coverage = [json.loads(line) for line in
                (experiment.exp_dir / "log/coverage.jsonl").read_text().splitlines()]
    assert [c["trained"] for c in coverage] == [len(experiment.train.keys)] * 2
    assert "attempt" not in run.stderr, run.stderr[-3000:]  # no read was retried
