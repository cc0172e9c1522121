"""Worker processes that end with their parent.

A process started by `multiprocessing` (a `ProcessPoolExecutor` worker, a spawned
DataLoader worker) keeps running when its parent is killed with SIGKILL: nothing tells
it, and an idle pool worker waits for work forever. `die_with_parent(parent_pid)`, called
first thing in the child, ends the child within about a second of its parent's death:

* on Linux the kernel sends the child SIGKILL when the parent ends
  (`prctl(PR_SET_PDEATHSIG)`). The kernel ties this to the parent *thread* that started
  the child, so start pools from a thread that outlives them (here, always the main
  thread);
* everywhere, a daemon thread checks every `poll_seconds` that the parent is still
  `parent_pid` (`os.getppid()` changes when the child is orphaned) and exits otherwise.

A spawned pool worker arms the signal (and checks its parent) before it imports its
parent's main module, so a parent killed while its pool starts leaves no worker behind
(`_ArmedName`).

`process_pool(num_workers)` is the spawn-context `ProcessPoolExecutor` every stage uses;
`loader_worker_init(parent_pid)` is the `worker_init_fn` of torch DataLoaders, whose
workers also ignore SIGINT, SIGTERM and SIGUSR1 (the training process acts on them).

Commands run by a worker (Kaldi pipe commands in `wav.scp`) are not covered: like under
Kaldi, they end when they next write to the pipe of their dead reader (SIGPIPE).

Usage:
    with process_pool(4) as pool:
        results = list(pool.map(work, jobs))
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import multiprocessing
import multiprocessing.context
import operator
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1
#: Exit status of a child that found its parent gone.
ORPHAN_EXIT_STATUS = 1
_POLL_SECONDS = 1.0


def set_parent_death_signal() -> bool:
    """Ask the Linux kernel to SIGKILL this process when its parent ends; False elsewhere.

    Also the `preexec_fn` of `subprocess.Popen` for programs that must end with the
    process that started them.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def parent_death_preexec() -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen` that makes the child SIGKILLed when the
    thread that started it ends (Linux; elsewhere it does nothing). libc is looked up
    here, in the parent, so the forked child only makes the call."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def request() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return request


def _watch_parent(parent_pid: int, poll_seconds: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_seconds)
    os._exit(ORPHAN_EXIT_STATUS)


def die_with_parent(parent_pid: int, poll_seconds: float = _POLL_SECONDS,
                    use_prctl: bool = True) -> None:
    """End this process when the process `parent_pid` (its parent) ends (see the module doc).

    Call it in the child, with the parent's pid taken in the parent. `use_prctl=False`
    leaves only the portable check (for tests of it).
    """
    if use_prctl:
        set_parent_death_signal()
    # The parent may have died before the signal was armed.
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT_STATUS)
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_seconds),
                     name="parent-watch", daemon=True).start()


def _pool_worker_init(parent_pid: int, initializer: Callable[..., Any] | None,
                      initargs: tuple) -> None:
    die_with_parent(parent_pid)
    if initializer is not None:
        initializer(*initargs)


# Run by a spawned child while it unpickles its process name, before anything else (see
# _ArmedName). Only the standard library: the child cannot import `cat` yet.
_ARM_IN_CHILD = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
if os.getppid() != parent_pid:
    os._exit(exit_status)
"""


class _ArmChild:
    """Pickles as a call of `exec(_ARM_IN_CHILD)` in the unpickling process."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid

    def __reduce__(self) -> tuple:
        return (exec, (_ARM_IN_CHILD, {"parent_pid": self.parent_pid,
                                       "exit_status": ORPHAN_EXIT_STATUS}))


class _ArmedName(str):
    """The name of a spawned pool process, whose unpickling arms the parent-death signal.

    A spawned child first unpickles its preparation data (with this name), then imports
    its parent's main module (with torch: seconds), and only then runs the worker
    initializer (`die_with_parent`): a parent killed meanwhile left its workers alive
    for as long as that import took. Unpickling this name arms the signal, and ends a
    child whose parent is already gone, before that import. It unpickles as a plain str.
    """

    parent_pid: int

    def __new__(cls, name: str, parent_pid: int) -> _ArmedName:
        armed = super().__new__(cls, name)
        armed.parent_pid = parent_pid
        return armed

    def __reduce__(self) -> tuple:
        return (operator.getitem, ((_ArmChild(self.parent_pid), str(self)), 1))


class _SpawnProcess(multiprocessing.context.SpawnProcess):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._name = _ArmedName(self._name, os.getpid())


class _SpawnContext(multiprocessing.context.SpawnContext):
    """The spawn context, whose processes end with their parent from their first moment."""

    Process = _SpawnProcess


def process_pool(num_workers: int, initializer: Callable[..., Any] | None = None,
                 initargs: tuple = ()) -> concurrent.futures.ProcessPoolExecutor:
    """A `ProcessPoolExecutor` of `num_workers` spawned processes that die with this one,
    also when it dies while they start (`_ArmedName`).

    Spawned, not forked: workers start clean (no inherited locks, file handles or torch
    state) on every platform. Unlike `multiprocessing.Pool`, the executor reports a worker
    that was killed (e.g. out of memory) instead of waiting for it forever.
    """
    return concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=_SpawnContext(),
        initializer=_pool_worker_init, initargs=(os.getpid(), initializer, initargs))


#: Signals that DataLoader workers leave to their parent: a scheduler signals every
#: process of a job (Slurm: a job step's), a terminal its whole foreground group, and
#: the training process decides (`cat.training.preemption`); a worker killed by one
#: would end the epoch with an error before the parent could save.
LOADER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _loader_worker_init(parent_pid: int, worker_id: int) -> None:
    del worker_id
    for signum in LOADER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(parent_pid)


def loader_worker_init(parent_pid: int | None = None) -> Callable[[int], None]:
    """A DataLoader `worker_init_fn` making its workers die with `parent_pid` (default: this
    process). Picklable, so it also serves spawned workers."""
    return functools.partial(_loader_worker_init, os.getpid() if parent_pid is None
                             else parent_pid)
