"""The SeaweedFS fixture factory: it serves S3, stops, and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cat.testing.seaweedfs import seaweedfs_s3

BOUND_SECONDS = 60


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A killed child of ours stays a zombie until reaped; it no longer runs.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1].startswith("Z")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + BOUND_SECONDS
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_server_serves_the_uploaded_folder_and_stops(tmp_path):
    (tmp_path / "upload" / "a").mkdir(parents=True)
    (tmp_path / "upload" / "a" / "x.tar").write_bytes(b"payload")
    with seaweedfs_s3(tmp_path / "server") as server:
        server.create_bucket("corpus")
        assert server.upload_folder(tmp_path / "upload", "corpus", "p") == [
            "s3://corpus/p/a/x.tar"]
        body = server.client().get_object(Bucket="corpus", Key="p/a/x.tar")["Body"].read()
        assert body == b"payload"
        pid = server.process.pid
        grpc_ports = server.grpc_ports
    assert _wait_gone(pid)
    assert not any(Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").exists()
                   for kind, port in grpc_ports.items())


@pytest.mark.slow
def test_server_dies_with_the_process_that_started_it(tmp_path):
    script = (
        "import sys, time\n"
        "from cat.testing.seaweedfs import start_seaweedfs\n"
        f"server = start_seaweedfs({str(tmp_path / 'server')!r})\n"
        "print(server.process.pid, *server.grpc_ports.items(), flush=True)\n"
        "time.sleep(600)\n"
    )
    sockets: list[Path] = []
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        line = parent.stdout.readline()
        assert line.split() and line.split()[0].isdigit(), "the server did not start"
        server_pid = int(line.split()[0])
        sockets = [Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
                   for kind, port in re.findall(r"\('(\w+)', (\d+)\)", line)]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=BOUND_SECONDS)
        assert _wait_gone(server_pid), "the server outlived the process that started it"
    finally:
        # Killed, the server could not remove its sockets; nobody else uses these names.
        for socket_path in sockets:
            socket_path.unlink(missing_ok=True)
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=BOUND_SECONDS)
        parent.stdout.close()
