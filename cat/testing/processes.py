"""Process trees for fault tests (Linux `/proc`): find a command's descendants, kill the
command with SIGKILL, and see which descendants outlive it.

A descendant is remembered by `(pid, start time)`, so a pid reused by an unrelated
process after the original ended is not taken for a survivor; zombies count as gone.

Usage:
    with ProcessTree.start([sys.executable, "-m", "cat.formats.prep_wds", ...], cwd=root) as tree:
        tree.wait_for(lambda: len(tree.remember()) >= 3, 60, "three worker processes")
        survivors = tree.kill_parent_and_wait(timeout=10)
    assert not survivors
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of `/proc/<pid>/stat` after the command name (state first), or None."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2:].split()


def process_identity(pid: int) -> tuple[int, int] | None:
    """`(pid, start time in clock ticks)` of a running (non-zombie) process, or None."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return pid, int(fields[19])


def parent_of(pid: int) -> int | None:
    """Parent pid of `pid`, or None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def command_line(pid: int) -> str:
    """The command line of `pid` (empty when gone)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def environment_of(pid: int) -> dict[str, str]:
    """The environment `pid` started with (empty when unreadable)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode("utf-8", "replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def descendants(pid: int) -> list[int]:
    """Pids of the live processes below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None and process_identity(int(entry.name)) is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return sorted(found)


def alive(identities: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The `(pid, start time)` of `identities` still running."""
    return [identity for identity in identities if process_identity(identity[0]) == identity]


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def as_from_a_terminal() -> None:
    """`preexec_fn` of a command the tests start as a terminal starts a foreground job:
    SIGINT and SIGQUIT at their defaults. A shell's background job (`cmd &`, how CI runners
    and nohup start the test suite) has them ignored, the children inherit that, and a
    Python started so never turns Ctrl-C into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class ProcessTree:
    """A command started in its own session, and the descendants seen while it ran."""

    def __init__(self, process: subprocess.Popen, log: IO[str]) -> None:
        self.process = process
        self.log = log
        self.seen: dict[tuple[int, int], str] = {}

    @classmethod
    @contextlib.contextmanager
    def start(cls, command: Sequence[str], **popen: object) -> Iterator[ProcessTree]:
        """Run `command` (output to a temporary file, see `output()`); on exit, SIGKILL
        whatever of it is left (the command, and every descendant it was seen with)."""
        with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
            popen.setdefault("preexec_fn", as_from_a_terminal)
            process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True, **popen)
            tree = cls(process, log)
            try:
                yield tree
            finally:
                tree.remember()
                for pid, _ in alive(list(tree.seen)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.kill()
                process.wait()

    def remember(self) -> list[int]:
        """Record the command's current descendants; returns their pids."""
        pids = descendants(self.process.pid)
        for pid in pids:
            identity = process_identity(pid)
            if identity is not None:
                self.seen.setdefault(identity, command_line(pid))
        return pids

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until `condition` holds (remembering descendants meanwhile), else fail."""
        def check() -> bool:
            self.remember()
            if self.process.poll() is not None:
                raise AssertionError(f"the command ended ({self.process.returncode}) before "
                                     f"{what}:\n{self.output()[-3000:]}")
            return condition()

        if not wait_until(check, timeout, 0.2):
            raise AssertionError(f"no {what} within {timeout} s:\n{self.output()[-3000:]}")

    def kill_parent_and_wait(self, timeout: float) -> dict[tuple[int, int], str]:
        """SIGKILL the command alone; wait up to `timeout` s for the descendants seen to
        end. Returns the survivors (identity -> command line)."""
        self.remember()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        wait_until(lambda: not alive(list(self.seen)), timeout, 0.2)
        return {identity: self.seen[identity] for identity in alive(list(self.seen))}

    def output(self) -> str:
        """What the command (and its descendants) printed so far."""
        self.log.flush()
        with open(self.log.fileno(), encoding="utf-8", errors="replace", closefd=False) as f:
            return f.read() if f.seek(0) == 0 else ""


def advance_progress(count: int, delay: float = 0.0) -> int:
    """A pool task: `count` steps of `delay` seconds, each reported to the parent's
    `cat.core.progress.WorkerProgress`; returns `count`."""
    from cat.core.progress import advance

    for _ in range(count):
        time.sleep(delay)
        advance(1)
    return count


def run_bounded(command: Sequence[str], cwd: Path, env: dict[str, str], timeout: float,
                what: str) -> subprocess.CompletedProcess:
    """Run `command` in its own session with stdout and stderr captured together; one that
    outlives `timeout` seconds is killed with its children and fails, naming `what`."""
    process = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{what} ran over {timeout} s:\n{output[-3000:]}") from None
    return subprocess.CompletedProcess(list(command), process.returncode, output)
