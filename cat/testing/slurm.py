"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd on 127.0.0.1.

`start_slurm(work_dir)` writes a private munge key and a `slurm.conf` (cluster
`cattest`, one node named after this host with all its CPUs and most of its memory, a
partition `debug`, and `urgent`, whose jobs preempt debug's: Slurm requeues them), then
runs `munged`, `slurmctld` and `slurmd` in the foreground, each in its own process
group: the ports are free ones on 127.0.0.1, munge listens on a private socket, and
state, spool, logs and pid files stay in `work_dir` (the sockets in a short folder under
/tmp, as a socket path must stay under 108 bytes), so the cluster neither needs nor
disturbs the machine's own Slurm or munge. It waits a bounded time for `sinfo` to report
the node idle; on a failure the error holds the daemons' log tails.

The clients (`sbatch`, `srun`, `squeue`, `scontrol`, `scancel`, `sinfo`) find the
cluster through `SLURM_CONF`: run them with `cluster.env`, or set the variable. The
scheduler is tuned to start jobs at once (no batch scheduling delay, a scheduling pass
every second) and `KillWait` is 15 s, so a cancelled job is killed 15 s after its SIGTERM
(its ranks save and its batch shell writes why it stopped well within it on a busy
machine: with 5 s the batch shell was killed before its last log line).

`stop()` cancels the jobs left, stops the daemons (SIGTERM, then SIGKILL after a bounded
wait) and kills, by pid, any job process that outlived them. The daemons also die with
the thread that started them (Linux `PR_SET_PDEATHSIG`). Slurm runs jobs as their user,
so this needs root (see `slurm_unavailable()`) and the Debian packages `slurmctld slurmd
slurm-client munge` (`tools/install.sh --dev`).

A requeued job waits 120 s before it may start again; `release(job_id)` lets it start a
second later (not at once, which fails it, see there), and `wait_for_job` does so while it
waits.

Usage:
    with slurm_cluster(tmp_path / "slurm") as cluster:
        job_id = sbatch(["--array=1-3", "-o", f"{tmp_path}/task.%a.log", "job.sh"], cluster.env)
        states = wait_for_job(job_id, timeout=60, env=cluster.env)
        assert {task: s["JobState"] for task, s in states.items()} == {
            "1": "COMPLETED", "2": "COMPLETED", "3": "COMPLETED"}
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from cat.core.io import PathLike
from cat.core.process import parent_death_preexec
from cat.testing.processes import environment_of, process_identity, wait_until
from cat.testing.seaweedfs import free_ports

PARTITION = "debug"
#: A partition whose jobs preempt those of PARTITION (Slurm requeues them).
URGENT_PARTITION = "urgent"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
# Where Debian puts the daemons; often not on a user's PATH.
_DAEMON_PATH = "/usr/sbin:/sbin"
# States a job (or array task) does not leave by itself.
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_CLIENT_TIMEOUT = 30.0

_CONF = """\
ClusterName=cattest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={work_dir}/state
SlurmdSpoolDir={run_dir}/spool
SlurmctldPidFile={work_dir}/slurmctld.pid
SlurmdPidFile={work_dir}/slurmd.pid
SlurmctldLogFile={work_dir}/log/slurmctld.log
SlurmdLogFile={work_dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Start jobs at once and look at pending ones (array tasks, released requeued jobs) every
# second: a 3-task array of trivial jobs takes about 2 s instead of 6 s on 2 CPUs.
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
# A cancelled job gets its SIGKILL 15 s after its SIGTERM instead of 30 s.
KillWait=15
# Finished jobs stay visible to `scontrol show job` (there is no accounting database).
MinJobAge=600
# A job of the higher tier {urgent_partition} preempts the jobs of {partition} it needs the
# CPUs of, and Slurm requeues them (their processes get SIGTERM, SIGKILL after KillWait).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName={urgent_partition} Nodes={host} MaxTime=INFINITE State=UP PriorityTier=2 \
PreemptMode=OFF
"""


class SlurmError(RuntimeError):
    """The cluster could not be started, or a Slurm command failed; the message says why."""


def _executable(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{_DAEMON_PATH}")


def slurm_unavailable() -> str | None:
    """Why a test cluster cannot run on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"Slurm test clusters run on Linux only, not {sys.platform}"
    missing = [name for name in (*DAEMONS, *CLIENTS) if _executable(name) is None]
    if missing:
        return (f"Slurm is not installed (no {', '.join(missing)}); install the Debian "
                "packages slurmctld slurmd slurm-client munge (tools/install.sh --dev)")
    if os.geteuid() != 0:
        return (f"slurmd must run as root to start jobs as their user (running as uid "
                f"{os.geteuid()})")
    return None


@dataclasses.dataclass
class SlurmCluster:
    """A running cluster: its configuration, environment for clients, daemons and logs."""

    work_dir: Path
    run_dir: Path
    conf: Path
    env: dict[str, str]
    partition: str
    node: str
    cpus: int
    memory_mb: int
    processes: dict[str, subprocess.Popen]
    # Each daemon's log file (slurmd's also has the job steps' messages), and as
    # "<daemon>.out" what it printed.
    logs: dict[str, Path]
    startup_seconds: float = 0.0

    @property
    def pids(self) -> dict[str, int]:
        """Pid of each daemon (`munged`, `slurmctld`, `slurmd`)."""
        return {name: process.pid for name, process in self.processes.items()}

    def alive(self) -> bool:
        """Whether every daemon still runs."""
        return all(process.poll() is None for process in self.processes.values())

    def run(self, command: Sequence[str], timeout: float = _CLIENT_TIMEOUT) -> str:
        """Run a Slurm client against this cluster; returns its output, raises on failure."""
        return run_client(command, self.env, timeout)

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` each daemon printed, under its file name: its `.out` holds
        what its log file does and also the errors from before it could open that."""
        parts = []
        for path in (self.logs[f"{name}.out"] for name in DAEMONS):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the jobs left, stop the daemons and kill any job process that outlived
        them, each step waiting at most `timeout` s (idempotent)."""
        if len(self.processes) == len(DAEMONS) and self.alive():
            self._cancel_jobs(timeout)
        for name in reversed(DAEMONS):
            if name in self.processes:
                _terminate(self.processes[name], timeout)
        _kill_processes(self._job_processes(), timeout)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _cancel_jobs(self, timeout: float) -> None:
        with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
            self.run(["scancel", f"--partition={self.partition}"], timeout)
            wait_until(lambda: not self.run(["squeue", "-h", "-o", "%i"], timeout).strip(),
                       timeout, 0.2)

    def _job_processes(self) -> list[tuple[int, int]]:
        """Identities of the processes of this cluster's jobs: slurmstepd and what it ran
        carry this cluster's `SLURM_CONF`, inherited from slurmd or from the submitter."""
        found = []
        for entry in Path("/proc").iterdir():
            if (entry.name.isdigit() and int(entry.name) != os.getpid()
                    and environment_of(int(entry.name)).get("SLURM_CONF") == str(self.conf)
                    and (identity := process_identity(int(entry.name))) is not None):
                found.append(identity)
        return found


def _terminate(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM `process`'s group, then SIGKILL it if it has not ended after `timeout` s."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
    raise SlurmError(f"process {process.pid} survived SIGKILL for {timeout:.0f} s")


def _kill_processes(identities: list[tuple[int, int]], timeout: float) -> None:
    """SIGKILL the processes still running as `identities` and wait for them to end."""
    for pid, _ in identities:
        if process_identity(pid) in identities:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(process_identity(pid) in identities for pid, _ in identities),
               timeout, 0.1)


def run_client(command: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = _CLIENT_TIMEOUT) -> str:
    """Run a Slurm client command (with `env`, default the current environment); returns
    its standard output, raises `SlurmError` with its messages when it fails."""
    result = subprocess.run(list(command), env=None if env is None else dict(env),
                            capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(command)} failed with status {result.returncode}: "
                         f"{result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def sbatch(arguments: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Submit a batch job (`sbatch --parsable ARGUMENTS`); returns its job id."""
    return run_client(["sbatch", "--parsable", *arguments], env).strip().split(";")[0]


def job_states(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The fields of `scontrol show job -o JOB_ID` (JobState, ExitCode, Restarts, Reason,
    ArrayTaskId, ...), one dict per record: keyed by array task id for an array job (a
    range such as "2-3" for tasks still pending together) or by the job id otherwise.
    Values holding spaces are cut at the first space."""
    records = {}
    for line in run_client(["scontrol", "show", "job", "-o", str(job_id)], env).splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if "JobId" in fields:
            records[fields.get("ArrayTaskId", fields["JobId"])] = fields
    return records


def release(job_id: str, env: Mapping[str, str] | None = None) -> None:
    """Let a requeued job start in a second instead of after its 120 s wait (its BeginTime).

    Not at once: slurmd refuses ("Job credential revoked") a job whose credential was made
    in the same second as the one it revoked when the previous run ended, and the job
    fails."""
    run_client(["scontrol", "update", f"JobId={job_id}", "StartTime=now+1"], env)


def wait_for_job(job_id: str, timeout: float, env: Mapping[str, str] | None = None,
                 release_requeued: bool = True) -> dict[str, dict[str, str]]:
    """Wait until every task of `job_id` has finished (see `FINISHED_STATES`); returns
    their `job_states`. A requeued task waiting for its BeginTime is released at once
    unless `release_requeued` is false."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(job_id, env)
        if all(fields["JobState"] in FINISHED_STATES for fields in states.values()):
            return states
        if time.monotonic() > deadline:
            summary = {task: fields["JobState"] for task, fields in states.items()}
            raise SlurmError(f"job {job_id} not finished after {timeout:.0f} s: {summary}")
        if release_requeued:
            for fields in states.values():
                if fields["JobState"] == "PENDING" and fields.get("Reason") == "BeginTime":
                    release(fields["JobId"], env)
        time.sleep(0.2)


def _memory_mb() -> int:
    """Most of the machine's memory in MB: slurmd drains a node that has less than its
    configured RealMemory."""
    with open("/proc/meminfo") as meminfo:
        total_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return max(1, total_kb * 9 // 10 // 1024)


def _write_munge_key(munge_dir: Path) -> Path:
    # Open to all, as clients of every user talk to the socket; the key itself is 0400.
    munge_dir.mkdir(mode=0o755, parents=True)
    key = munge_dir / "munge.key"
    descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(descriptor, "wb") as f:
        f.write(secrets.token_bytes(1024))
    return key


def _launch(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as output:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=parent_death_preexec())


def start_slurm(work_dir: PathLike, startup_timeout: float = 30.0) -> SlurmCluster:
    """Start a cluster in `work_dir` (created) and wait until its node is idle; the caller
    must `stop()` it. Raises `SlurmError` (with the daemons' log tails) on failure."""
    reason = slurm_unavailable()
    if reason is not None:
        raise SlurmError(reason)
    work_dir = Path(work_dir).absolute()
    for sub in ("state", "log"):
        (work_dir / sub).mkdir(parents=True)
    cluster = _configure(work_dir)
    try:
        _start_daemons(cluster, startup_timeout)
    except BaseException:
        cluster.stop(timeout=10.0)
        raise
    return cluster


def _configure(work_dir: Path) -> SlurmCluster:
    run_dir = Path(tempfile.mkdtemp(prefix="cat-slurm-", dir="/tmp"))
    (run_dir / "spool").mkdir()
    _write_munge_key(run_dir / "munge")
    # slurmd takes the short host name for its node name.
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    memory_mb = _memory_mb()
    ctld_port, slurmd_port = free_ports(2)
    conf = work_dir / "slurm.conf"
    conf.write_text(_CONF.format(
        host=host, ctld_port=ctld_port, slurmd_port=slurmd_port,
        munge_socket=run_dir / "munge" / "socket", work_dir=work_dir,
        run_dir=run_dir, cpus=cpus, memory_mb=memory_mb, partition=PARTITION,
        urgent_partition=URGENT_PARTITION))
    logs = {name: work_dir / "log" / f"{name}.log" for name in DAEMONS}
    logs.update({f"{name}.out": work_dir / "log" / f"{name}.out" for name in DAEMONS})
    return SlurmCluster(work_dir=work_dir, run_dir=run_dir, conf=conf,
                        env={**os.environ, "SLURM_CONF": str(conf)}, partition=PARTITION,
                        node=host, cpus=cpus, memory_mb=memory_mb, processes={}, logs=logs)


def _start_daemons(cluster: SlurmCluster, timeout: float) -> None:
    start = time.monotonic()
    deadline = start + timeout
    munge = cluster.run_dir / "munge"
    commands = {
        "munged": [_executable("munged"), "--foreground", "--force",
                   f"--key-file={munge / 'munge.key'}", f"--socket={munge / 'socket'}",
                   f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
                   f"--log-file={cluster.logs['munged']}"],
        # -i: the state folder is new, there is nothing to recover.
        "slurmctld": [_executable("slurmctld"), "-D", "-i", "-f", str(cluster.conf)],
        "slurmd": [_executable("slurmd"), "-D", "-N", cluster.node, "-f", str(cluster.conf)],
    }
    for name, command in commands.items():
        cluster.processes[name] = _launch(command, cluster.logs[f"{name}.out"], cluster.env)
        if name == "munged":
            _wait(cluster, lambda: (munge / "socket").exists(), deadline, "munged's socket")
    _wait(cluster, lambda: _node_state(cluster) == "idle", deadline, "an idle node")
    cluster.startup_seconds = time.monotonic() - start


def _node_state(cluster: SlurmCluster) -> str:
    try:
        return cluster.run(["sinfo", "-h", "-o", "%T"], timeout=5.0).strip()
    except (SlurmError, subprocess.TimeoutExpired):
        return ""


def _wait(cluster: SlurmCluster, condition: Callable[[], bool], deadline: float,
          what: str) -> None:
    while True:
        for name, process in cluster.processes.items():
            if process.poll() is not None:
                raise SlurmError(f"{name} exited with status {process.returncode} while "
                                 f"waiting for {what}:\n{cluster.log_tail()}")
        if condition():
            return
        if time.monotonic() > deadline:
            raise SlurmError(f"no {what} after the start timeout:\n{cluster.log_tail()}")
        time.sleep(0.1)


@contextlib.contextmanager
def slurm_cluster(work_dir: PathLike, startup_timeout: float = 30.0) -> Iterator[SlurmCluster]:
    """A running cluster for the duration of the block; always stopped afterwards."""
    cluster = start_slurm(work_dir, startup_timeout)
    try:
        yield cluster
    finally:
        cluster.stop()
