"""Job arrays through the local backend (the Slurm backend: tests/core/test_launch_slurm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cat
from cat.core import launch
from cat.core.launch import (
    ArrayJobError,
    Launcher,
    compress_tasks,
    map_calls,
    parse_tasks,
    run_array,
    task_status,
)
from cat.testing.processes import alive, as_from_a_terminal, process_identity, wait_until

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def test_task_lists_in_kaldi_and_slurm_forms():
    assert parse_tasks("JOB=1:4") == [1, 2, 3, 4]
    assert parse_tasks("JOB=2,5-7") == [2, 5, 6, 7]
    assert compress_tasks([7, 1, 2, 3, 9, 10]) == "1-3,7,9-10"
    assert compress_tasks([4]) == "4"
    for bad in ("1:4", "JOB=0:2", "JOB=1,1", "JOB=a", "JOB=3:1"):
        with pytest.raises(ValueError):
            parse_tasks(bad)


def test_cmd_strings_round_trip_and_reject_other_programs():
    assert Launcher.from_cmd("") is None
    launcher = Launcher.from_cmd("launch.sh --backend slurm --partition gpu --mem-per-job 4G "
                                 "--gpus-per-job 1 --sbatch-option=--account=asr")
    assert launcher == Launcher("slurm", "gpu", 1, "4G", 1, "", ("--account=asr",))
    assert Launcher.from_cmd(launcher.to_cmd()) == launcher
    assert launcher.sbatch_resources() == ["--cpus-per-task=1", "--partition=gpu", "--mem=4G",
                                           "--gres=gpu:1", "--account=asr"]
    with pytest.raises(ValueError, match=r"expected 'launch\.sh"):
        Launcher.from_cmd("run.pl --mem 4G")
    with pytest.raises(ValueError, match="not options"):
        Launcher.from_cmd("launch.sh --queue x")


def test_local_array_names_the_failed_task_and_its_log(tmp_path):
    log = tmp_path / "log" / "work.JOB.log"
    command = ["bash", "-c", "echo task JOB; exit $((JOB == 2 ? 3 : 0))"]
    with pytest.raises(ArrayJobError) as caught:
        run_array(Launcher(), "work", [1, 2, 3], command, log, parallel=2)
    assert caught.value.failures == {2: ("exited with status 3", tmp_path / "log/work.2.log")}
    assert "task 2 exited with status 3, see" in str(caught.value)
    for task, status in ((1, 0), (2, 3), (3, 0)):
        text = (tmp_path / f"log/work.{task}.log").read_text()
        assert f"task {task}\n" in text
        assert task_status(tmp_path / f"log/work.{task}.log") == status
    # The re-run of the failed task alone, fixed.
    run_array(Launcher(), "work", [2], ["bash", "-c", "echo again JOB"], log)
    assert "again 2" in (tmp_path / "log/work.2.log").read_text()
    assert task_status(tmp_path / "log/work.2.log") == 0


def test_local_array_runs_at_most_parallel_tasks_at_once(tmp_path):
    running, seen = tmp_path / "running", tmp_path / "seen"
    running.mkdir()
    seen.mkdir()
    # Each task records how many tasks were running when it started (itself included).
    command = ["bash", "-c", f"touch {running}/JOB; ls {running} | wc -l > {seen}/JOB; "
               f"sleep 0.3; rm {running}/JOB"]
    run_array(Launcher(), "busy", range(1, 7), command, tmp_path / "busy.JOB.log", parallel=2)
    counts = [int((seen / str(task)).read_text()) for task in range(1, 7)]
    assert max(counts) == 2, counts


def _square(value: int, offset: int) -> int:
    if value < 0:
        raise ValueError(f"negative value {value}")
    return value * value + offset


def test_map_calls_returns_results_in_order_and_cleans_its_pickles(tmp_path):
    results = map_calls(Launcher(), "square", _square, [(1, 0), (2, 10), (3, 100)],
                        tmp_path / "work", parallel=2)
    assert results == [1, 14, 109]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == \
        ["square.1.log", "square.2.log", "square.3.log"]


def test_map_calls_failure_names_the_task_and_its_traceback_is_in_the_log(tmp_path):
    with pytest.raises(ArrayJobError) as caught:
        map_calls(Launcher(), "square", _square, [(1, 0), (-2, 0)], tmp_path / "work")
    assert list(caught.value.failures) == [2]
    assert "ValueError: negative value -2" in (tmp_path / "work/square.2.log").read_text()


def test_the_command_line_is_kaldis_run_pl(tmp_path):
    command = [sys.executable, "-m", "cat.core.launch", "JOB=1:3", str(tmp_path / "x.JOB.log"),
               "bash", "-c", "echo hello JOB"]
    result = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert [(tmp_path / f"x.{t}.log").read_text().splitlines()[2] for t in (1, 2, 3)] == \
        ["hello 1", "hello 2", "hello 3"]
    failing = [*command[:5], "bash", "-c", "exit $((JOB - 1))"]
    result = subprocess.run(failing, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 1
    assert "2 of 3 task(s) failed" in result.stderr and "x.3.log" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_its_tasks(tmp_path, signum):
    command = [sys.executable, "-m", "cat.core.launch", "JOB=1:2", str(tmp_path / "x.JOB.log"),
               "bash", "-c", f"echo $$ > {tmp_path}/pid.JOB; exec sleep 60"]
    process = subprocess.Popen(command, env=ENVIRONMENT, stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_from_a_terminal)
    pids = [tmp_path / "pid.1", tmp_path / "pid.2"]
    assert wait_until(lambda: all(p.is_file() and p.read_text().strip() for p in pids), 30)
    children = [process_identity(int(p.read_text())) for p in pids]
    process.send_signal(signum)
    assert process.wait(timeout=20) == 130
    assert "the tasks were stopped" in process.stderr.read()
    process.stderr.close()
    assert wait_until(lambda: not alive(children), launch.TERMINATE_SECONDS + 3)


def test_sigkill_of_the_launcher_leaves_no_task(tmp_path):
    command = [sys.executable, "-m", "cat.core.launch", "JOB=1:1", str(tmp_path / "x.JOB.log"),
               "bash", "-c", f"echo $$ > {tmp_path}/pid.JOB; exec sleep 60"]
    process = subprocess.Popen(command, env=ENVIRONMENT)
    pid = tmp_path / "pid.1"
    assert wait_until(lambda: pid.is_file() and pid.read_text().strip(), 30)
    child = process_identity(int(pid.read_text()))
    started = time.monotonic()
    process.kill()
    process.wait(timeout=10)
    assert wait_until(lambda: not alive([child]), 5), "a task outlived kill -9 of its launcher"
    print(f"task gone {time.monotonic() - started:.2f} s after kill -9")


def test_why_a_slurm_job_was_stopped_is_read_from_its_state():
    """The fields `scontrol show job` showed (Slurm 22.05) as the processes of a job got
    their SIGTERM, in each case; the real cluster: tests/training/test_slurm_training.py."""
    running = {"JobState": "RUNNING", "Reason": "None", "Restarts": "0", "PreemptTime": "None"}
    cases = {
        # scancel, also scancel --signal=KILL: cancelled at once, SIGKILL after KillWait
        launch.CANCELLED: {**running, "JobState": "COMPLETING"},
        # preempted (PreemptMode=REQUEUE): the restart count is raised before the signal
        launch.REQUEUED: {**running, "JobState": "COMPLETING", "Restarts": "1"},
        # preempted (PreemptMode=CANCEL)
        launch.PREEMPTED: {**running, "JobState": "COMPLETING",
                           "PreemptTime": "2026-12-06T06:47:10"},
        launch.TIME_LIMIT: {**running, "JobState": "COMPLETING", "Reason": "TimeLimit"},
        # the time-limit warning (--signal=USR1@300), scancel --signal=TERM, GraceTime
        launch.SIGNALLED: running,
        launch.UNKNOWN: {},
    }
    for verdict, fields in cases.items():
        assert launch.stop_cause(fields, restart_count=0) == verdict, fields
    # a run after a requeue: its own restart count is the one to compare with
    assert launch.stop_cause({**running, "JobState": "COMPLETING", "Restarts": "2"},
                             restart_count=2) == launch.CANCELLED
    assert {launch.PREEMPTED, launch.TIME_LIMIT, launch.SIGNALLED} == launch.REQUEUE_ITSELF
