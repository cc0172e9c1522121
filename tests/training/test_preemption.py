"""Preemption drills on this machine: a signal mid-epoch to stage 3 (`cat.stages.driver
train`), which passes it on to the training; the training saves after the update in flight
and exits with status 75; stage 3 run again resumes: every utterance of the epoch trained
once, none retrained. (On Slurm: tests/training/test_slurm_training.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cat
from cat.testing.processes import alive, descendants, process_identity, wait_until
from cat.testing.training import epoch_coverage, write_tiny_experiment
from cat.training.checkpoint import CheckpointManager, load_checkpoint
from cat.training.preemption import STOPPED_EXIT_STATUS

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
NAME = "exp/tiny"
NUM_TRAIN = 400  # 100 updates of 4 utterances
TIMEOUT_SECONDS = 240

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _latest_step(exp_dir: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        listed = json.loads((exp_dir / "check/checkpoints.json").read_text())
        return int(listed["checkpoints"][-1]["step"])
    return 0


def _stage3(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cat.stages.driver", "train", NAME, *extra]


def _signal_mid_epoch(root: Path, command: list[str], signum: int, after_step: int
                      ) -> tuple[int, str]:
    """Run `command`, send `signum` to it once a checkpoint at `after_step` exists; its exit
    status and stderr. Every process it started must be gone within 3 s of its end."""
    process = subprocess.Popen(command, cwd=root, env=ENVIRONMENT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while _latest_step(root / NAME) < after_step:
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"no checkpoint at step {after_step} in time"
            time.sleep(0.01)
        family = [process_identity(pid) for pid in descendants(process.pid)]
        process.send_signal(signum)
        status = process.wait(timeout=120)
        stderr = process.stderr.read()
        assert wait_until(lambda: not alive([f for f in family if f]), 3), \
            "processes of the stopped training outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.stderr.close()
    return status, stderr


@pytest.mark.parametrize(("signum", "large_dataset", "workers"), [
    (signal.SIGTERM, True, 2), (signal.SIGUSR1, False, 1), (signal.SIGINT, True, 0)],
    ids=["TERM-stream-2-workers", "USR1-map-1-worker", "INT-stream-no-worker"])
def test_a_signal_to_stage_3_saves_and_the_rerun_trains_every_utterance_once(
        tmp_path, signum, large_dataset, workers):
    experiment = write_tiny_experiment(tmp_path, num_train=NUM_TRAIN, utts_per_shard=10,
                                       options={"epochs": 1, "batch_size": 4, "check_freq": 10,
                                                "keep_checkpoints": 3, "log_utterances": True,
                                                "workers": workers})
    if large_dataset:
        experiment.use_shards()
    command = _stage3(tmp_path)
    if signum == signal.SIGUSR1:  # Slurm's warning before a time limit goes to the ranks
        command = [sys.executable, "-m", "cat.ctc.train", NAME]
    status, stderr = _signal_mid_epoch(tmp_path, command, signum, after_step=10)
    assert status == STOPPED_EXIT_STATUS, stderr[-3000:]
    assert f"{signal.Signals(signum).name} received" in stderr
    checkpoints = CheckpointManager(experiment.exp_dir / "check")
    stopped_at = checkpoints.records[-1]
    assert stopped_at["dev_loss"] is None  # saved at once, without the dev pass
    assert 10 <= stopped_at["step"] < NUM_TRAIN // 4
    state = load_checkpoint(checkpoints.latest())
    assert state["data"]["ranks"] is not None  # the position within the epoch
    assert not (experiment.exp_dir / "check.done").exists()  # stage 3 not finished

    result = subprocess.run(_stage3(tmp_path), cwd=tmp_path, env=ENVIRONMENT,
                            capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming the interrupted training" in result.stderr
    coverage = epoch_coverage(experiment.exp_dir, experiment.train.keys)
    print(f"{signal.Signals(signum).name}: stopped after update {stopped_at['step']}; "
          f"{coverage}")
    assert coverage.trained == NUM_TRAIN
    assert coverage.missing == [] and coverage.duplicated == [] and coverage.retrained == 0
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == NUM_TRAIN and summary["steps"] == NUM_TRAIN // 4


def test_stage_3_stopped_by_a_signal_is_not_done_and_says_how_to_resume(tmp_path):
    write_tiny_experiment(tmp_path, num_train=NUM_TRAIN,
                          options={"epochs": 1, "check_freq": 10, "log_utterances": True})
    status, stderr = _signal_mid_epoch(tmp_path, _stage3(tmp_path), signal.SIGTERM,
                                       after_step=10)
    assert status == STOPPED_EXIT_STATUS
    assert "stopped on SIGTERM after saving a checkpoint" in stderr
    assert "run stage 3 again to resume it" in stderr
