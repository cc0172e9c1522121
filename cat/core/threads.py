"""CPU threads of every process: how many CPUs a process may use, and how its threads wait.

`usable_cpus` counts the CPUs a process may run on: its affinity mask
(`os.sched_getaffinity`), bounded by the CPU quota of its cgroup (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, rounded up), the way container limits are set.
`configure_threads` sets torch's intra-op threads from a `threads` option (0 = the usable
CPUs shared by the processes working side by side) and returns the number chosen; with
0, a `ThreadGovernor` lowers them while other processes keep the CPUs busy (and raises
them again when they stop), from the load average, since a thread that must share its
core with another process delays every parallel region of its siblings.

`passive_waiting` sets `OMP_WAIT_POLICY=PASSIVE` (unless the user set a policy): OpenMP
worker threads then sleep between parallel regions instead of spinning, off the cores
other processes need. On a busy machine a 2-thread training step is 10-30 times slower
than a 1-thread one, spinning or not (`bench/threads.py`: passive waiting did not
measurably change that; fewer threads do, hence `ThreadGovernor`). The OpenMP runtime
reads the variable once, when torch is first imported, so `cat/__init__.py` calls it: every
`python -m cat....` entry point, and every worker process started by `spawn`, imports
`cat` before torch. This module imports no torch itself.

Usage:
    from cat.core.threads import configure_threads, usable_cpus
    threads = configure_threads(options.threads, processes=local_world_size)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
WAIT_POLICY = "OMP_WAIT_POLICY"


def passive_waiting() -> None:
    """Make OpenMP threads sleep, not spin, while they wait (unless a policy is set)."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> cgroup path of this process ('' for the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    text = _read(proc_cgroup) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _candidates(root: Path, path: str | None) -> list[Path]:
    """The cgroup directory of `path` under `root`, then `root` itself (a container sees
    its own cgroup as the root)."""
    found = []
    if path and path != "/":
        found.append(root / path.lstrip("/"))
    found.append(root)
    return found


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
                     ) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or None without one."""
    paths = _cgroup_paths(proc_cgroup)
    # cgroup v2: "<quota> <period>" or "max <period>".
    for directory in _candidates(root, paths.get("")) + _candidates(root / "unified",
                                                                    paths.get("")):
        text = _read(directory / "cpu.max")
        if text is None:
            continue
        fields = text.split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = int(fields[0]), int(fields[1])
            except ValueError:
                return None
            if quota > 0 and period > 0:
                return quota / period
        return None
    # cgroup v1: cpu.cfs_quota_us (-1 = none) / cpu.cfs_period_us.
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in _candidates(root / name, paths.get("cpu")):
            quota_text = _read(directory / "cpu.cfs_quota_us")
            period_text = _read(directory / "cpu.cfs_period_us")
            if quota_text is None or period_text is None:
                continue
            try:
                quota, period = int(quota_text), int(period_text)
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
    return None


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process may use: its affinity, bounded by its cgroup's CPU quota."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit - 1e-9)))
    return cpus


def choose_threads(threads: int, processes: int = 1, cpus: int | None = None) -> int:
    """`threads` when positive, else the usable CPUs shared by `processes` (at least 1)."""
    if threads > 0:
        return threads
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, processes))


def threads_for_load(cpus: int, current: int, load: float, processes: int = 1) -> int:
    """Threads per process for `processes` processes side by side (ranks), each running
    `current` busy threads now, on `cpus` usable CPUs, when the 1-minute load average is
    `load` (their threads included): the CPUs the other processes leave free, shared, at
    least 1. On a busy machine a thread that has to share its core holds up every
    parallel region of its siblings (`bench/threads.py`)."""
    others = max(0.0, load - current * processes)
    # A busy loader worker or a short job leaves a fraction: not a CPU taken.
    free = cpus - math.floor(others + 0.25)
    return max(1, min(cpus // max(1, processes), free // max(1, processes)))


class ThreadGovernor:
    """Re-chooses torch's threads from the load while a process runs (`threads` 0 only).

    `check()` is cheap; it looks at the load average at most every `interval` seconds and
    returns the new number of threads when it changed, else None.
    """

    def __init__(self, threads: int, processes: int = 1, interval: float = 30.0,
                 load: Callable[[], float] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.auto = threads <= 0
        self.processes = processes
        self.usable = usable_cpus()
        self.threads = choose_threads(threads, processes, self.usable)
        self.interval = interval
        self._load = load or (lambda: os.getloadavg()[0])
        self._clock = clock or time.monotonic
        self._last = self._clock()  # the load average shows this process after a while

    def check(self) -> int | None:
        """Set and return the threads the load asks for, when they changed."""
        now = self._clock()
        if not self.auto or now - self._last < self.interval:
            return None
        self._last = now
        wanted = threads_for_load(self.usable, self.threads, self._load(), self.processes)
        if wanted == self.threads:
            return None
        import torch

        torch.set_num_threads(wanted)
        self.threads = wanted
        return wanted


def configure_threads(threads: int = 0, processes: int = 1) -> int:
    """Set torch's intra-op threads (`choose_threads`) and return the number set."""
    import torch  # the caller runs torch already; imported here to keep this module light

    chosen = choose_threads(threads, processes)
    torch.set_num_threads(chosen)
    return chosen
