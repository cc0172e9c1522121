"""Samples of the streaming loader: ids, the features codec, settings, worker positions.

* A sample's id is `(shard << 32) | ordinal`, its shard's index in the shard list and its
  place (0-based, tar order) in the shard (`sample_id`, `split_ids`); `key_hash` is the
  64-bit hash by which keys of shards without an index are compared.
* `decode_npy`: the features of a `.npy` member as a view on its bytes.
* `StreamConfig`: buffer sizes and policies of the pipeline (`train.option`);
  `AudioConfig`: how audio members become features (`train.option.audio`).
* `WorkerPosition`: where one worker's stream stands after a batch, which is what an
  exact resume needs (see `cat.loading.stream`).

Usage:
    shard, ordinal = split_ids(np.array([sample_id(3, 17)]))
    features = decode_npy(member_bytes)  # [frames, dim]
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from cat.audio.codec import READ_EXTENSIONS
from cat.features.fbank import FbankOptions
from cat.formats.shard_format import HTTP_TIMEOUT_SECONDS

logger = logging.getLogger(__name__)

ORDINAL_BITS = 32
_ORDINAL_MASK = (1 << ORDINAL_BITS) - 1
#: The member of a sample that holds its transcript.
TRANSCRIPT = "txt"
#: Members a sample holds its speech in, one of: features, or audio (`AudioConfig`).
AUDIO_TYPES = READ_EXTENSIONS
CONTENT_TYPES = ("npy", *AUDIO_TYPES)
#: Every member the loader reads (others are passed over).
MEMBER_TYPES = (TRANSCRIPT, *CONTENT_TYPES)
_NPY_MAGIC = b"\x93NUMPY"
# numpy writes this exact layout; anything else goes through numpy's own parser.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<|]f[248])', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n")
_NPY_DTYPES = {b"<f4": np.dtype("<f4"), b"<f2": np.dtype("<f2"), b"<f8": np.dtype("<f8")}


def missing_members(sample: Mapping[str, Any]) -> list[str]:
    """What a sample lacks of a transcript and one speech member (features or audio)."""
    missing = [] if TRANSCRIPT in sample else [f".{TRANSCRIPT}"]
    if not any(t in sample for t in CONTENT_TYPES):
        missing.append("." + "|.".join(CONTENT_TYPES))
    return missing


def sample_id(shard: int, ordinal: int) -> int:
    """The id of the `ordinal`-th sample (0-based, tar order) of shard `shard`."""
    return (shard << ORDINAL_BITS) | ordinal


def key_hash(key: str) -> int:
    """A 64-bit hash of an utterance key (signed, as int64 arrays hold it)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(shards, ordinals)` of sample ids."""
    ids = np.asarray(ids, np.int64)
    return ids >> ORDINAL_BITS, ids & _ORDINAL_MASK


def decode_npy(data: bytes) -> np.ndarray:
    """A 2-D float array from .npy bytes (a view on `data` when possible)."""
    if data[:6] != _NPY_MAGIC:
        raise ValueError("not .npy data")
    if data[6] == 1:
        start = 10 + int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.fullmatch(data, 10, start)
    else:
        start = 12 + int.from_bytes(data[8:12], "little")
        match = _NPY_HEADER.fullmatch(data, 12, start)
    if match is None:
        array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
        if array.ndim != 2 or array.dtype.kind != "f":
            raise ValueError(f"expected a 2-D float matrix, got {array.dtype} {array.shape}")
        return array
    dtype = _NPY_DTYPES[match.group(1).replace(b"|", b"<")]
    rows, cols = int(match.group(2)), int(match.group(3))
    if len(data) - start != rows * cols * dtype.itemsize:
        raise ValueError(f"{len(data) - start} data bytes for shape ({rows}, {cols}) "
                         f"{dtype}: truncated")
    return np.frombuffer(data, dtype, rows * cols, start).reshape(rows, cols)


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """How audio members (`wav`, `flac`, `opus`) become features: decoded, resampled to
    `sample_rate`, speed-perturbed by a factor drawn per utterance and epoch from
    `speed_perturb` (`cat.audio.speed.choose_factor`; none when empty), then 80-dim
    Kaldi-compatible fbank with stage 1's options (`fbank`)."""

    sample_rate: int = 16000
    speed_perturb: tuple[float, ...] = ()
    fbank: FbankOptions = dataclasses.field(default_factory=FbankOptions)


@dataclasses.dataclass
class WorkerPosition:
    """Where one worker's stream stands after a batch (see the module docstring).

    `shard`, `ordinal`: the reader continues with sample `ordinal` of the `shard`-th shard
    of the worker's list. The id arrays hold the buffered samples in buffer order.
    """

    epoch: int
    worker: int
    num_workers: int
    shard: int
    ordinal: int
    shuffle: np.ndarray
    draining: bool
    sort: np.ndarray
    pending: list[np.ndarray]
    upstream_done: bool
    rng: tuple

    def buffered(self) -> np.ndarray:
        """Ids of every sample held in the buffers."""
        return np.concatenate([self.shuffle, self.sort, *self.pending])

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (`torch.load(weights_only=True)` reads it)."""
        version, words, gauss = self.rng
        return {"epoch": self.epoch, "worker": self.worker, "num_workers": self.num_workers,
                "shard": self.shard, "ordinal": self.ordinal,
                "shuffle": torch.from_numpy(self.shuffle), "draining": self.draining,
                "sort": torch.from_numpy(self.sort),
                "pending": [torch.from_numpy(b) for b in self.pending],
                "upstream_done": self.upstream_done,
                "rng": {"version": version, "words": torch.tensor(words, dtype=torch.int64),
                        "gauss": gauss}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> WorkerPosition:
        """Inverse of `to_state`."""
        rng = state["rng"]
        return cls(int(state["epoch"]), int(state["worker"]), int(state["num_workers"]),
                   int(state["shard"]), int(state["ordinal"]), state["shuffle"].numpy(),
                   bool(state["draining"]), state["sort"].numpy(),
                   [b.numpy() for b in state["pending"]], bool(state["upstream_done"]),
                   (rng["version"], tuple(rng["words"].tolist()), rng["gauss"]))


# --------------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Buffer sizes and policies of the streaming pipeline (see `train.option`)."""

    batch_size: int = 64
    max_frames: int = 20000
    shuffle_buffer: int = 3000
    sort_buffer: int = 500
    read_ahead_mb: int = 128
    strict_shards: bool = False
    seed: int = 0
    train: bool = True
    timeout: float = HTTP_TIMEOUT_SECONDS
    read_retries: int = 3
    retry_seconds: float = 1.0
    bad_shard_limit: float = 0.1
    audio: AudioConfig | None = None
