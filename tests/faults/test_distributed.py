"""Distributed faults on 127.0.0.1 with gloo ranks under torchrun: a rank stopped with
SIGSTOP, a node killed with SIGKILL, the torchrun launcher killed. Each ends in bounded time,
with a non-zero exit status and no process left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

import cat
from cat.testing.processes import ProcessTree, command_line, environment_of, wait_until
from cat.testing.training import write_tiny_experiment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                 reason="needs Linux /proc")]

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
START_SECONDS = 180
STALL_SECONDS = 5
# torchrun gives a rank that ignores SIGTERM (a stopped one) 30 s before SIGKILL.
STALL_END_SECONDS = STALL_SECONDS + 30 + 60
NODE_LOSS_END_SECONDS = 60
GONE_WITHIN_SECONDS = 10


def _torchrun(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *arguments, "-m", "cat.ctc.train",
            "exp/tiny"]


def _updates_logged(root: Path, count: int) -> bool:
    """Rank 0 has logged `count` updates (5 scalars each)."""
    scalars = root / "exp/tiny/log/scalars.jsonl"
    return scalars.is_file() and len(scalars.read_text().splitlines()) >= 5 * count


def _ranks(tree: ProcessTree) -> dict[int, int]:
    """Training processes of a torchrun by rank."""
    ranks = {}
    for pid in tree.remember():
        if "torch.distributed.run" not in command_line(pid):
            rank = environment_of(pid).get("RANK")
            if rank is not None:
                ranks[int(rank)] = pid
    return ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_end(tree: ProcessTree, seconds: float) -> float:
    """Seconds until the command ended; fails (with its output) past `seconds`."""
    began = time.monotonic()
    if not wait_until(lambda: tree.process.poll() is not None, seconds, 0.2):
        raise AssertionError(f"still running {seconds} s after the fault:\n"
                             f"{tree.output()[-4000:]}")
    return time.monotonic() - began


def test_a_stopped_rank_ends_the_job_with_an_error_naming_it(tmp_path):
    write_tiny_experiment(tmp_path, options={
        "epochs": 100000, "stall_seconds": STALL_SECONDS, "dist_timeout_seconds": 120})
    command = _torchrun("--standalone", "--nproc-per-node=2")
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: _updates_logged(tmp_path, 3) and len(_ranks(tree)) == 2,
                      START_SECONDS, "3 updates on 2 ranks")
        os.kill(_ranks(tree)[1], signal.SIGSTOP)
        seconds = _wait_end(tree, STALL_END_SECONDS)
        output = tree.output()
        assert tree.process.returncode != 0, output[-4000:]
        assert "rank 1 stopped responding" in output, output[-4000:]
        assert "watchdog of rank 0 (" in output
        assert "train.option.stall_seconds=5" in output
        print(f"job ended {seconds:.1f} s after SIGSTOP of rank 1")


@pytest.mark.parametrize("victim", ["rendezvous host", "other node"])
def test_a_killed_node_ends_the_survivor(tmp_path, victim):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 100000})
    experiment.use_shards()
    port = _free_port()
    command = _torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=faults",
                        "--max-restarts=0")
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT))
        # The first launcher up serves the rendezvous store.
        wait_until(lambda: len(host.remember()) > 0 or host.process.poll() is not None, 30)
        other = stack.enter_context(ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT))
        host.wait_for(lambda: _updates_logged(tmp_path, 3) and len(_ranks(host)) == 1
                      and len(_ranks(other)) == 1, START_SECONDS, "3 updates on 2 nodes")
        dead, survivor = (host, other) if victim == "rendezvous host" else (other, host)
        node = [dead.process.pid, *dead.remember()]
        for pid in node:  # the whole node at once: launcher and rank
            os.kill(pid, signal.SIGKILL)
        seconds = _wait_end(survivor, NODE_LOSS_END_SECONDS)
        assert survivor.process.returncode != 0, survivor.output()[-4000:]
        assert wait_until(lambda: not survivor.remember(), GONE_WITHIN_SECONDS), \
            "the survivor's rank outlived its launcher"
        print(f"survivor ended {seconds:.1f} s after the {victim} was killed")


def test_ranks_end_with_their_killed_launcher(tmp_path):
    write_tiny_experiment(tmp_path, options={"epochs": 100000})
    command = _torchrun("--standalone", "--nproc-per-node=2")
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: _updates_logged(tmp_path, 3) and len(_ranks(tree)) == 2,
                      START_SECONDS, "3 updates on 2 ranks")
        survivors = tree.kill_parent_and_wait(GONE_WITHIN_SECONDS)
        assert not survivors, f"alive after kill -9 of torchrun: {sorted(survivors.values())}"
