"""One training at a time per experiment (`cat.training.lock`): a second training is
refused naming the first, a lock whose holder is gone is taken over, the lock is released
however training ends (also when a signal stops it with status 75)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cat
from cat.core.commands import run_verb
from cat.testing.training import write_tiny_experiment
from cat.training import update
from cat.training.checkpoint import CheckpointManager
from cat.training.cli import train
from cat.training.lock import (
    LOCK_NAME,
    ExperimentLock,
    ExperimentLockedError,
    Holder,
    experiment_lock,
    process_start,
)
from cat.training.preemption import STOPPED_EXIT_STATUS

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
NAME = "exp/tiny"
HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    # hyper-p.json:env is exported by training; restore it after each test.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _write_record(directory: Path, **fields) -> None:
    record = {"host": HOST, "pid": 1, "since": "2024-05-01T10:00:00+00:00", **fields}
    (directory / LOCK_NAME).write_text(json.dumps(record), encoding="utf-8")


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_held_lock_refuses_a_second_holder_and_its_release_removes_it(tmp_path):
    first = ExperimentLock(tmp_path)
    first.acquire()
    holder = Holder.parse((tmp_path / LOCK_NAME).read_text())
    assert (holder.host, holder.pid) == (HOST, os.getpid())
    assert holder.started == process_start(os.getpid())
    with pytest.raises(ExperimentLockedError, match=(
            rf"{re.escape(str(tmp_path))} is in use by another training \(host "
            rf"{re.escape(HOST)}, pid {os.getpid()}, since {re.escape(holder.since)}\): a "
            r"second one would write the same checkpoints\. Wait for it to end, or stop it")):
        ExperimentLock(tmp_path, linger_seconds=0).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second = ExperimentLock(tmp_path)
    second.acquire()  # free again
    second.release()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = _dead_pid()
    _write_record(tmp_path, pid=pid, started=1)
    lock = ExperimentLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert (f"{tmp_path / LOCK_NAME}: taking over the lock of a training that is gone (host "
            f"{HOST}, pid {pid}, since 2024-05-01T10:00:00+00:00; no process {pid} runs)"
            in caplog.text)
    assert Holder.parse((tmp_path / LOCK_NAME).read_text()).pid == os.getpid()
    lock.release()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, caplog):
    # Our own pid, recorded with another start time: the recorded process is gone and its
    # pid was given to a later one.
    _write_record(tmp_path, pid=os.getpid(), started=process_start(os.getpid()) - 1)
    lock = ExperimentLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"process {os.getpid()} is another one now, started later" in caplog.text
    lock.release()


def test_a_lock_of_a_running_process_without_the_kernel_lock_is_refused(tmp_path):
    # A record naming a live process of this host (the file re-created under it): refused.
    _write_record(tmp_path, pid=os.getppid(), started=process_start(os.getppid()))
    with pytest.raises(ExperimentLockedError, match=rf"pid {os.getppid()}, since "):
        ExperimentLock(tmp_path).acquire()


def test_a_lock_of_another_host_is_refused_saying_how_to_remove_it(tmp_path):
    _write_record(tmp_path, host="gpu-node-7", pid=4242)
    with pytest.raises(ExperimentLockedError, match=(
            rf"{re.escape(str(tmp_path))} is locked by a training on host gpu-node-7 \(pid "
            rf"4242, since 2024-05-01T10:00:00\+00:00\), which cannot be checked from "
            rf"{re.escape(HOST)}\. If that job is gone, remove "
            rf"{re.escape(str(tmp_path / LOCK_NAME))} and run again")):
        ExperimentLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "gpu-node-7"  # kept


def test_a_requeued_run_of_the_same_slurm_job_takes_its_lock_over(tmp_path, monkeypatch,
                                                                   caplog):
    _write_record(tmp_path, host="gpu-node-7", pid=4242, slurm_job="77")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    lock = ExperimentLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "an earlier run of this Slurm job 77, requeued" in caplog.text
    assert Holder.parse((tmp_path / LOCK_NAME).read_text()).slurm_job == "77"
    lock.release()


class _Rank:
    """A rank of a two-rank job, whose gather returns what rank 0 sent."""

    def __init__(self, rank: int, from_rank_0: object = None) -> None:
        self.rank, self.from_rank_0 = rank, from_rank_0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, value: object) -> list[object]:
        return [value if self.rank == 0 else self.from_rank_0, None]


def test_a_refused_rank_0_stops_every_rank_and_the_others_take_no_lock(tmp_path):
    _write_record(tmp_path, host="gpu-node-7", pid=4242)
    with pytest.raises(ExperimentLockedError, match="host gpu-node-7"), \
            experiment_lock(tmp_path, _Rank(0)):
        pass
    refusal = "ExperimentLockedError: exp/tiny is locked by a training on host gpu-node-7"
    with pytest.raises(ExperimentLockedError, match=rf"rank 0 could not lock "
                                                    rf"{re.escape(str(tmp_path))}: {refusal}"), \
            experiment_lock(tmp_path, _Rank(1, refusal)):
        pass
    (tmp_path / LOCK_NAME).unlink()
    with experiment_lock(tmp_path, _Rank(1)) as lock:  # rank 0 holds it, not this rank
        assert lock is None and not (tmp_path / LOCK_NAME).exists()


def test_training_takes_over_a_stale_lock_and_releases_it_at_its_end(tmp_path, monkeypatch,
                                                                     caplog):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    pid = _dead_pid()
    _write_record(experiment.exp_dir, pid=pid)
    with caplog.at_level(logging.WARNING):
        train(NAME, "cat.ctc.train")
    assert f"taking over the lock of a training that is gone (host {HOST}, pid {pid}" \
        in caplog.text
    assert CheckpointManager(experiment.exp_dir / "check").records[-1]["step"] == 10
    assert not (experiment.exp_dir / LOCK_NAME).exists()


def test_training_stopped_by_a_signal_exits_75_and_releases_the_lock(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1, "check_freq": 2})
    monkeypatch.chdir(tmp_path)
    holders = []  # who holds the lock at each update
    original = update.Updater.update

    def update_then_signal(self, batches, normalizer):
        holders.append(_holder_pid(experiment.exp_dir / LOCK_NAME))
        if len(holders) == 3:  # a preemption notice while update 3 runs
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batches, normalizer)

    monkeypatch.setattr(update.Updater, "update", update_then_signal)
    with pytest.raises(SystemExit) as stopped:
        run_verb("cat.ctc.train", [NAME])
    assert stopped.value.code == STOPPED_EXIT_STATUS
    assert set(holders) == {os.getpid()}
    stopped_at = CheckpointManager(experiment.exp_dir / "check").records[-1]
    assert 3 <= stopped_at["step"] < 10 and stopped_at["dev_loss"] is None
    assert not (experiment.exp_dir / LOCK_NAME).exists()
    run_verb("cat.ctc.train", [NAME, "--resume"])  # the lock is free: the run resumes to its end
    assert CheckpointManager(experiment.exp_dir / "check").records[-1]["step"] == 10
    assert not (experiment.exp_dir / LOCK_NAME).exists()


def _holder_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        holder = Holder.parse(path.read_text(encoding="utf-8"))
        return holder.pid if holder else None
    return None


def _steps(exp_dir: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        listed = json.loads((exp_dir / "check/checkpoints.json").read_text())
        return len(listed["checkpoints"]) and int(listed["checkpoints"][-1]["step"])
    return 0


@pytest.mark.slow
def test_a_second_training_is_refused_naming_the_first_which_trains_to_the_end(
        tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, num_train=80, options={
        "epochs": 2, "check_freq": 2, "keep_checkpoints": 30})
    monkeypatch.chdir(tmp_path)
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "cat.ctc.train", NAME], cwd=tmp_path,
                             env=environment, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    lock = experiment.exp_dir / LOCK_NAME
    try:
        # Started while the first runs: at once, after 1, 5 and 12 of its 20 checkpoints.
        for steps in (0, 2, 10, 24):
            deadline = time.monotonic() + 120
            while _holder_pid(lock) != first.pid or _steps(experiment.exp_dir) < steps:
                assert first.poll() is None, first.stderr.read()[-3000:]
                assert time.monotonic() < deadline, f"no checkpoint at step {steps} in time"
                time.sleep(0.01)
            with pytest.raises(ExperimentLockedError, match=(
                    rf"exp/tiny is in use by another training \(host {re.escape(HOST)}, pid "
                    rf"{first.pid}, since .*\): a second one would write the same "
                    r"checkpoints")):
                train(NAME, "cat.ctc.train", resume=True)
        assert first.wait(timeout=240) == 0, first.stderr.read()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.kill()
        first.stderr.close()
    records = CheckpointManager(experiment.exp_dir / "check").records
    assert [r["step"] for r in records] == list(range(2, 41, 2))  # one run's checkpoints
    assert not lock.exists()
