"""Map-style training data: pack dataset, length filter, bucketing batch sampler, collate.

Used for corpora whose features fit the page cache (`train.option.large_dataset: false`);
the streaming path (`cat.loading.stream`) shares `LengthFilter`, `Batch` and `collate`.

* `PackDataset` reads one utterance of a stage-2 map pack (`cat.formats.mappack.MapPack`) by
  index: `(key, features [T, D], label ids)`.
* `LengthFilter` decides which utterances a model can train on: frames inside the
  `filter` range `[lo, hi)`, at least one encoder frame after subsampling, and, for CTC,
  encoder frames >= label length + adjacent repeats (what CTC needs to emit the labels).
  The subsampling comes from the model (`encoder_frame_table`).
* `BucketBatchSampler` forms batches by a padded-frame budget: utterances are sorted by
  length (ties broken at random per epoch), cut greedily into batches with
  `longest * count <= max_frames` and `count <= batch_size`, the batch list is shuffled
  with a generator seeded by `(seed, epoch)`, and dealt round-robin to the ranks. Every
  rank gets `len(batches) // world_size` batches, so all ranks take the same number of
  steps by construction; the `len(batches) % world_size` batches left over are not
  trained this epoch and are counted (a different set each epoch). The order depends only
  on `(seed, epoch, world_size)`, so `set_epoch(epoch, start)` resumes at batch `start`.
* `collate` pads a list of utterances into a `Batch`: features with 0.0, labels with 0
  (the blank id), lengths as int64.

Usage:
    dataset = PackDataset("exp/asr/pack/train.npz", feat_dim=80)
    sampler = BucketBatchSampler(dataset.num_frames, keep, batch_size=64, max_frames=20000,
                                 seed=0, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from cat.core.io import PathLike
from cat.features.fbank import FbankOptions, batch_fbank, num_frames
from cat.formats.mappack import MapPack
from cat.formats.tables import FrameRange, feature_verdict


class Utterance(NamedTuple):
    """One utterance ready for collation; `sample_id` (streaming: `(shard << 32) |
    position in the shard`) is -1 outside the streaming path. `features` is the feature
    matrix [T, D], or int16 samples [S] when the training device computes the fbank."""

    key: str
    features: np.ndarray
    label: np.ndarray
    sample_id: int = -1


# --------------------------------------------------------------------------- batches


@dataclasses.dataclass
class StreamEvents:
    """What the streaming pipeline did besides producing utterances, since the last batch.

    `dropped`: `(key, reason, shard)` for utterances left out (reason may carry a detail
    after a space); `finished`: `(shard, utterances read)` when a shard's tar ended;
    `corrupt`: `(shard, message)` for a shard whose data is corrupt or does not match its
    index; `unavailable`: `(shard, message)` for a shard its storage did not deliver;
    `position`: where the worker's stream stands after this batch
    (`cat.loading.stream.WorkerPosition`); `noted`: how many kept utterances had each
    note (audio converted: resampled or down-mixed; a transcript with `<unk>` tokens).
    """

    dropped: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    finished: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    corrupt: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    unavailable: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    position: Any = None
    noted: dict[str, int] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.dropped or self.finished or self.corrupt or self.unavailable
                    or self.noted)

    def drain(self) -> StreamEvents:
        """Move everything recorded so far into a new object and return it."""
        moved = StreamEvents(self.dropped, self.finished, self.corrupt, self.unavailable,
                             self.position, self.noted)
        self.dropped, self.finished, self.corrupt, self.unavailable = [], [], [], []
        self.position = None
        self.noted = {}
        return moved


@dataclasses.dataclass
class Batch:
    """A padded batch. `ids` (streaming only) gives each utterance's sample id (see
    `Utterance`); `events` carries the pipeline's accounting since the previous batch. A
    batch may hold no utterance when it only delivers events (at the end of a worker's
    stream).

    A batch of audio whose features the training device computes holds `waves` (int16
    [B, S], padded with 0) and `wave_lens` instead of `feats`, with the `fbank` options
    to compute them with; `featurize` (after `to(device)`) turns it into an ordinary
    batch. `feat_lens` are the frame counts either way, so batching and accounting never
    ask which kind a batch is.
    """

    keys: list[str]
    feats: torch.Tensor | None  # [B, T, D] float32, padded with 0.0 (None: `waves`)
    feat_lens: torch.Tensor  # [B] int64
    labels: torch.Tensor  # [B, U] int64, padded with 0 (blank)
    label_lens: torch.Tensor  # [B] int64
    ids: np.ndarray | None = None
    events: StreamEvents | None = None
    waves: torch.Tensor | None = None  # [B, S] int16, padded with 0
    wave_lens: torch.Tensor | None = None  # [B] int64
    fbank: FbankOptions | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def num_frames(self) -> int:
        """Unpadded input frames."""
        return int(self.feat_lens.sum())

    @property
    def padded_frames(self) -> int:
        """Input frames with the padding: utterances x the longest."""
        return len(self) * int(self.feat_lens.max()) if len(self) else 0

    def pin_memory(self) -> Batch:
        """Page-locked copy of the speech (DataLoader `pin_memory=True` calls this)."""
        return dataclasses.replace(self, **{
            name: getattr(self, name).pin_memory() for name in ("feats", "waves")
            if getattr(self, name) is not None})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its speech (`feats` or `waves`) on `device`. Lengths and labels
        stay on the host: the model checks and counts them there and copies what its
        loss needs itself (`cat.models.model.AsrModel.forward`), so that neither the
        trainer nor the model waits for the device to read them."""
        speech = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                  for name in ("feats", "waves") if getattr(self, name) is not None}
        return dataclasses.replace(self, **speech)

    def featurize(self) -> Batch:
        """The batch with `feats` computed from `waves` on their device
        (`cat.features.fbank.batch_fbank`, the workers' features within 1e-4); a batch
        that has its features comes back as it is."""
        if self.waves is None:
            return self
        if not len(self):
            feats = torch.zeros(0, 0, self.fbank.num_mel_bins, device=self.waves.device)
        else:
            feats = batch_fbank(self.waves, self.wave_lens, self.fbank,
                                num_frames(self.waves.size(1), self.fbank))
        return dataclasses.replace(self, feats=feats, waves=None, wave_lens=None, fbank=None)

    def __reduce__(self) -> tuple:
        # DataLoader workers send batches with torch's pickler, which moves every tensor
        # into its own shared-memory file and hands its descriptor over a fresh
        # authenticated connection; the small CPU tensors travel by value instead
        # (measured: 1.6 -> 0.85 ms per batch handed over, the features aside).
        small = [t.numpy() if t is not None and t.device.type == "cpu" else t
                 for t in (self.feat_lens, self.labels, self.label_lens, self.wave_lens)]
        return (_rebuild_batch, (self.keys, self.feats, *small[:3], self.ids, self.events,
                                 self.waves, small[3], self.fbank))


def _rebuild_batch(keys: list[str], feats: torch.Tensor | None, *rest: Any) -> Batch:
    def tensor(value: Any) -> Any:
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    feat_lens, labels, label_lens, ids, events, waves, wave_lens, fbank = rest
    return Batch(keys, feats, tensor(feat_lens), tensor(labels), tensor(label_lens), ids,
                 events, waves, tensor(wave_lens), fbank)


def empty_batch(feat_dim: int, events: StreamEvents | None = None) -> Batch:
    """A batch without utterances (carries events only)."""
    return Batch([], torch.zeros(0, 0, feat_dim), torch.zeros(0, dtype=torch.int64),
                 torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                 np.zeros(0, np.int64), events)


def padded_shape(utterances: Sequence[Utterance]) -> tuple[int, ...]:
    """The padded shape of a batch's speech: `(utterances, longest, feature dimension)`
    of features, `(utterances, longest)` of waveforms (1-D `features`)."""
    longest = max((len(u.features) for u in utterances), default=0)
    if utterances and utterances[0].features.ndim == 1:
        return len(utterances), longest
    return len(utterances), longest, utterances[0].features.shape[1] if utterances else 0


def padded_bytes(utterances: Sequence[Utterance]) -> int:
    """Bytes of the padded speech `collate` makes of `utterances`."""
    itemsize = 2 if utterances and utterances[0].features.ndim == 1 else 4
    return math.prod(padded_shape(utterances)) * itemsize


def collate(utterances: Sequence[Utterance], events: StreamEvents | None = None,
            out: np.ndarray | None = None, fbank: FbankOptions | None = None) -> Batch:
    """Pad utterances into a `Batch` (float16 features become float32 here).

    With `fbank` the utterances hold int16 waveforms (1-D), padded into `waves` for the
    training device to compute these fbank options' features (`Batch.featurize`);
    `feat_lens` are then their frame counts. `out`: flat memory (any dtype, at least
    `padded_bytes`) to pad the speech into (`cat.loading.transport` passes a
    shared-memory slot); new memory by default.
    """
    if not utterances:
        raise ValueError("cannot collate an empty list of utterances")
    label_lens = np.fromiter((len(u.label) for u in utterances), np.int64, len(utterances))
    labels = np.zeros((len(utterances), int(label_lens.max(initial=0))), np.int64)
    for row, utterance in enumerate(utterances):
        labels[row, :label_lens[row]] = utterance.label
    ids = np.fromiter((u.sample_id for u in utterances), np.int64, len(utterances))
    lengths = np.fromiter((len(u.features) for u in utterances), np.int64, len(utterances))
    tensors = (torch.from_numpy(labels), torch.from_numpy(label_lens), ids, events)
    keys = [u.key for u in utterances]
    if fbank is not None:
        waves = _pad_waveforms(utterances, lengths, out)
        frames = np.fromiter((num_frames(int(n), fbank) for n in lengths), np.int64,
                             len(lengths))
        return Batch(keys, None, torch.from_numpy(frames), *tensors, waves,
                     torch.from_numpy(lengths), fbank)
    return Batch(keys, _pad_features(utterances, lengths, out), torch.from_numpy(lengths),
                 *tensors)


def _padded_array(shape: tuple[int, ...], dtype: type, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    memory = out.reshape(-1).view(np.uint8)
    return memory[:math.prod(shape) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def _pad_waveforms(utterances: Sequence[Utterance], lengths: np.ndarray,
                   out: np.ndarray | None) -> torch.Tensor:
    waves = _padded_array(padded_shape(utterances), np.int16, out)
    for row, utterance in enumerate(utterances):
        if utterance.features.ndim != 1 or utterance.features.dtype != np.int16:
            raise ValueError(f"utterance {utterance.key!r}: expected int16 samples to compute "
                             f"fbank on the device, got {utterance.features.dtype} of shape "
                             f"{utterance.features.shape}")
        waves[row, :lengths[row]] = utterance.features
        waves[row, lengths[row]:] = 0
    return torch.from_numpy(waves)


def _pad_features(utterances: Sequence[Utterance], lengths: np.ndarray,
                  out: np.ndarray | None) -> torch.Tensor:
    feats = _padded_array(padded_shape(utterances), np.float32, out)
    tensor = torch.from_numpy(feats)
    # One pass per utterance, the cast fused in; only the padding is zeroed (batches cut
    # from sorted buffers pad little).
    for row, utterance in enumerate(utterances):
        length = lengths[row]
        source = utterance.features
        if source.dtype == np.float16 and source.flags.writeable:
            # numpy casts float16 one value at a time, torch with vector instructions (4-8x
            # faster: bench/collate.py); torch cannot view a read-only array.
            tensor[row, :length].copy_(torch.from_numpy(source))
        else:
            feats[row, :length] = source
        feats[row, length:] = 0.0
    return tensor


# --------------------------------------------------------------------------- length filter


def label_repeats(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Adjacent equal ids within each label sequence (flat `labels`, `offsets` of N+1)."""
    equal = np.zeros(len(labels), np.int64)
    if len(labels) > 1:
        equal[1:] = labels[1:] == labels[:-1]
    # The first id of a sequence never repeats its predecessor.
    starts = offsets[:-1][offsets[:-1] < len(labels)]
    equal[starts] = 0
    cumulative = np.concatenate([[0], np.cumsum(equal)])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


@dataclasses.dataclass
class LengthFilter:
    """Which utterances a model can train on (picklable; see the module docstring).

    `encoder_frames[t]` is the encoder output length for `t` input frames; longer inputs
    extrapolate with `frame_rate_factor`. `ctc` adds CTC's label-length requirement.
    """

    frame_range: FrameRange | None
    encoder_frames: np.ndarray
    frame_rate_factor: int
    ctc: bool

    def output_frames(self, num_frames: np.ndarray | int) -> np.ndarray:
        """Encoder frames for inputs of `num_frames` frames."""
        num_frames = np.asarray(num_frames, np.int64)
        last = len(self.encoder_frames) - 1
        inside = np.minimum(num_frames, last)
        beyond = np.maximum(num_frames - last, 0) // self.frame_rate_factor
        return self.encoder_frames[inside] + beyond

    def reasons(self, num_frames: np.ndarray, label_lengths: np.ndarray,
                repeats: np.ndarray) -> np.ndarray:
        """Per utterance: "" when kept, else a drop reason with its detail."""
        num_frames = np.asarray(num_frames, np.int64)
        out = np.full(len(num_frames), "", dtype=object)
        encoder = self.output_frames(num_frames)
        if self.ctc:
            needed = np.asarray(label_lengths) + np.asarray(repeats)
            for i in np.flatnonzero(encoder < needed):
                out[i] = (f"label_too_long encoder_frames={encoder[i]} "
                          f"labels+repeats={needed[i]}")
        for i in np.flatnonzero(encoder < 1):
            out[i] = f"no_encoder_frames num_frames={num_frames[i]}"
        if self.frame_range is not None:
            for i in np.flatnonzero(~self.frame_range.mask(num_frames)):
                out[i] = f"out_of_range num_frames={num_frames[i]} range=[{self.frame_range})"
        return out

    def reason(self, num_frames: int, label: np.ndarray) -> str:
        """Drop reason of one utterance, "" when it is kept."""
        if self.frame_range is not None and num_frames not in self.frame_range:
            return f"out_of_range num_frames={num_frames} range=[{self.frame_range})"
        encoder = int(self.output_frames(num_frames))
        if encoder < 1:
            return f"no_encoder_frames num_frames={num_frames}"
        if self.ctc:
            needed = len(label) + int(np.count_nonzero(label[1:] == label[:-1]))
            if encoder < needed:
                return f"label_too_long encoder_frames={encoder} labels+repeats={needed}"
        return ""


# --------------------------------------------------------------------------- dataset


class PackDataset(torch.utils.data.Dataset):
    """Utterances of a map pack by index; features are checked against `feat_dim`."""

    def __init__(self, pack: MapPack | PathLike, feat_dim: int,
                 feat_dim_source: str = "idim") -> None:
        self.pack = pack if isinstance(pack, MapPack) else MapPack(pack)
        self.feat_dim = feat_dim
        self.feat_dim_source = feat_dim_source

    def __len__(self) -> int:
        return len(self.pack)

    @property
    def num_frames(self) -> np.ndarray:
        """Frames per utterance (int32)."""
        return self.pack.num_frames

    def __getitem__(self, index: int) -> Utterance:
        features = self.pack.features(index)
        if features.ndim != 2 or features.shape[1] != self.feat_dim:
            raise ValueError(f"{self.pack.path}: utterance {self.pack.key(index)!r} has "
                             f"features of shape {features.shape}, but {self.feat_dim_source} "
                             f"is {self.feat_dim}")
        reason = feature_verdict(features)
        if reason:
            # Packs of this version never hold them (stage 2 drops them as non_finite).
            raise ValueError(f"{self.pack.path}: utterance {self.pack.key(index)!r} has "
                             f"non-finite features ({reason.partition(' ')[2]}); pack it "
                             "again (stage 2 drops such utterances as 'non_finite')")
        return Utterance(self.pack.key(index), features, self.pack.label(index))

    def filter_reasons(self, length_filter: LengthFilter) -> np.ndarray:
        """Drop reason of every utterance ("" = kept)."""
        return length_filter.reasons(self.pack.num_frames, self.pack.label_lengths,
                                     label_repeats(self.pack.labels, self.pack.label_offsets))


# --------------------------------------------------------------------------- batch sampler


def form_batches(num_frames: np.ndarray, order: np.ndarray, batch_size: int,
                 max_frames: int) -> list[np.ndarray]:
    """Cut `order` (indices, ascending length) into batches within the budgets."""
    batches: list[np.ndarray] = []
    start = 0
    lengths = num_frames[order]
    for position in range(len(order)):
        count = position - start + 1
        # Lengths ascend, so the newest utterance is the longest of the batch.
        if count > batch_size or (max_frames and count > 1
                                  and int(lengths[position]) * count > max_frames):
            batches.append(order[start:position])
            start = position
    if start < len(order):
        batches.append(order[start:])
    return batches


class BucketBatchSampler(torch.utils.data.Sampler):
    """Length-bucketed, frame-budgeted, distributed batches (see the module docstring).

    `indices`: the utterances to use (the rest were filtered out). With `shuffle=False`
    (evaluation) batches keep length order and every batch is dealt (ranks may then get
    different counts; nothing is left over).
    """

    def __init__(self, num_frames: np.ndarray, indices: np.ndarray, batch_size: int,
                 max_frames: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.num_frames = np.asarray(num_frames)
        self.indices = np.asarray(indices, np.int64)
        self.batch_size = batch_size
        self.max_frames = max_frames
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 1
        self.start = 0
        self._cache: tuple[int, Any] | None = None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip its first `start` batches of this rank."""
        self.epoch = epoch
        self.start = start

    def plan(self, epoch: int) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
        """Batches of every rank for `epoch`, and the batches left over (cached per epoch)."""
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._plan(epoch))
        return self._cache[1]

    def _plan(self, epoch: int) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = self.indices[np.lexsort((rng.random(len(self.indices)),
                                             self.num_frames[self.indices]))]
        else:
            order = self.indices[np.argsort(self.num_frames[self.indices], kind="stable")]
        batches = form_batches(self.num_frames, order, self.batch_size, self.max_frames)
        if not self.shuffle:
            return [batches[r::self.world_size] for r in range(self.world_size)], []
        batches = [batches[i] for i in rng.permutation(len(batches))]
        per_rank = len(batches) // self.world_size
        dealt = per_rank * self.world_size
        return ([batches[r:dealt:self.world_size] for r in range(self.world_size)],
                batches[dealt:])

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.plan(self.epoch)[0][self.rank][self.start:]:
            yield batch.tolist()

    def __len__(self) -> int:
        return max(0, len(self.plan(self.epoch)[0][self.rank]) - self.start)

    def state(self) -> dict[str, Any]:
        """What decides the order (recorded in checkpoints)."""
        return {"seed": self.seed, "world_size": self.world_size,
                "num_utts": len(self.indices)}
