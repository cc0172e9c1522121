"""One training at a time per experiment: the job that trains holds `exp/<name>/train.lock`.

Two trainings of one experiment (a re-run of stage 3 while the first still runs, a second
Slurm job, a `--resume` typed in another terminal) would both resume into `check/` and
write each other's checkpoints. So a training takes the lock before it reads or writes
anything of the experiment and keeps it to its end, whichever way it ends (finished,
failed, or stopped by a signal with status 75). The lock belongs to the job, not to
each rank: rank 0 takes it, and one collective tells every rank whether it did, so a
refused rank 0 stops the whole job and the ranks of one job never lock each other out
(on one node or many).

The lock is the kernel's (`fcntl.flock` on the open lock file, released by the kernel
when its holder dies, however it dies) plus a record in the file naming its holder: the
host, the process id and its start time (`/proc/<pid>/stat`), the boot, the Slurm job,
since when and the command. A second training is refused with the holder named. A lock
whose holder is gone is taken over with a warning: on the same host, a process id that no
longer runs, that now belongs to a later process (its start time differs), or a boot
since; on any host, an earlier run of the same Slurm job (a requeued job). A record of
another host, whose process cannot be checked from here, is refused with the command to
remove it if that job is gone. While the file is still locked by the processes a dead
holder started (they end with it), taking it is retried for `LINGER_SECONDS`.

NFS: Linux maps `flock` on NFS to byte-range locks the server arbitrates, so the kernel
lock holds across hosts, unless the share is mounted with `nolock` or `local_lock=flock`
(then it is a lock of this host alone), and a client that crashed keeps its lock until
the server's lease expires (NFSv4: about 90 s). Where `flock` fails (no lock service) the
record alone decides, with a warning: two trainings started within the same instant
could then both take it. A run that ends removes the file.

Usage:
    with experiment_lock(Path("exp/ctc-v1"), context):
        ... train ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cat.core.process import pid_alive
from cat.training.distributed import DistributedContext

logger = logging.getLogger(__name__)

LOCK_NAME = "train.lock"
#: Seconds a lock still held by what a dead holder left (its DataLoader workers, which
#: end with it) is tried again before the training is refused.
LINGER_SECONDS = 10.0
_PROC = Path("/proc")


class ExperimentLockedError(RuntimeError):
    """Another training holds the experiment; the message names it and what to do."""


def _boot_id() -> str | None:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None when it does not run (or
    is a zombie) or where there is no `/proc`."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds the lock: the record in the lock file."""

    host: str
    pid: int
    since: str
    started: int | None = None
    boot_id: str | None = None
    slurm_job: str | None = None
    command: str = ""

    @classmethod
    def this_process(cls) -> Holder:
        """The record of this process, taking the lock now."""
        return cls(socket.gethostname(), os.getpid(),
                   datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   process_start(os.getpid()), _boot_id(), os.environ.get("SLURM_JOB_ID"),
                   " ".join([os.path.basename(sys.executable), *sys.argv]))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The record in `text`; None when it is empty or not one (being written)."""
        try:
            record: Any = json.loads(text)
            return cls(**{field.name: record[field.name]
                          for field in dataclasses.fields(cls) if field.name in record})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        """`host h, pid 123, since <time>[, Slurm job 7]`."""
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        return f"host {self.host}, pid {self.pid}, since {self.since}{job}"

    def gone(self) -> str | None:
        """Why this holder, on this host, no longer runs; None while it may run."""
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return "the host restarted since"
        if not pid_alive(self.pid):
            return f"no process {self.pid} runs"
        started = process_start(self.pid)
        if self.started is not None and started is not None and started != self.started:
            return f"process {self.pid} is another one now, started later"
        if started is None and _PROC.is_dir() and (_PROC / str(self.pid)).is_dir():
            return f"process {self.pid} has ended"  # a zombie
        return None


class ExperimentLock:
    """The lock of one experiment directory (see the module docstring)."""

    def __init__(self, directory: Path, linger_seconds: float = LINGER_SECONDS) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.linger_seconds = linger_seconds
        self.holder: Holder | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ExperimentLockedError naming its holder."""
        deadline = time.monotonic() + self.linger_seconds
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if self._take(fd, deadline):
                    self._fd, fd = fd, -1
                    return
            finally:
                if fd >= 0:
                    os.close(fd)
            time.sleep(0.2)

    def _take(self, fd: int, deadline: float) -> bool:
        """Take the lock through `fd`: True once taken, False to try again."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.parse(_read(fd))
            if holder is None or holder.host != socket.gethostname() or holder.gone() is None:
                raise ExperimentLockedError(self._in_use(holder)) from None
            if time.monotonic() < deadline:
                return False  # what the dead holder started still holds the file
            raise ExperimentLockedError(
                f"{self.path} is still locked, though the training that took it "
                f"({holder.describe()}) is gone ({holder.gone()}): processes it started "
                "may still run; end them, then run again") from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.warning("%s: the file system does not lock files (%s): the lock's "
                           "record alone keeps a second training out", self.path, error)
        if not _same_file(fd, self.path):
            return False  # removed by a holder that released it; take the new file
        previous = Holder.parse(_read(fd))
        if previous is not None:
            self._check_previous(previous)
        self.holder = Holder.this_process()
        text = json.dumps(dataclasses.asdict(self.holder)) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)
        return True

    def _in_use(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else "a process that has not written its record yet"
        return (f"{self.directory} is in use by another training ({who}): a second one would "
                f"write the same checkpoints. Wait for it to end, or stop it (its lock: "
                f"{self.path})")

    def _check_previous(self, previous: Holder) -> None:
        """Raise for a record of a holder that may still run; warn when taking one over."""
        host = socket.gethostname()
        if previous.host == host:
            why = previous.gone()
            if why is None:
                raise ExperimentLockedError(self._in_use(previous))
        elif previous.slurm_job and previous.slurm_job == os.environ.get("SLURM_JOB_ID"):
            why = f"an earlier run of this Slurm job {previous.slurm_job}, requeued"
        else:
            raise ExperimentLockedError(
                f"{self.directory} is locked by a training on host {previous.host} (pid "
                f"{previous.pid}, since {previous.since}), which cannot be checked from "
                f"{host}. If that job is gone, remove {self.path} and run again")
        logger.warning("%s: taking over the lock of a training that is gone (%s; %s)",
                       self.path, previous.describe(), why)

    def release(self) -> None:
        """Remove the lock file (when it is still this holder's) and unlock it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _same_file(fd, self.path) and Holder.parse(_read(fd)) == self.holder:
                self.path.unlink()
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read(fd: int) -> str:
    return os.pread(fd, 65536, 0).decode("utf-8", "replace")


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def experiment_lock(directory: Path, context: DistributedContext,
                    linger_seconds: float = LINGER_SECONDS) -> Iterator[ExperimentLock | None]:
    """Hold the lock of `directory` on rank 0 while the block runs (yields it there, None
    on the other ranks); when rank 0 cannot take it, every rank raises."""
    lock = ExperimentLock(directory, linger_seconds) if context.is_main else None
    failure: BaseException | None = None
    if lock is not None:
        try:
            lock.acquire()
        except Exception as error:  # every rank must hear of it
            failure = error
    verdicts = context.gather(None if failure is None else f"{type(failure).__name__}: "
                                                           f"{failure}")
    if failure is not None:
        raise failure
    if verdicts[0] is not None:
        raise ExperimentLockedError(f"rank 0 could not lock {directory}: {verdicts[0]}")
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
