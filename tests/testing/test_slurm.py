"""The Slurm test cluster: it starts, runs array jobs with a log per task, srun steps and
requeued jobs, and leaves no daemon or job process behind when stopped."""

from __future__ import annotations

import os
import subprocess

import pytest

from cat.testing.processes import process_identity, wait_until
from cat.testing.slurm import (
    DAEMONS,
    URGENT_PARTITION,
    job_states,
    sbatch,
    slurm_cluster,
    slurm_unavailable,
    wait_for_job,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(slurm_unavailable() is not None,
                                 reason=str(slurm_unavailable()))]

BOUND_SECONDS = 60


def _script(path, body: str):
    path.write_text("#!/bin/bash\nset -eu\n" + body)
    return path


def test_cluster_starts_idle_and_stop_leaves_no_process(tmp_path):
    job = _script(tmp_path / "job.sh", f"echo $$ > {tmp_path}/job.pid\nsleep 300\n")
    with slurm_cluster(tmp_path / "slurm") as cluster:
        assert cluster.conf.is_file()
        assert cluster.env["SLURM_CONF"] == str(cluster.conf)
        assert set(cluster.pids) == set(DAEMONS)
        # The default partition, and the one whose jobs preempt its jobs (requeued).
        assert cluster.run(["sinfo", "-h", "-o", "%P %T %c"]).splitlines() == [
            f"{cluster.partition}* idle {cluster.cpus}",
            f"{URGENT_PARTITION} idle {cluster.cpus}"]
        job_id = sbatch(["-o", str(tmp_path / "job.log"), str(job)], cluster.env)
        assert wait_until(lambda: (tmp_path / "job.pid").is_file()
                          and (tmp_path / "job.pid").read_text().strip() != "",
                          BOUND_SECONDS), f"job {job_id} did not start"
        job_pid = int((tmp_path / "job.pid").read_text())
        assert job_states(job_id, cluster.env)[job_id]["JobState"] == "RUNNING"
        pids = [*cluster.pids.values(), job_pid]
    assert wait_until(lambda: all(process_identity(pid) is None for pid in pids),
                      BOUND_SECONDS), [pid for pid in pids if process_identity(pid)]
    assert not cluster.run_dir.exists()


def test_array_job_runs_every_task_with_its_log(slurm_cluster, tmp_path):
    job = _script(tmp_path / "job.sh",
                  'echo "task $SLURM_ARRAY_TASK_ID"\n[ "$SLURM_ARRAY_TASK_ID" != 2 ] || exit 3\n')
    # No env given: the session fixture's SLURM_CONF leads sbatch to the cluster.
    job_id = sbatch(["--array=1,2,3", "-o", str(tmp_path / "task.%a.log"),
                     "--cpus-per-task=1", "--mem=100M", str(job)])
    states = wait_for_job(job_id, BOUND_SECONDS)
    assert {task: (fields["JobState"], fields["ExitCode"]) for task, fields in states.items()} \
        == {"1": ("COMPLETED", "0:0"), "2": ("FAILED", "3:0"), "3": ("COMPLETED", "0:0")}
    for task in ("1", "2", "3"):
        assert (tmp_path / f"task.{task}.log").read_text() == f"task {task}\n"


def test_srun_inside_a_job_starts_one_process_per_task(slurm_cluster, tmp_path):
    job = _script(tmp_path / "job.sh", "srun --ntasks=2 bash -c 'echo rank $SLURM_PROCID'\n")
    # --overcommit: two tasks also on a one-CPU machine.
    job_id = sbatch(["--ntasks=2", "--overcommit", "-o", str(tmp_path / "job.log"), str(job)],
                    slurm_cluster.env)
    states = wait_for_job(job_id, BOUND_SECONDS, slurm_cluster.env)
    assert states[job_id]["JobState"] == "COMPLETED"
    assert sorted((tmp_path / "job.log").read_text().splitlines()) == ["rank 0", "rank 1"]


def test_a_requeued_job_is_released_and_runs_again(slurm_cluster, tmp_path):
    job = _script(tmp_path / "job.sh",
                  'echo "run ${SLURM_RESTART_COUNT:-0}"\n'
                  'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
                  '  scontrol requeue "$SLURM_JOB_ID"\n  sleep 300\nfi\n')
    job_id = sbatch(["--open-mode=append", "-o", str(tmp_path / "job.log"), str(job)],
                    slurm_cluster.env)
    states = wait_for_job(job_id, BOUND_SECONDS, slurm_cluster.env)
    log = (tmp_path / "job.log").read_text()
    assert (states[job_id]["JobState"], states[job_id]["Restarts"]) == ("COMPLETED", "1"), \
        (states, log)
    # slurmstepd adds a line saying that the first run was cancelled for the requeue.
    runs = [line for line in log.splitlines() if line.startswith("run ")]
    assert runs == ["run 0", "run 1"]


def test_the_session_cluster_is_what_slurm_conf_names(slurm_cluster):
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf)
    output = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            timeout=BOUND_SECONDS, check=True).stdout
    assert "ClusterName             = cattest" in output
