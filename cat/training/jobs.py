"""Starting a training run: ranks on this machine, or a Slurm job over nodes.

Stage 3 (`cat.stages.driver train`) runs `train.bin` (`python -m cat.ctc.train EXP`) in
one of two ways; the ranks run the same code either way (`cat.training.cli`), joining the
process group from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (nccl on
GPUs, gloo on CPUs):

* here (`run_here`): one process, or torchrun with `nproc` ranks. This process forwards
  SIGINT and SIGTERM to it (the ranks then save and stop, `cat.training.preemption`),
  and the ranks end with it if it is killed;
* on Slurm (`run_on_slurm`): one batch job of `nnodes` nodes and `ranks_per_node` tasks
  each (a rank per GPU, or CPU ranks), started by `srun` one rank per task, the
  rendezvous at the first node of the allocation on a port free there (`job_script`).
  The job is submitted with `--requeue` and `--signal=USR1@<warn_seconds>`: Slurm warns
  the ranks that long before the time limit; a preempted or cancelled job's ranks get
  SIGTERM. Either way they save and exit with status 75, and the job script asks Slurm
  why (`cat.core.launch.stop_cause`): a user's `scancel` (also `--signal=KILL`) ends the
  job for good; Slurm's own requeue of a preempted job needs nothing more; a warning, a
  signal sent with `scancel --signal`, a preemption that cancels or the time limit make
  the job requeue itself (`scontrol requeue`). The next run resumes from the checkpoint
  (`--resume`), so the epoch trains each utterance once. The job's log
  (`exp/<name>/log/train.slurm.log`, appended by every run) ends with `# ended with status
  N`. This process waits until the job has left the queue for good; SIGINT or SIGTERM
  cancels it (for good: stage 3 run again resumes it), and it waits for the ranks to save.

Usage:
    status = run_here(train_command("cat.ctc.train", "exp/ctc-v1", nproc=2, resume=False))
    end = run_on_slurm(launcher, "cat.ctc.train", "exp/ctc-v1", nnodes=2, ranks_per_node=4,
                       gpus_per_node=4)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from cat.core.launch import (
    CANCELLED,
    ENDED,
    REQUEUE_ITSELF,
    REQUEUED,
    JobEnd,
    Launcher,
    submit_job,
)
from cat.core.process import parent_death_preexec
from cat.training.preemption import STOPPED_EXIT_STATUS

logger = logging.getLogger(__name__)

#: Seconds before its time limit that Slurm sends SIGUSR1 to a training job's ranks.
WARN_SECONDS = 300
SLURM_LOG = "log/train.slurm.log"


def train_command(train_bin: str, exp_dir: str, nproc: int = 1, resume: bool = False
                  ) -> list[str]:
    """The command of `nproc` ranks here (torchrun when more than one)."""
    command = [sys.executable, "-m", train_bin, exp_dir]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", train_bin, exp_dir]
    return command + (["--resume"] if resume else [])


@contextlib.contextmanager
def _forwarding(process: subprocess.Popen) -> Iterator[list[str]]:
    """Pass SIGINT and SIGTERM on to `process` while the block runs; yields the names of
    the signals forwarded."""
    forwarded: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield forwarded
        return

    def forward(signum: int, frame: object) -> None:
        del frame
        forwarded.append(signal.Signals(signum).name)
        logger.warning("%s received: passed on to the training processes, which save and "
                       "stop", signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield forwarded
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_here(command: Sequence[str]) -> tuple[int, list[str]]:
    """Run the training command as a child that ends with this process; returns its exit
    status and the signals passed on to it."""
    logger.info("running %s", shlex.join(command))
    # Its own session: a terminal's Ctrl-C reaches it once, from here, not twice.
    process = subprocess.Popen(list(command), start_new_session=True,
                               preexec_fn=parent_death_preexec())
    with _forwarding(process) as forwarded:
        while True:
            try:
                status = process.wait()
                break
            except KeyboardInterrupt:  # raised by a handler installed before ours
                continue
    return status, forwarded


def resume_command(exp_dir: str) -> str:
    """How a user resumes a stopped training of `exp_dir` (stage 3 of the recipe, run in
    its directory)."""
    return (f"bash run.sh --stage 3 --exp {shlex.quote(exp_dir)} (or python -m "
            f"cat.stages.driver train {shlex.quote(exp_dir)} with its options)")


def job_script(train_bin: str, exp_dir: str, cwd: Path) -> str:
    """The batch script of a training job (see the module doc)."""
    python = shlex.quote(sys.executable)
    check = shlex.quote(f"{exp_dir}/check/checkpoints.json")
    resume = resume_command(exp_dir).replace('"', '\\"')
    rank = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
            'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec "$@"')
    return "\n".join([
        "#!/bin/bash",
        "# Stage 3 as a Slurm job, written by cat.training.jobs: one rank per task.",
        f"cd {shlex.quote(str(cwd))} || exit 1",
        "# The ranks act on these signals; the batch shell waits for them to save.",
        "trap 'echo \"# $(date \"+%F %T\") the batch shell got a signal\"' TERM USR1",
        "echo \"# $(date '+%F %T') run $((${SLURM_RESTART_COUNT:-0} + 1)) of job "
        "$SLURM_JOB_ID on $SLURM_JOB_NODELIST\"",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT=$({python} -m cat.core.launch free-port)",
        "export MASTER_ADDR MASTER_PORT",
        "resume=()",
        f"if [ -f {check} ]; then resume=(--resume); fi",
        f"srun --export=ALL bash -c {shlex.quote(rank)} rank {python} -m {train_bin} "
        f"{shlex.quote(exp_dir)} \"${{resume[@]}}\"",
        "status=$?",
        f"if [ $status -eq {STOPPED_EXIT_STATUS} ]; then",
        "  # Why the ranks were stopped decides whether this job goes on (see",
        "  # cat.core.launch.stop_cause): a user's scancel ends it for good.",
        f'  cause=$({python} -m cat.core.launch stop-cause "$SLURM_JOB_ID" '
        '"${SLURM_RESTART_COUNT:-0}") || cause=unknown',
        '  case $cause in',
        f"    {CANCELLED})",
        "      echo \"# $(date '+%F %T') the job was cancelled (scancel): not requeued; the "
        f"ranks saved a checkpoint, run stage 3 again to resume: {resume}\"",
        "      ;;",
        f"    {REQUEUED})",
        "      echo \"# $(date '+%F %T') the ranks saved and stopped; Slurm requeues the job "
        "itself (preempted)\"",
        "      trap - TERM USR1",
        "      sleep 600 & wait",
        "      exit 0",
        "      ;;",
        f"    {' | '.join(sorted(REQUEUE_ITSELF))})",
        "      echo \"# $(date '+%F %T') the ranks saved and stopped ($cause): requeued\"",
        '      if scontrol requeue "$SLURM_JOB_ID"; then',
        "        # The requeue ends this run; finishing it first would race with the requeue.",
        "        trap - TERM USR1",
        "        sleep 600 & wait",
        "        exit 0",
        "      fi",
        f'      echo "# scontrol requeue failed: run stage 3 again to resume: {resume}"',
        "      ;;",
        "    *)",
        "      echo \"# $(date '+%F %T') the ranks saved and stopped, Slurm cannot say why "
        f"($cause): not requeued; run stage 3 again to resume: {resume}\"",
        "      ;;",
        "  esac",
        "fi",
        f'echo "{ENDED}$status"',
        "exit $status",
        "",
    ])


def run_on_slurm(launcher: Launcher, train_bin: str, exp_dir: str, nnodes: int,
                 ranks_per_node: int, gpus_per_node: int, cwd: Path | None = None,
                 warn_seconds: int = WARN_SECONDS) -> JobEnd:
    """Train as one Slurm job (see the module doc); returns how it ended: the status its
    log ends with (None: without one, e.g. killed at its time limit) and its Slurm state
    (CANCELLED after a user's scancel)."""
    work = (cwd or Path.cwd()).resolve()
    log = Path(exp_dir) / SLURM_LOG
    resources = dataclasses.replace(launcher, gpus_per_job=gpus_per_node)
    options = [f"--nodes={nnodes}", f"--ntasks-per-node={ranks_per_node}", "--requeue",
               "--open-mode=append", f"--signal=USR1@{warn_seconds}"]
    logger.info("training %s as a Slurm job: %d node(s) x %d rank(s)%s", exp_dir, nnodes,
                ranks_per_node, f", {gpus_per_node} GPU(s) per node" if gpus_per_node else "")
    return submit_job(resources, "train", job_script(train_bin, exp_dir, work), log, options,
                      work)
