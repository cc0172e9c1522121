"""Writing one tar shard: its members in order, atomically, with its CRC-32.

`write_shard(job)` reads each utterance's features from its ark (checked against the
frame count the index will list), converts them to the shard's dtype, and writes
`<key>.npy` + `<key>.txt` members with fixed metadata (no clock, no user), so that a
shard is a function of its contents; the tar goes to a temporary name and is renamed
when complete.

Usage:
    result = write_shard(ShardJob("data/wds/train/data-00000.tar", entries, "float32"))
"""

from __future__ import annotations

import dataclasses
import io
import logging
import tarfile
import zlib
from typing import Any

import kaldiio
import numpy as np

from cat.core.io import atomic_write
from cat.formats.shard_format import encode_key
from cat.formats.tables import feature_verdict

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- shard writing


@dataclasses.dataclass
class ShardJob:
    """One tar to write: `(utt, '<ark>:<offset>', text, frames)` per entry, in tar order.

    `fingerprint` identifies the inputs (entries, dtype, ark sizes and times), so that a
    re-run can tell whether an existing shard is still what it would write.
    """

    path: str
    entries: list[tuple[str, str, str, int]]
    dtype: str = "float32"
    fingerprint: str = ""


class ChecksumWriter:
    """File wrapper counting the bytes written through it and their CRC-32."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.crc32 = 0
        self.size = 0

    def write(self, data) -> int:
        # CRC-32 rather than SHA-256: it catches corruption at ~4x the speed (measured
        # 2.2 vs 0.6 GB/s), and the shards need no protection against tampering.
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.size


def add_member(tar: tarfile.TarFile, name: str, data: io.BytesIO | bytes) -> None:
    """Append a member holding `data` (bytes, or a buffer positioned at its end)."""
    if isinstance(data, bytes):
        data = io.BytesIO(data)
        data.seek(0, io.SEEK_END)
    # Fixed metadata (no clock, no user) makes the tar a function of its contents.
    info = tarfile.TarInfo(name)
    info.size = data.tell()
    info.mtime = 0
    info.mode = 0o444
    info.uname = info.gname = "cat"
    data.seek(0)
    tar.addfile(info, data)


def write_shard(job: ShardJob) -> dict[str, Any]:
    """Write one shard atomically; returns `num_bytes`, `crc32`, `feat_dim` and
    `dropped`, the keys left out for non-finite feature values (`feature_verdict`).

    The tar is written with the standard library rather than webdataset's TarWriter:
    importing webdataset imports torch, which costs seconds in every worker.
    """
    dtype = np.dtype(job.dtype)
    handles: dict[str, Any] = {}
    feat_dim = None
    dropped: list[list[str]] = []
    try:
        with atomic_write(job.path, "wb") as raw:
            sink = ChecksumWriter(raw)
            # 1 MiB copies instead of the 16 KiB default: fewer Python calls per member.
            with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT,
                              copybufsize=1 << 20) as tar:
                for key, location, text, frames in job.entries:
                    array = _read_features(key, location, frames, dtype, handles)
                    verdict = feature_verdict(array)
                    if verdict:
                        dropped.append([key, verdict])
                        continue
                    if feat_dim is None:
                        feat_dim = array.shape[1]
                    elif array.shape[1] != feat_dim:
                        raise ValueError(f"{location}: utterance {key!r} has {array.shape[1]}-"
                                         f"dim features, earlier ones {feat_dim}-dim")
                    name = encode_key(key)
                    member = io.BytesIO()
                    np.lib.format.write_array(member, array, allow_pickle=False)
                    add_member(tar, f"{name}.npy", member)
                    member = io.BytesIO()
                    member.write(text.encode("utf-8"))
                    add_member(tar, f"{name}.txt", member)
    finally:
        for handle in handles.values():
            handle.close()
    return {"num_bytes": sink.size, "crc32": f"{sink.crc32:08x}", "feat_dim": feat_dim,
            "dropped": dropped}


def _read_features(key: str, location: str, frames: int, dtype: np.dtype,
                   handles: dict[str, Any]) -> np.ndarray:
    try:
        matrix = kaldiio.load_mat(location, fd_dict=handles)
    except Exception as error:  # kaldiio signals bad data with asserts, struct and OS errors
        raise ValueError(f"{location}: cannot read the features of {key!r}: "
                         f"{type(error).__name__}: {error}") from error
    if matrix.ndim != 2 or matrix.shape[0] != frames:
        raise ValueError(f"{location}: utterance {key!r} has shape {matrix.shape}, expected "
                         f"{frames} frames (stale utt2num_frames?)")
    array = np.ascontiguousarray(matrix, dtype=dtype)
    if dtype != matrix.dtype and not np.isfinite(array).all() and np.isfinite(matrix).all():
        raise ValueError(f"{location}: utterance {key!r} overflows {dtype}")
    return array
