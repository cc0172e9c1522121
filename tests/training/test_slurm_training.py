"""Stage 3 as a Slurm job on the test cluster (`slurm_cluster`, a real one-node Slurm):
two gloo ranks started by srun, each utterance of the epoch trained once; preemption drills
(`scancel --signal=TERM` / `--signal=USR1` mid-epoch, and a job of a higher partition that
Slurm preempts the training for and requeues it): the ranks save, the job is requeued,
resumes, and the epoch still trains every utterance once, none twice; a user's `scancel`
(plain or `--signal=KILL`) ends the job for good on the first try, and stage 3 run again
resumes it exactly."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cat
from cat.testing.slurm import (
    URGENT_PARTITION,
    job_states,
    release,
    run_client,
    sbatch,
    wait_for_job,
)
from cat.testing.training import epoch_coverage, write_tiny_experiment
from cat.training.checkpoint import CheckpointManager
from cat.training.jobs import SLURM_LOG
from cat.training.preemption import STOPPED_EXIT_STATUS

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
NAME = "exp/tiny"
SLURM_CMD = "launch.sh --backend slurm --poll-seconds 0.2"
TIMEOUT_SECONDS = 400
HOLD_SECONDS = 5

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


def _stage3(root: Path, nproc: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "cat.stages.driver", "train", NAME, "--nproc", str(nproc),
               "--cmd", SLURM_CMD]
    return subprocess.Popen(command, cwd=root, env=_environment(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, root: Path) -> str:
    try:
        stderr = process.communicate(timeout=TIMEOUT_SECONDS)[1]
    finally:
        process.kill()
    log = root / NAME / SLURM_LOG
    assert process.returncode == 0, stderr[-3000:] + (log.read_text()[-3000:]
                                                      if log.is_file() else "")
    return log.read_text()


def _latest_step(exp_dir: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        listed = json.loads((exp_dir / "check/checkpoints.json").read_text())
        return int(listed["checkpoints"][-1]["step"])
    return 0


def _training_job() -> str:
    jobs = run_client(["squeue", "--noheader", "--name=train", "--format=%i"]).split()
    assert len(jobs) == 1, jobs
    return jobs[0]


def _experiment(root: Path, num_train: int, large_dataset: bool):
    experiment = write_tiny_experiment(root, num_train=num_train, utts_per_shard=10, options={
        "epochs": 1, "batch_size": 4, "check_freq": 10, "keep_checkpoints": 3,
        "log_utterances": True, "workers": 1})
    if large_dataset:
        experiment.use_shards()
    return experiment


def test_two_ranks_as_a_slurm_job_train_every_utterance_once(tmp_path, slurm_cluster):
    experiment = _experiment(tmp_path, 160, large_dataset=False)
    started = time.monotonic()
    log = _finish(_stage3(tmp_path, nproc=2), tmp_path)
    coverage = epoch_coverage(experiment.exp_dir, experiment.train.keys)
    print(f"2 gloo ranks on Slurm: {time.monotonic() - started:.1f} s; {coverage}")
    assert len(list((experiment.exp_dir / "log/utts").glob("epoch-001.rank-*.txt"))) == 2
    assert coverage.trained == 160 and not coverage.missing and not coverage.duplicated
    assert "run 1 of job" in log and log.rstrip().endswith("# ended with status 0")
    resolved = json.loads((experiment.exp_dir / "resolved.json").read_text())
    assert resolved["world_size"] == 2
    assert (experiment.exp_dir / "check.done").is_file()  # stage 3 finished


def _wait_for_step(process: subprocess.Popen, exp_dir: Path, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while _latest_step(exp_dir) < step:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint at step {step} in time"
        time.sleep(0.02)


def _wait_for_requeue(process: subprocess.Popen, job: str) -> None:
    """Until Slurm holds the requeued job (its 120 s wait; the test shortens it)."""
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while True:
        fields = next(iter(job_states(job).values()), {})
        if fields.get("Restarts", "0") != "0" and fields.get("JobState") == "PENDING" \
                and fields.get("Reason") == "BeginTime":
            return
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"job {job} was not requeued in time: {fields}"
        time.sleep(0.1)


def _assert_saved_when_stopped(record: dict) -> None:
    """The ranks saved when they were stopped (a checkpoint without a dev loss), or the stop
    came before the first update after a periodic checkpoint (check_freq 10, with its dev
    loss), which already holds that step. Whether no update was lost is `_assert_exact`'s."""
    assert record["dev_loss"] is None or record["step"] % 10 == 0, record


def _assert_exact(experiment, num_train: int, what: str) -> None:
    coverage = epoch_coverage(experiment.exp_dir, experiment.train.keys)
    print(f"{what}; {coverage}")
    assert coverage.trained == num_train
    assert coverage.missing == [] and coverage.duplicated == [] and coverage.retrained == 0
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == num_train


@pytest.mark.parametrize("how", ["scancel", "scancel --signal=KILL"])
def test_a_cancelled_slurm_job_ends_for_good_and_stage_3_again_resumes_it(
        tmp_path, slurm_cluster, how):
    num_train = 400
    experiment = _experiment(tmp_path, num_train, large_dataset=True)
    process = _stage3(tmp_path, nproc=2)
    _wait_for_step(process, experiment.exp_dir, 10)
    job = _training_job()
    run_client([*how.split(), job])
    try:
        stderr = process.communicate(timeout=TIMEOUT_SECONDS)[1]
    finally:
        process.kill()
    log = (experiment.exp_dir / SLURM_LOG).read_text()
    fields = next(iter(job_states(job).values()))
    stopped_at = CheckpointManager(experiment.exp_dir / "check").records[-1]
    print(f"{how}: job {job} {fields['JobState']}, restarts {fields['Restarts']}; stage 3 "
          f"exit status {process.returncode}; the last checkpoint: update "
          f"{stopped_at['step']}")
    # The first scancel ends the job: cancelled, never requeued, nothing left in the queue.
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0"
    assert "run 2 of job" not in log
    assert "the job was cancelled (scancel): not requeued" in log
    assert not run_client(["squeue", "--noheader", "--format=%i"]).split()
    # Stage 3 ends, saying how to resume; the lock is released.
    assert process.returncode == STOPPED_EXIT_STATUS, stderr[-3000:]
    assert f"its Slurm job {job} was cancelled (scancel), not requeued" in stderr
    assert "run stage 3 again to resume it: bash run.sh --stage 3 --exp exp/tiny" in stderr
    assert not (experiment.exp_dir / "train.lock").exists()
    _assert_saved_when_stopped(stopped_at)

    _finish(_stage3(tmp_path, nproc=2), tmp_path)
    _assert_exact(experiment, num_train, f"{how}, then stage 3 again")


def test_a_job_preempted_and_requeued_by_slurm_resumes_exactly(tmp_path, slurm_cluster):
    num_train = 400
    experiment = _experiment(tmp_path, num_train, large_dataset=True)
    process = _stage3(tmp_path, nproc=2)
    _wait_for_step(process, experiment.exp_dir, 10)
    job = _training_job()
    # A job of the higher partition that needs every CPU: Slurm preempts the training job,
    # requeues it, and runs the urgent job.
    urgent = sbatch([f"--partition={URGENT_PARTITION}", f"--cpus-per-task={slurm_cluster.cpus}",
                     "--output=/dev/null", "--wrap=sleep 1"])
    _wait_for_requeue(process, job)
    stopped_at = CheckpointManager(experiment.exp_dir / "check").records[-1]
    assert wait_for_job(urgent, TIMEOUT_SECONDS)[urgent]["JobState"] == "COMPLETED"
    time.sleep(HOLD_SECONDS)
    release(job)
    log = _finish(process, tmp_path)
    assert 10 <= stopped_at["step"] < num_train // 4 // 2
    _assert_saved_when_stopped(stopped_at)
    assert "the ranks saved and stopped; Slurm requeues the job itself (preempted)" in log
    assert "run 2 of job" in log
    _assert_exact(experiment, num_train, f"preempted after update {stopped_at['step']}, "
                                         "requeued by Slurm, resumed")


@pytest.mark.parametrize("signal_name", ["TERM", "USR1"])
def test_a_preempted_slurm_job_requeues_itself_and_resumes_exactly(tmp_path, slurm_cluster,
                                                                  signal_name):
    num_train = 400
    experiment = _experiment(tmp_path, num_train, large_dataset=True)
    process = _stage3(tmp_path, nproc=2)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while _latest_step(experiment.exp_dir) < 10:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint at step 10 in time"
        time.sleep(0.02)
    job = _training_job()
    run_client(["scancel", f"--signal={signal_name}", job])
    # The ranks save and the job requeues itself; it would start again after Slurm's
    # 120 s hold on requeued jobs, which the test shortens to HOLD_SECONDS (a job started
    # the instant it is requeued finds its previous run's credential still revoked).
    while True:
        fields = next(iter(job_states(job).values()), {})
        if fields.get("Restarts", "0") != "0" and fields.get("JobState") == "PENDING" \
                and fields.get("Reason") == "BeginTime":
            break
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"job {job} was not requeued in time: {fields}"
        time.sleep(0.1)
    stopped_at = CheckpointManager(experiment.exp_dir / "check").records[-1]
    time.sleep(HOLD_SECONDS)
    release(job)
    log = _finish(process, tmp_path)

    coverage = epoch_coverage(experiment.exp_dir, experiment.train.keys)
    print(f"SIG{signal_name}: saved after update {stopped_at['step']}, requeued, resumed; "
          f"{coverage}")
    assert 10 <= stopped_at["step"] < num_train // 4 // 2
    _assert_saved_when_stopped(stopped_at)
    assert "the ranks saved and stopped (signalled): requeued" in log and "run 2 of job" in log
    assert coverage.trained == num_train
    assert coverage.missing == [] and coverage.duplicated == [] and coverage.retrained == 0
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == num_train
