"""Job arrays through a backend: processes on this machine, or Slurm array jobs.

Kaldi's `run.pl` / `slurm.pl` and ESPnet's `cmd.sh` in one module. A recipe's
`cmd.sh` picks the backend (`cmd_backend`: `local` or `slurm`) and the resources of every
job (partition, CPUs, memory, GPUs, time); `utils/asr.sh` turns them into `$train_cmd` /
`$decode_cmd`, command prefixes in Kaldi's form that the stage commands take as `--cmd`:

    $decode_cmd JOB=1:4 exp/x/log/decode.JOB.log python my_script.py --part JOB
    python -m cat.features.extract --nj 4 --cmd "$decode_cmd" data/train data/fbank/train

A stage given no `--cmd` runs its jobs in its own process pool, as it always has; given
one (any backend), it runs them as the tasks of an array, each a command that can be run
again by hand. `run_array` runs one command per task, with `JOB` in any argument replaced
by the task number and the task's stdout and stderr in its log (`JOB` in the log's name
too); every log ends with `# ended with status N`. A failed task stops the array with an
`ArrayJobError` naming each failed task, its exit status or Slurm state, and its log. The
caller passes only the tasks that are not done, so a re-run resubmits only what failed or
never ran.

* `local`: the tasks run here, at most `parallel` at a time, as children that end with
  this process (`cat.core.process.parent_death_preexec`); SIGINT or SIGTERM stops them.
* `slurm`: one `sbatch --array` job (the task list as given, e.g. `2,5-7`), a batch
  script written next to the logs, the state polled with `squeue` every `poll_seconds`
  (no accounting database is needed), `scontrol show job` consulted for tasks that ended
  without writing their status (time limit, memory, node failure, cancelled); SIGINT or
  SIGTERM cancels the job (`scancel`) and waits for it to end. The jobs inherit this
  process's environment (sbatch's default `--export=ALL`), so the nodes see the same
  virtual environment and paths, which must be on a shared file system as they are on
  every Kaldi cluster.

We call Slurm's own commands rather than a library: submitit, the well-kept one, runs
pickled Python callables with logs named by job ids in a folder of its own and follows
job states through `sacct`, which needs the accounting database; Kaldi users expect
command lines they can re-run by hand and logs named after the stage, and `sbatch`,
`squeue`, `scontrol` and `scancel` are there on every Slurm cluster.

`map_calls` runs Python calls (picklable function and arguments) as the tasks of an
array and returns their results; `python -m cat.core.launch call DIR JOB` is the task.
`submit_job` runs one batch script (the multi-node training job of stage 3);
`stop_cause` tells, from the job's state as its processes get their SIGTERM, a user's
`scancel` (the job ends for good) from a preemption, a time limit or a warning (it goes
on), as `python -m cat.core.launch stop-cause JOB_ID RESTART_COUNT` for job scripts.

Usage:
    python -m cat.core.launch --backend local JOB=1:2 log/echo.JOB.log echo task JOB
    python -m cat.core.launch --backend slurm --partition cpu --mem-per-job 4G \\
        JOB=1:4 log/x.JOB.log python -m my.module --part JOB
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cat.core.io import PathLike, atomic_write
from cat.core.process import parent_death_preexec

logger = logging.getLogger(__name__)

BACKENDS = ("local", "slurm")
#: The program name of `$train_cmd` / `$decode_cmd` (utils/launch.sh runs this module).
PROGRAM = "launch.sh"
#: The placeholder of the task number in commands and log names (Kaldi's).
JOB = "JOB"
#: The last line of every task's log.
ENDED = "# ended with status "
#: Seconds a stopped local task gets between SIGTERM and SIGKILL.
TERMINATE_SECONDS = 3.0


class ArrayJobError(RuntimeError):
    """Tasks of an array failed; `failures` maps each to (what happened, its log)."""

    def __init__(self, name: str, failures: dict[int, tuple[str, Path]], total: int) -> None:
        self.name = name
        self.failures = failures
        listed = "; ".join(f"task {task} {what}, see {log}"
                           for task, (what, log) in sorted(failures.items()))
        super().__init__(f"{name}: {len(failures)} of {total} task(s) failed: {listed}")


class LaunchError(RuntimeError):
    """The backend could not run the array (sbatch refused it, Slurm is not reachable)."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while tasks ran; they were stopped."""


# ----------------------------------------------------------------------------- the backend


@dataclasses.dataclass(frozen=True)
class Launcher:
    """Where and with what resources the tasks of an array run."""

    backend: str = "local"
    partition: str = ""
    cpus_per_job: int = 1
    mem_per_job: str = ""
    gpus_per_job: int = 0
    time_per_job: str = ""
    #: further sbatch options, each one word (`--account=asr`)
    sbatch_options: tuple[str, ...] = ()
    poll_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        if self.cpus_per_job < 1 or self.gpus_per_job < 0 or self.poll_seconds <= 0:
            raise ValueError(f"bad resources: {self}")

    @property
    def is_local(self) -> bool:
        """True for the `local` backend."""
        return self.backend == "local"

    @classmethod
    def from_cmd(cls, cmd: str | None) -> Launcher | None:
        """The launcher of a `--cmd` string (`launch.sh --backend slurm ...`); None for an
        empty or missing one (the stage then runs its jobs in its own process pool)."""
        words = shlex.split(cmd or "")
        if not words:
            return None
        if Path(words[0]).name != PROGRAM:
            raise ValueError(f"--cmd {cmd!r}: expected '{PROGRAM} [options]' (the $train_cmd "
                             f"or $decode_cmd of the recipe's cmd.sh)")
        parser = argparse.ArgumentParser(prog=PROGRAM, add_help=False)
        add_arguments(parser)
        try:
            args = parser.parse_args(words[1:])
        except SystemExit:
            raise ValueError(f"--cmd {cmd!r}: not options of {PROGRAM} (see python -m "
                             "cat.core.launch --help)") from None
        return from_args(args)

    def to_cmd(self) -> str:
        """The `--cmd` string of this launcher (inverse of `from_cmd`)."""
        words = [PROGRAM, "--backend", self.backend, "--cpus-per-job", str(self.cpus_per_job),
                 "--gpus-per-job", str(self.gpus_per_job)]
        for option, value in (("--partition", self.partition), ("--mem-per-job", self.mem_per_job),
                              ("--time-per-job", self.time_per_job)):
            if value:
                words += [option, value]
        words += [f"--sbatch-option={option}" for option in self.sbatch_options]
        if self.poll_seconds != 1.0:
            words += ["--poll-seconds", str(self.poll_seconds)]
        return shlex.join(words)

    def sbatch_resources(self) -> list[str]:
        """The sbatch options of one job's resources."""
        options = [f"--cpus-per-task={self.cpus_per_job}"]
        if self.partition:
            options.append(f"--partition={self.partition}")
        if self.mem_per_job:
            options.append(f"--mem={self.mem_per_job}")
        if self.time_per_job:
            options.append(f"--time={self.time_per_job}")
        if self.gpus_per_job:
            options.append(f"--gres=gpu:{self.gpus_per_job}")
        return options + list(self.sbatch_options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options (the words of `$train_cmd` after `launch.sh`)."""
    parser.add_argument("--backend", choices=BACKENDS, default="local",
                        help="local: processes here; slurm: Slurm array jobs (default local)")
    parser.add_argument("--partition", default="", help="Slurm partition (default: the cluster's)")
    parser.add_argument("--cpus-per-job", type=int, default=1, help="CPUs of each task")
    parser.add_argument("--mem-per-job", default="", help="memory of each task (sbatch --mem)")
    parser.add_argument("--gpus-per-job", type=int, default=0, help="GPUs of each task")
    parser.add_argument("--time-per-job", default="", help="time limit of each task (--time)")
    parser.add_argument("--sbatch-option", action="append", default=[], dest="sbatch_options",
                        metavar="OPTION", help="a further sbatch option (repeatable), e.g. "
                                               "--sbatch-option=--account=asr")
    parser.add_argument("--poll-seconds", type=float, default=1.0,
                        help="seconds between two looks at the Slurm queue")


def from_args(args: argparse.Namespace) -> Launcher:
    """The launcher of parsed `add_arguments` options."""
    return Launcher(args.backend, args.partition, args.cpus_per_job, args.mem_per_job,
                    args.gpus_per_job, args.time_per_job, tuple(args.sbatch_options),
                    args.poll_seconds)


def add_cmd_argument(parser: argparse.ArgumentParser) -> None:
    """`--cmd`, as the stage commands take it (Kaldi's `--cmd "$train_cmd"`)."""
    parser.add_argument("--cmd", default="", metavar='"launch.sh OPTIONS"',
                        help="run the jobs as array tasks through this launcher: $train_cmd "
                             "or $decode_cmd of the recipe's cmd.sh (default: a process pool "
                             "on this machine)")


# ----------------------------------------------------------------------------- task lists


def parse_tasks(spec: str) -> list[int]:
    """Task numbers of `JOB=1:4` (Kaldi), `JOB=2,5,7` or `JOB=1-3,7` (Slurm's lists)."""
    match = re.fullmatch(rf"{JOB}=([0-9:,\-]+)", spec)
    if not match:
        raise ValueError(f"{spec!r}: expected {JOB}=FIRST:LAST or {JOB}=N,M,... ")
    tasks: list[int] = []
    for part in match.group(1).split(","):
        first, sep, last = part.replace(":", "-").partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{spec!r}: {part!r} is not a task number or range")
        tasks += range(int(first), int(last if sep else first) + 1)
    if not tasks or min(tasks) < 1 or len(set(tasks)) != len(tasks):
        raise ValueError(f"{spec!r}: tasks must be distinct numbers from 1")
    return tasks


def compress_tasks(tasks: Sequence[int]) -> str:
    """Slurm's array list of `tasks`: `[1, 2, 3, 7]` -> `1-3,7`."""
    runs: list[list[int]] = []
    for task in sorted(tasks):
        if runs and task == runs[-1][1] + 1:
            runs[-1][1] = task
        else:
            runs.append([task, task])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _for_task(text: str, task: int) -> str:
    return text.replace(JOB, str(task))


def _shell_word(argument: str) -> str:
    """`argument` quoted for bash, `JOB` in it replaced by the task number variable."""
    return '"$JOB"'.join(shlex.quote(piece) if piece else "" for piece in argument.split(JOB)) \
        or "''"


# ----------------------------------------------------------------------------- run_array


def run_array(launcher: Launcher, name: str, tasks: Sequence[int], command: Sequence[str],
              log: PathLike, parallel: int = 1, cwd: PathLike | None = None) -> None:
    """Run `command` once per task (see the module doc); returns when all succeeded.

    `parallel`: local tasks at once (Slurm runs as many as the cluster allows).
    Raises `ArrayJobError` naming the failed tasks and their logs, `Interrupted` on
    SIGINT/SIGTERM (after stopping the tasks), `LaunchError` when Slurm refuses the job.
    """
    tasks = list(tasks)
    if not tasks:
        return
    if JOB not in str(log):
        raise ValueError(f"the log {log} must hold {JOB} (one log per task)")
    logs = {task: Path(_for_task(str(log), task)) for task in tasks}
    for path in logs.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("%s: %d task(s) (%s) through the %s backend; logs %s", name, len(tasks),
                compress_tasks(tasks), launcher.backend, log)
    if launcher.is_local:
        failures = _run_local(tasks, command, logs, max(1, parallel), cwd)
    else:
        failures = _run_slurm(launcher, name, tasks, command, Path(log), logs, cwd)
    if failures:
        raise ArrayJobError(name, failures, len(tasks))


def task_status(log: Path, job_id: str | None = None) -> int | None:
    """The exit status a task's log ends with (None: it did not end by itself); with
    `job_id`, only lines after the first that names `job <job_id>` count (a log that
    several jobs appended to)."""
    with contextlib.suppress(OSError), open(log, "rb") as f:
        lines = f.read().decode("utf-8", "replace").splitlines()
        if job_id is not None:
            starts = [i for i, line in enumerate(lines) if f"of job {job_id} " in line + " "]
            lines = lines[starts[0]:] if starts else []
        for line in reversed(lines):
            if line.startswith(ENDED):
                with contextlib.suppress(ValueError):
                    return int(line[len(ENDED):].split()[0])
    return None


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Turn SIGTERM into `Interrupted` (SIGINT already raises KeyboardInterrupt) while the
    block runs, so that the tasks are stopped before this process ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        del frame
        raise Interrupted(f"{signal.Signals(signum).name} received")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_local(running: dict[int, subprocess.Popen]) -> None:
    for process in running.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_SECONDS
    for process in running.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _run_local(tasks: list[int], command: Sequence[str], logs: dict[int, Path], parallel: int,
               cwd: PathLike | None) -> dict[int, tuple[str, Path]]:
    """Kaldi's run.pl: each task a child process group that ends with this process."""
    queue = list(tasks)
    running: dict[int, subprocess.Popen] = {}
    handles: dict[int, Any] = {}
    failures: dict[int, tuple[str, Path]] = {}
    try:
        with _interruptible():
            while queue or running:
                while queue and len(running) < parallel:
                    task = queue.pop(0)
                    argv = [_for_task(word, task) for word in command]
                    handle = open(logs[task], "w", encoding="utf-8")  # noqa: SIM115
                    handle.write(f"# {shlex.join(argv)}\n# started at "
                                 f"{time.strftime('%Y-%m-%d %H:%M:%S')} on "
                                 f"{socket.gethostname()}\n")
                    handle.flush()
                    handles[task] = handle
                    running[task] = subprocess.Popen(
                        argv, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                        preexec_fn=parent_death_preexec())
                for task, process in list(running.items()):
                    status = process.poll()
                    if status is None:
                        continue
                    del running[task]
                    handles[task].write(f"{ENDED}{status}\n")
                    handles.pop(task).close()
                    if status != 0:
                        failures[task] = (f"exited with status {status}", logs[task])
                if running:
                    time.sleep(0.05)
    except BaseException:
        _stop_local(running)
        raise
    finally:
        for handle in handles.values():
            handle.close()
    return failures


# ----------------------------------------------------------------------------- Slurm


def _slurm(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise LaunchError(f"{args[0]} not found: the slurm backend needs Slurm's client "
                          "commands (sbatch, squeue, scontrol, scancel) on PATH") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(args)}: no answer from Slurm in 120 s") from None
    if check and result.returncode != 0:
        raise LaunchError(f"{shlex.join(args)} failed: {result.stderr.strip()}")
    return result


def _batch_script(command: Sequence[str], cwd: Path) -> str:
    words = " ".join(_shell_word(word) for word in command)
    return "\n".join([
        "#!/bin/bash",
        "# A task of a job array written by cat.core.launch; its number is $JOB.",
        f"cd {shlex.quote(str(cwd))} || exit 1",
        "JOB=${SLURM_ARRAY_TASK_ID:?not run as a task of a Slurm array}",
        f"echo {shlex.quote('# ' + shlex.join(command))}",
        "echo \"# started at $(date '+%Y-%m-%d %H:%M:%S') on $(hostname) as task $JOB of "
        "job ${SLURM_ARRAY_JOB_ID:-?}\"",
        words,
        "status=$?",
        f'echo "{ENDED}$status"',
        "exit $status",
        "",
    ])


def submit(script: Path, options: Sequence[str]) -> str:
    """`sbatch --parsable OPTIONS SCRIPT`; returns the job id."""
    result = _slurm(["sbatch", "--parsable", *options, str(script)])
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"sbatch {script}: unexpected answer {result.stdout!r}")
    return job_id


#: Slurm job states after which a job runs no more (a requeued job passes through
#: REQUEUED and PENDING instead).
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
                             "SPECIAL_EXIT", "REVOKED"})
#: Seconds a job must be seen finished before we believe it: a requeue passes through
#: states that plain `squeue` does not list.
SETTLE_SECONDS = 1.0
#: Seconds a cancelled job is waited for, to end (its processes save in Slurm's KillWait).
CANCEL_WAIT_SECONDS = 120


def queued(job_id: str) -> bool:
    """True while any task of the job may still run (pending, running, completing,
    being requeued): `squeue --states=all` lists a state outside `FINISHED_STATES`."""
    result = _slurm(["squeue", "--noheader", "--array", "--states=all", "--jobs", job_id,
                     "--format=%T"], check=False)
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return False  # finished and purged
        raise LaunchError(f"squeue --jobs {job_id} failed: {result.stderr.strip()}")
    return any(state not in FINISHED_STATES for state in result.stdout.split())


def job_states(job_id: str) -> dict[int | None, dict[str, str]]:
    """`scontrol show job`'s fields per array task (key None for a job without an array)."""
    result = _slurm(["scontrol", "show", "job", "--oneliner", job_id], check=False)
    states: dict[int | None, dict[str, str]] = {}
    for line in result.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        task = fields.get("ArrayTaskId")
        states[int(task) if task and task.isdigit() else None] = fields
    return states


def _wait_until_gone(job_id: str, poll_seconds: float, timeout: float | None = None) -> bool:
    """Poll until the job has left the queue for good; False when `timeout` s passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    finished_since = None
    while deadline is None or time.monotonic() < deadline:
        if queued(job_id):
            finished_since = None
        elif finished_since is None:
            finished_since = time.monotonic()
        elif time.monotonic() - finished_since >= SETTLE_SECONDS:
            return True
        time.sleep(poll_seconds)
    return False


def wait_for(job_id: str, poll_seconds: float) -> None:
    """Poll the queue until the job has left it (requeued runs included). On SIGINT or
    SIGTERM cancel the job (`scancel`: it ends for good, see `stop_cause`), wait up to
    `CANCEL_WAIT_SECONDS` for its processes to save and end (a second signal stops the
    wait), then raise."""
    try:
        with _interruptible():
            _wait_until_gone(job_id, poll_seconds)
    except BaseException:
        _slurm(["scancel", job_id], check=False)
        logger.warning("Slurm job %s cancelled; waiting up to %d s for it to end (a second "
                       "signal stops waiting)", job_id, CANCEL_WAIT_SECONDS)
        with contextlib.suppress(Interrupted, KeyboardInterrupt, LaunchError), \
                _interruptible():
            if not _wait_until_gone(job_id, poll_seconds, CANCEL_WAIT_SECONDS):
                logger.warning("Slurm job %s is still in the queue after %d s", job_id,
                               CANCEL_WAIT_SECONDS)
        raise


#: `stop_cause` verdicts: the job's processes were asked to stop ...
CANCELLED = "cancelled"  # by a user (`scancel`, also `--signal=KILL`): it ends for good
REQUEUED = "requeued"  # by Slurm itself (preemption in PreemptMode=REQUEUE, `scontrol requeue`)
PREEMPTED = "preempted"  # by a preemption that cancels (PreemptMode=CANCEL)
TIME_LIMIT = "time-limit"  # by the time limit
SIGNALLED = "signalled"  # while it runs on: a warning (`--signal=USR1@300`, `scancel
#                          --signal=...`) or a preemption's grace time
UNKNOWN = "unknown"  # Slurm did not answer
#: The verdicts after which the job must requeue itself to go on.
REQUEUE_ITSELF = frozenset({PREEMPTED, TIME_LIMIT, SIGNALLED})


def stop_cause(fields: dict[str, str], restart_count: int) -> str:
    """Why the processes of a Slurm job got a stop signal, from the job's `scontrol show
    job` fields read as they stop (`restart_count`: `$SLURM_RESTART_COUNT` of this run).

    What Slurm 22.05 shows then: a user's `scancel` (plain, or `--signal=KILL`) marks the
    job CANCELLED at once (COMPLETING while its processes end: SIGCONT and SIGTERM, SIGKILL
    after KillWait), with no reason, no preemption time and its restart count unchanged;
    Slurm's own requeue of a preempted job raises the restart count first; a preemption
    that cancels sets PreemptTime; the time limit sets the reason TimeLimit; a signal with
    the job left running (the time-limit warning, `scancel --signal=TERM`, a preemption's
    GraceTime) finds it RUNNING. Returns one of the verdicts above."""
    state = fields.get("JobState", "")
    if not state:
        return UNKNOWN
    if state in ("RUNNING", "SUSPENDED"):
        return SIGNALLED
    restarts = fields.get("Restarts", "0")
    if restarts.isdigit() and int(restarts) > restart_count:
        return REQUEUED
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return REQUEUED
    if fields.get("PreemptTime", "None") not in ("None", "Unknown", "") \
            or state == "PREEMPTED":
        return PREEMPTED
    if fields.get("Reason") == "TimeLimit" or state == "TIMEOUT":
        return TIME_LIMIT
    return CANCELLED


def _run_slurm(launcher: Launcher, name: str, tasks: list[int], command: Sequence[str],
               log: Path, logs: dict[int, Path], cwd: PathLike | None
               ) -> dict[int, tuple[str, Path]]:
    """Kaldi's slurm.pl: one array job, polled until it is done."""
    work = Path(cwd or ".").resolve()
    script = log.parent / f"{name}.sbatch"
    with atomic_write(script) as f:
        f.write(_batch_script(command, work))
    for path in logs.values():
        path.unlink(missing_ok=True)  # a status line of an earlier run must not count
    output = (log if log.is_absolute() else work / log).as_posix()
    options = [f"--job-name={name}", f"--array={compress_tasks(tasks)}",
               f"--output={output.replace('%', '%%').replace(JOB, '%a')}",
               f"--chdir={work}", *launcher.sbatch_resources()]
    job_id = submit(script, options)
    logger.info("%s: Slurm job %s (%s)", name, job_id, shlex.join(["sbatch", *options]))
    wait_for(job_id, launcher.poll_seconds)
    failures: dict[int, tuple[str, Path]] = {}
    states: dict[int | None, dict[str, str]] | None = None
    for task in tasks:
        status = task_status(logs[task])
        if status == 0:
            continue
        if status is not None:
            failures[task] = (f"exited with status {status}", logs[task])
            continue
        states = job_states(job_id) if states is None else states
        fields = states.get(task, {})
        failures[task] = (f"ended without a status (Slurm state "
                          f"{fields.get('JobState', 'unknown')}, reason "
                          f"{fields.get('Reason', 'unknown')})", logs[task])
    return failures


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """How a batch job of `submit_job` ended."""

    job_id: str
    #: the status its log ends with (None: it ended without one)
    status: int | None
    #: its last Slurm state (CANCELLED, COMPLETED, TIMEOUT, ...; "" once Slurm forgot it)
    state: str


def submit_job(launcher: Launcher, name: str, script_text: str, log: Path,
               options: Sequence[str], cwd: PathLike | None = None) -> JobEnd:
    """Run one batch script (`options`: sbatch options beyond the launcher's resources),
    wait until it has left the queue for good (requeues included); returns how it ended.
    The script must print a line naming `of job $SLURM_JOB_ID` before its status line (the
    log may hold earlier jobs'). SIGINT or SIGTERM cancels it (see `wait_for`)."""
    work = Path(cwd or ".").resolve()
    script = log.parent / f"{name}.sbatch"
    log.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(script) as f:
        f.write(script_text)
    output = (log if log.is_absolute() else work / log).as_posix()
    job_id = submit(script, [f"--job-name={name}", f"--output={output.replace('%', '%%')}",
                             f"--chdir={work}", *launcher.sbatch_resources(), *options])
    logger.info("%s: Slurm job %s; log %s", name, job_id, log)
    wait_for(job_id, launcher.poll_seconds)
    fields = next(iter(job_states(job_id).values()), {})
    return JobEnd(job_id, task_status(log, job_id), fields.get("JobState", ""))


# ----------------------------------------------------------------------------- map_calls


def map_calls(launcher: Launcher, name: str, function: Callable[..., Any],
              calls: Sequence[tuple], work_dir: PathLike, parallel: int = 1) -> list[Any]:
    """`[function(*args) for args in calls]`, each call a task of an array (see the
    module doc); the calls and results travel as pickles in `work_dir`, the logs are
    `work_dir/<name>.<task>.log`. Results of calls finished by an earlier run are not
    reused: the caller decides what is done."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    for task, args in enumerate(calls, 1):
        (work_dir / f"result.{task}.pkl").unlink(missing_ok=True)
        with atomic_write(work_dir / f"call.{task}.pkl", "wb") as f:
            pickle.dump((function, tuple(args)), f)
    run_array(launcher, name, range(1, len(calls) + 1),
              [sys.executable, "-m", "cat.core.launch", "call", str(work_dir.resolve()), JOB],
              work_dir / f"{name}.{JOB}.log", parallel)
    results = []
    for task in range(1, len(calls) + 1):
        with open(work_dir / f"result.{task}.pkl", "rb") as f:
            results.append(pickle.load(f))
        (work_dir / f"call.{task}.pkl").unlink()
        (work_dir / f"result.{task}.pkl").unlink()
    return results


def _run_call(work_dir: Path, task: int) -> None:
    with open(work_dir / f"call.{task}.pkl", "rb") as f:
        function, args = pickle.load(f)
    result = function(*args)
    with atomic_write(work_dir / f"result.{task}.pkl", "wb") as f:
        pickle.dump(result, f)


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous of a training job's ranks)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """`[options] JOB=1:N LOG COMMAND...`, `call DIR JOB` (a task of `map_calls`),
    `free-port`, or `stop-cause JOB_ID RESTART_COUNT` (a job's `stop_cause`)."""
    from cat.core.io import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if argv[:1] == ["call"] and len(argv) == 3:
        _run_call(Path(argv[1]), int(argv[2]))
        return 0
    if argv == ["free-port"]:
        print(free_port())
        return 0
    if argv[:1] == ["stop-cause"] and len(argv) == 3:
        states = job_states(argv[1])
        print(stop_cause(next(iter(states.values()), {}), int(argv[2] or 0)))
        return 0
    parser = argparse.ArgumentParser(
        prog=f"{PROGRAM} (python -m cat.core.launch)",
        description="Run COMMAND once per task, JOB replaced by the task number, its output "
                    "in LOG (JOB replaced too), through the local or the slurm backend.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[-1])
    add_arguments(parser)
    parser.add_argument("--parallel", type=int, default=0,
                        help="local tasks at once (default: all)")
    parser.add_argument("tasks", metavar="JOB=1:N", help="the task numbers (also JOB=2,5,7)")
    parser.add_argument("log", help="each task's log, JOB in its name")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, JOB in it")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    try:
        tasks = parse_tasks(args.tasks)
        run_array(from_args(args), Path(args.log).name.split(".")[0] or "array", tasks,
                  args.command, args.log, args.parallel or len(tasks))
    except (ArrayJobError, LaunchError, ValueError) as error:
        logger.error("%s", error)
        return 1
    except (Interrupted, KeyboardInterrupt):
        logger.error("interrupted; the tasks were stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
