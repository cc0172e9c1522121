"""Samples of the streaming loader: ids, the features codec, settings, worker positions.

* A sample's id is `(shard << 32) | ordinal`, its shard's index in the shard list and its
  place (0-based, tar order) in the shard (`sample_id`, `split_ids`); `key_hash` is the
  64-bit hash by which keys of shards without an index are compared.
* `decode_npy`: the features of a `.npy` member as a view on its bytes.
* `StreamConfig`: buffer sizes and policies of the pipeline (`train.option`, whose keys
  and defaults it takes from the schema);
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
from cat.core import config as config_module
from cat.features.fbank import FbankOptions

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


#: Where audio becomes features (`train.option.audio.features`; `auto` is resolved by
#: `features_location`).
FEATURES_ON_WORKERS, FEATURES_ON_DEVICE = "workers", "device"


def features_location(choice: str, device: torch.device | None) -> str:
    """`workers` or `device` for a `train.option.audio.features` value: `auto` is the
    device when it is a GPU (the workers then only decode and perturb; the fbank of a
    whole batch costs the GPU next to nothing), else the workers, which run beside a
    CPU training process instead of taking its time (`bench/device_features.py`)."""
    if choice in (FEATURES_ON_WORKERS, FEATURES_ON_DEVICE):
        return choice
    if choice != "auto":
        raise ValueError(f"train.option.audio.features: {choice!r}, expected auto, "
                         f"{FEATURES_ON_DEVICE} or {FEATURES_ON_WORKERS}")
    on_gpu = device is not None and device.type != "cpu"
    return FEATURES_ON_DEVICE if on_gpu else FEATURES_ON_WORKERS


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """How audio members (`wav`, `flac`, `opus`) become features: decoded, resampled to
    `sample_rate`, speed-perturbed by a factor drawn per utterance and epoch from
    `speed_perturb` (`cat.audio.speed.choose_factor`; none when empty), then 80-dim
    Kaldi-compatible fbank with stage 1's options (`fbank`), computed by the workers
    or, when `on_device`, a batch at a time on the training device
    (`cat.loading.batch.Batch.featurize`)."""

    sample_rate: int = 16000
    speed_perturb: tuple[float, ...] = ()
    fbank: FbankOptions = dataclasses.field(default_factory=FbankOptions)
    on_device: bool = False

    @classmethod
    def from_option(cls, audio: Mapping[str, Any] | None, train: bool,
                    device: torch.device | None = None) -> AudioConfig | None:
        """`train.option.audio` (None: the shards hold features), its keys' defaults from
        the schema; for evaluation (not `train`) without speed perturbation; `device`,
        the training device, resolves `features: auto`."""
        if audio is None:
            return None
        schema = config_module.load_hyper_schema()["$defs"]["trainOption"]["properties"]
        option = {key: spec["default"] for key, spec in
                  schema["audio"]["properties"].items()} | dict(audio)
        rate = int(option["sample_rate"])
        return cls(rate, tuple(option["speed_perturb"]) if train else (),
                   FbankOptions(int(option["num_mel_bins"]), rate),
                   features_location(option["features"], device) == FEATURES_ON_DEVICE)


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


#: Seconds before the first new attempt at a shard after a transient error, doubled at
#: each further one (`cat.loading.reader.ShardReader`; `train.option.read_retries` says
#: "waiting 1, 2, 4... seconds").
RETRY_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Buffer sizes and policies of the streaming pipeline.

    Each field but the last three is the `train.option` key of the same name, defined
    (type, default, meaning) once, in the hyper-p.json schema: build a config with
    `from_options` (a resolved `TrainOptions`) or `with_defaults` (the schema's defaults
    and some changes), never field by field. `train`: training (shuffled, length-filtered,
    speed-perturbed) or evaluation; `audio`: `train.option.audio` as an `AudioConfig`;
    `retry_seconds`: `RETRY_SECONDS` (tests wait less).
    """

    batch_size: int
    max_frames: int
    shuffle_buffer: int
    sort_buffer: int
    buckets: int
    read_ahead_mb: int
    strict_shards: bool
    seed: int
    read_timeout: float
    read_retries: int
    bad_shard_limit: float
    train: bool
    audio: AudioConfig | None
    retry_seconds: float

    @classmethod
    def from_options(cls, options: Any, train: bool = True,
                     device: torch.device | None = None, **fields: Any) -> StreamConfig:
        """The settings of `options` (a `cat.core.config.TrainOptions`) for training, or
        for evaluation (not `train`: no shuffle buffer, no speed perturbation), on the
        training `device` (where `audio.features: auto` computes features); `fields`
        replace the fields that are not options (`audio`, `retry_seconds`)."""
        derived = {"train", "audio", "retry_seconds"}
        values = {field.name: getattr(options, field.name)
                  for field in dataclasses.fields(cls) if field.name not in derived}
        if not train:
            values["shuffle_buffer"] = 0
        config = cls(**values, train=train,
                     audio=AudioConfig.from_option(options.audio, train, device),
                     retry_seconds=RETRY_SECONDS)
        return dataclasses.replace(config, **fields)

    @classmethod
    def with_defaults(cls, train: bool = True, **changes: Any) -> StreamConfig:
        """`from_options` of the schema's `train.option` defaults with `changes`: option
        keys, and the fields `audio` (an `AudioConfig`) and `retry_seconds`."""
        fields = {name: changes.pop(name) for name in ("audio", "retry_seconds")
                  if name in changes}
        return cls.from_options(config_module.TrainOptions(**changes), train, **fields)
