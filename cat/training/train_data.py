"""The training manager's data: one interface, two kinds, dev data, epoch logs.

`TrainData` declares what `cat.training.manager.Manager` (and `cat.training.setup`) ask of
training data, and holds what the kinds share (epoch logs, identity changes, the epoch's
end, close). The Manager uses only it, never asking which kind it holds:

    open(...)                  the kind built from its source (`build_train_data` picks it)
    longest, kind              frames of the longest utterance; "map" or "stream"
    identity(), identity_changes(recorded)    what decides the batches, compared on resume
    feature_samples(max_utts)  utterances for the global CMVN, through the loader's stages
    start_epoch(epoch, state)  select the epoch, continuing after `state` when given
    iter(data), note(batch, trained)          the batches; what a batch taken changes
    state(), trained()         where the epoch stands (checkpoints); utterances trained
    trained_in(state)          the trained count a recorded state holds, of either kind
    steps_hint(), summary(), cut_profile(), corpus_mean_frames(), check_epoch(record)
    end_epoch(updates), close()                (close stops the loader's workers)

`MapTrainData` (map pack + `BucketBatchSampler`) and `StreamTrainData` (tar shards through
`cat.loading.stream.ShardStream`) implement it, and one contract test holds both to it
(`tests/training/test_train_data_contract.py`). `build_train_data` is the one place that
tells them apart (`train.option.large_dataset`).

Epoch logs (`EpochLog`): `exp/<name>/log/utts/epoch-<EEE>.rank-<R>.txt` lists the trained
utterances, one line per batch (with `log_utterances`), and `log/drops/` the utterances
left out (`<utt> <reason> [detail]`). A checkpoint records each log's size and a resume
cuts the log back to it before appending, so the logs of a resumed epoch are those of an
uninterrupted one: nothing written after the checkpoint by a killed run is kept twice.

Usage:
    data = build_train_data(options, length_filter_for, feat_dim, context, log_dir)
    data.start_epoch(1, None)
    for batch in data: data.note(batch, trained=True)
    data.end_epoch(updates)
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from cat.core import config as config_module
from cat.core.io import write_table
from cat.core.process import loader_worker_init
from cat.formats.mappack import MapPack
from cat.loading.batch import Batch, BucketBatchSampler, LengthFilter, PackDataset, collate
from cat.loading.prefetch import DEPTH as PREFETCH_DEPTH
from cat.loading.prefetch import Prefetcher
from cat.loading.progress import StreamProgress, length_profile
from cat.loading.reader import DataUnavailableError
from cat.loading.samples import AudioConfig, StreamConfig
from cat.loading.shardlist import ShardList, describe_change, load_shard_list
from cat.loading.stream import ShardStream
from cat.loading.tar import CorruptShardError
from cat.loading.transport import RingLoader, SharedCollate
from cat.training.distributed import DistributedContext
from cat.training.report import check_epoch

logger = logging.getLogger(__name__)

FEAT_DIM_KEY = "config.json encoder.kwargs.idim"
#: Shards read for the global CMVN sample at most (`StreamTrainData.feature_samples`).
CMVN_SHARDS = 32


def shared_collate(options: config_module.TrainOptions, feat_dim: int, longest: int,
                   audio: AudioConfig | None = None) -> SharedCollate | None:
    """Ring slots for the largest batch the options allow (None: no workers, or unbounded):
    float32 features, or with `audio.on_device` int16 waveforms.

    Per worker: `prefetch` batches in flight plus its share of what the training process
    holds (`grad_accum` batches, as many from the previous update while it takes them,
    and the `Prefetcher`'s). A batch that finds no slot travels the DataLoader's own way.
    """
    frames = (max(options.max_frames, longest) if options.max_frames
              else options.batch_size * longest)
    if options.workers <= 0 or frames <= 0:
        return None
    held = -(-(2 * options.grad_accum + 1 + PREFETCH_DEPTH) // options.workers)
    slot_bytes = frames * feat_dim * 4
    if audio is not None and audio.on_device:
        # A frame is a shift of samples; each utterance has a window's tail besides.
        fbank = audio.fbank
        slot_bytes = 2 * (frames * fbank.window_shift + options.batch_size * fbank.window_size)
    return SharedCollate(slot_bytes, options.prefetch + held)


def log_features_location(audio: AudioConfig | None, options: config_module.TrainOptions,
                          context: DistributedContext) -> None:
    """Say once where the features of audio shards are computed, and why."""
    if audio is None or not context.is_main:
        return
    choice = (options.audio or {}).get("features", "auto")
    where = f"batched on {context.device}" if audio.on_device else "in the DataLoader workers"
    logger.info("fbank of the audio shards: computed %s (train.option.audio.features %s%s)",
                where, choice, ", for a " + context.device.type + " device"
                if choice == "auto" else "")


def batch_loader(dataset: torch.utils.data.Dataset, shared: SharedCollate | None,
                 options: config_module.TrainOptions, device: torch.device,
                 persistent: bool = True, report: bool = False, **kwargs: Any) -> Prefetcher:
    """A DataLoader of `Batch`es whose workers hand them over through `shared`'s rings,
    taken ahead of the step onto `device` (`Prefetcher`, which logs the loader's rates
    when `report`)."""
    # Own generator: creating a loader iterator must not consume the global torch RNG,
    # or an extra evaluation would change the training randomness (exact resume).
    generator = torch.Generator()
    generator.manual_seed(options.seed)
    if options.workers > 0:
        kwargs.update(prefetch_factor=options.prefetch, persistent_workers=persistent,
                      worker_init_fn=loader_worker_init())
    loader = torch.utils.data.DataLoader(dataset, num_workers=options.workers,
                                         generator=generator, **kwargs)
    return Prefetcher(RingLoader(loader, shared), device, workers=options.workers,
                      report=report)


def open_pack(path: str, tokenizer: str) -> MapPack:
    """The map pack at `path`, checked to be encoded with the run's tokenizer."""
    pack = MapPack(path)
    meta = pack.meta.get("tokenizer", {})
    if meta.get("sha256") not in (None, _file_digest(tokenizer, 64)):
        raise ValueError(f"{path} was encoded with the tokenizer {meta.get('file')}, which "
                         f"differs from train.option.tokenizer {tokenizer}; repack or fix "
                         "the tokenizer path")
    return pack


def _file_digest(path: str, length: int = 32) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:length]


def identity_changes(recorded: dict[str, Any] | None, current: dict[str, Any],
                     urls: list[str] | None = None) -> list[str]:
    """What differs between two `identity()` records, in words (empty when nothing)."""
    if recorded is None:
        return ["the checkpoint does not record what decided its data (an older format)"]
    changes = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            continue
        if key == "shards" and isinstance(old, dict) and isinstance(new, dict):
            changes.append(describe_change(old, new, urls or []))
        else:
            changes.append(f"{key} {old!r} -> {new!r}")
    return changes


class EpochLog:
    """Lines appended to a per-epoch, per-rank file, true across a resume (module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None

    def start(self, size: int | None) -> None:
        """Begin the epoch's log: empty for a new epoch (`size` None), else cut back to the
        `size` bytes a checkpoint recorded."""
        self.close()
        if size is None:
            self.path.unlink(missing_ok=True)
            return
        current = self.path.stat().st_size if self.path.exists() else 0
        if current < size:
            logger.warning("%s holds %d bytes, the checkpoint recorded %d: lines are missing",
                           self.path, current, size)
        elif current > size:
            os.truncate(self.path, size)

    def write(self, lines: list[str]) -> None:
        """Append lines."""
        if not lines:
            return
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.file.write("".join(f"{line}\n" for line in lines))

    def mark(self) -> int:
        """Flush, and return the size a checkpoint records."""
        if self.file is not None:
            self.file.flush()
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        """Close the file (it is opened again on the next write)."""
        if self.file is not None:
            self.file.close()
            self.file = None


class _EpochLogs:
    """The trained-utterance and drop logs of one rank's epoch."""

    def __init__(self, log_dir: Path, rank: int) -> None:
        self.log_dir = log_dir
        self.rank = rank
        self.utts = EpochLog(Path())
        self.drops = EpochLog(Path())

    def start(self, epoch: int, state: dict[str, Any] | None) -> None:
        name = f"epoch-{epoch:03d}.rank-{self.rank}.txt"
        self.utts = EpochLog(self.log_dir / "utts" / name)
        self.drops = EpochLog(self.log_dir / "drops" / name)
        sizes = state.get("logs", {}) if state else {}
        self.utts.start(sizes.get("utts") if state else None)
        self.drops.start(sizes.get("drops") if state else None)

    def state(self) -> dict[str, int]:
        return {"utts": self.utts.mark(), "drops": self.drops.mark()}

    def close(self) -> None:
        self.utts.close()
        self.drops.close()


# --------------------------------------------------------------------------- interface


class TrainData(abc.ABC):
    """Training data as the Manager sees it (the module docstring lists the interface).

    A kind implements the abstract methods; the rest is shared. `loader` iterates the
    epoch's batches (`start_epoch` first); `options`, `context` and `log_dir` are the
    run's; `epoch` is the epoch `start_epoch` selected.
    """

    kind: ClassVar[str]
    loader: Prefetcher

    def __init__(self, options: config_module.TrainOptions, context: DistributedContext,
                 log_dir: Path, longest: int) -> None:
        self.options = options
        self.context = context
        self.log_dir = log_dir
        #: Frames of the longest utterance of the source (before the length filter).
        self.longest = longest
        self.epoch = 1
        self.frames = self.padded_frames = 0
        self.logs = _EpochLogs(log_dir, context.rank)
        self.last_updates: int | None = None

    @classmethod
    @abc.abstractmethod
    def open(cls, options: config_module.TrainOptions,
             length_filter_for: Callable[[int], LengthFilter], feat_dim: int,
             context: DistributedContext, log_dir: Path) -> TrainData:
        """The kind over the source `options.trset` names, with the length filter
        `length_filter_for(longest)` (the source's longest utterance in frames)."""

    # ------------------------------------------------------------ what decides the data

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What decides the epochs' data and batches (compared on resume)."""

    def identity_changes(self, recorded: dict[str, Any] | None) -> list[str]:
        """What changed since a checkpoint recorded `identity()`, in words."""
        return identity_changes(recorded, self.identity(), self._shard_urls())

    def _shard_urls(self) -> list[str]:
        """The shards a change of `identity()["shards"]` is described by (none here)."""
        return []

    @abc.abstractmethod
    def feature_samples(self, max_utts: int) -> Iterator[tuple[str, np.ndarray]]:
        """(name, feature matrix) of up to about `max_utts` training utterances drawn with
        the run's seed, for the global CMVN statistics: taken through the loader's own
        stages, so with its verdicts (drops, length filter, decoding, errors)."""

    # ------------------------------------------------------------ the epoch

    def start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        """Prepare `epoch`, continuing after `state` (this rank's `state()`) when given."""
        self.epoch = epoch
        self.logs.start(epoch, state)
        self.frames, self.padded_frames = (state or {}).get("padding", (0, 0))
        self._start_epoch(epoch, state)

    @abc.abstractmethod
    def _start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        """The kind's part of `start_epoch` (the logs are started)."""

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def note(self, batch: Batch, trained: bool) -> None:
        """Account for a batch taken from the loader (trained, or taken when the epoch
        ended before its update): the kind's accounting, and the padding of the trained."""
        if trained and len(batch):
            self.frames += batch.num_frames
            self.padded_frames += batch.padded_frames
        self._note(batch, trained)

    @abc.abstractmethod
    def _note(self, batch: Batch, trained: bool) -> None:
        """The kind's part of `note`."""

    def padding(self) -> dict[str, int]:
        """Input frames of the epoch's trained batches, and with their padding."""
        return {"frames": self.frames, "padded_frames": self.padded_frames}

    def steps_hint(self) -> int | None:
        """Updates this epoch will take, for the progress bar (here: those of the last
        completed epoch, None before one)."""
        return self.last_updates

    def state(self) -> dict[str, Any]:
        """This rank's position in the epoch (stored in checkpoints), with its count of
        trained utterances (`trained_in`)."""
        return {"trained": self.trained(), **self._position(), "logs": self.logs.state(),
                "padding": [self.frames, self.padded_frames]}

    @abc.abstractmethod
    def trained(self) -> int:
        """Utterances this rank trained in the epoch so far."""

    @abc.abstractmethod
    def _position(self) -> dict[str, Any]:
        """The kind's part of `state()`: what `start_epoch` continues from."""

    @staticmethod
    def trained_in(state: dict[str, Any]) -> int:
        """The trained utterances a rank's recorded `state()` counts, of either kind."""
        if "trained" in state:
            return int(state["trained"])
        return int(state["progress"]["trained"])  # a stream state written before "trained"

    # ------------------------------------------------------------ the epoch's end

    @abc.abstractmethod
    def summary(self) -> dict[str, Any]:
        """This rank's counts for the epoch (`cat.training.report.epoch_record`)."""

    def cut_profile(self) -> dict[str, Any] | None:
        """Lengths of the utterances the epoch's end left untrained (None: none such;
        every rank takes the same number of batches)."""
        return None

    @abc.abstractmethod
    def corpus_mean_frames(self) -> float | None:
        """Mean frames of an utterance of the source (None: not known)."""

    @abc.abstractmethod
    def check_epoch(self, record: dict[str, Any]) -> None:
        """Raise when the epoch's record (over all ranks) shows its data failing."""

    def end_epoch(self, updates: int | None = None) -> None:
        """Close the epoch's log files; `updates`: those of the epoch, when it completed."""
        if updates is not None:
            self.last_updates = updates
        self.logs.close()

    def close(self) -> None:
        """Close the log files and stop the loader's workers."""
        self.logs.close()
        self.loader.close()


def build_train_data(options: config_module.TrainOptions,
                     length_filter_for: Callable[[int], LengthFilter], feat_dim: int,
                     context: DistributedContext, log_dir: Path) -> TrainData:
    """The training data `options` ask for: tar shards (`large_dataset`) or a map pack;
    `length_filter_for(longest)` builds the length filter (see `TrainData.open`)."""
    kind: type[TrainData] = StreamTrainData if options.large_dataset else MapTrainData
    return kind.open(options, length_filter_for, feat_dim, context, log_dir)


# --------------------------------------------------------------------------- map-style


class MapTrainData(TrainData):
    """Map-style training data: pack dataset + `BucketBatchSampler` + DataLoader."""

    kind = "map"

    def __init__(self, options: config_module.TrainOptions, length_filter: LengthFilter,
                 feat_dim: int, context: DistributedContext, log_dir: Path,
                 pack: MapPack | None = None) -> None:
        self.dataset = PackDataset(options.trset[0] if pack is None else pack, feat_dim,
                                   FEAT_DIM_KEY)
        super().__init__(options, context, log_dir,
                         int(self.dataset.num_frames.max(initial=0)))
        self.dataset[0]  # fail early on a feature dimension mismatch
        reasons = self.dataset.filter_reasons(length_filter)
        keep = np.flatnonzero(reasons == "")
        self.filtered = [(self.dataset.pack.key(i), reasons[i])
                         for i in np.flatnonzero(reasons != "")]
        if not len(keep):
            raise ValueError(f"{options.trset[0]}: no utterance passes the length filter "
                             f"({len(self.filtered)} dropped)")
        self.sampler = BucketBatchSampler(self.dataset.num_frames, keep, options.batch_size,
                                          options.max_frames, options.seed, context.rank,
                                          context.world_size)
        shared = shared_collate(options, feat_dim, int(self.dataset.num_frames[keep].max()))
        self.loader = batch_loader(self.dataset, shared, options, context.device,
                                   report=context.is_main, batch_sampler=self.sampler,
                                   collate_fn=shared or collate)
        self.batches = 0
        self.trained_utts = 0
        if context.is_main and self.filtered:
            write_table(log_dir / "drops" / "filtered-train.txt", self.filtered)
            logger.info("%d of %d training utterances do not pass the length filter; "
                        "listed in %s", len(self.filtered), len(self.dataset),
                        log_dir / "drops" / "filtered-train.txt")

    @classmethod
    def open(cls, options: config_module.TrainOptions,
             length_filter_for: Callable[[int], LengthFilter], feat_dim: int,
             context: DistributedContext, log_dir: Path) -> MapTrainData:
        """The map pack `options.trset[0]` (checked against the tokenizer)."""
        pack = open_pack(options.trset[0], options.tokenizer)
        return cls(options, length_filter_for(int(pack.num_frames.max(initial=0))), feat_dim,
                   context, log_dir, pack)

    def feature_samples(self, max_utts: int) -> Iterator[tuple[str, np.ndarray]]:
        """Utterances the length filter keeps, drawn with the run's seed and read as the
        loader reads them (`PackDataset`: its checks); named by the pack and the id."""
        kept = self.sampler.indices
        rng = np.random.default_rng(self.options.seed)
        for index in np.sort(rng.choice(kept, min(len(kept), max_utts), replace=False)):
            utterance = self.dataset[int(index)]
            yield f"{self.options.trset[0]}: {utterance.key}", utterance.features

    def identity(self) -> dict[str, Any]:
        """What decides the epochs' batches (compared on resume)."""
        options = self.options
        meta = self.dataset.pack.meta
        return {"kind": self.kind, "pack": options.trset[0], "num_utts": len(self.dataset),
                "tokenizer": meta.get("tokenizer", {}).get("sha256"),
                "kept": len(self.sampler.indices), "filter": options.filter,
                "batching": [options.batch_size, options.max_frames], "seed": options.seed,
                "world_size": self.context.world_size}

    def plan(self) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
        """The epoch's batches per rank and the left-over batches."""
        return self.sampler.plan(self.epoch)

    def _start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        self.batches = int(state["batches"]) if state else 0
        self.trained_utts = int(state["trained"]) if state else 0
        self.sampler.set_epoch(epoch, self.batches)
        if self.context.is_main and state is None:
            left_over = self.plan()[1]
            self.logs.drops.write([f"{self.dataset.pack.key(i)} epoch_remainder"
                                   for b in left_over for i in b])

    def _note(self, batch: Batch, trained: bool) -> None:
        """Account for a batch taken from the loader."""
        if trained:
            self.batches += 1
            self.trained_utts += len(batch)
            if self.options.log_utterances:
                self.logs.utts.write([" ".join(batch.keys)])

    def steps_hint(self) -> int | None:
        """Updates this epoch will take (its batches are planned)."""
        return len(self.plan()[0][self.context.rank]) // self.options.grad_accum

    def trained(self) -> int:
        """Utterances this rank trained in the epoch so far."""
        return self.trained_utts

    def _position(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def summary(self) -> dict[str, Any]:
        """This rank's counts for the epoch."""
        rank_batches, left_over = self.plan()
        expected = int(sum(len(b) for b in rank_batches[self.context.rank]))
        summary: dict[str, Any] = {"expected": expected, "trained": self.trained_utts,
                                   "not_trained": expected - self.trained_utts, "dropped": {},
                                   "corrupt_missing": 0, "unavailable_missing": 0,
                                   "retrained": 0}
        if self.context.is_main:
            reasons: dict[str, int] = {}
            for _, reason in self.filtered:
                name = reason.split(" ", 1)[0]
                reasons[name] = reasons.get(name, 0) + 1
            reasons["epoch_remainder"] = int(sum(len(b) for b in left_over))
            summary["dropped"] = reasons
        return summary

    def corpus_mean_frames(self) -> float | None:
        """Mean frames of the pack's utterances."""
        frames = self.dataset.num_frames
        return float(frames.mean()) if len(frames) else None

    def check_epoch(self, record: dict[str, Any]) -> None:
        """Nothing to check: the pack is read whole when opened, and the epoch's batches
        are planned (the remainder is counted as dropped)."""

    def close(self) -> None:
        """Close the log files, stop the loader's workers, close the arks."""
        super().close()
        self.dataset.pack.close()


# --------------------------------------------------------------------------- streaming


class StreamTrainData(TrainData):
    """Streaming training data: tar shards through `cat.loading.stream.ShardStream`."""

    kind = "stream"

    def __init__(self, options: config_module.TrainOptions, length_filter: LengthFilter,
                 feat_dim: int, context: DistributedContext, log_dir: Path,
                 shards: ShardList) -> None:
        super().__init__(options, context, log_dir, shards.longest)
        self.shards = shards
        if shards.feat_dim is not None and shards.feat_dim != feat_dim:
            raise ValueError(f"trset {options.trset}: the shards hold {shards.feat_dim}-dim "
                             f"features (index.jsonl), but {FEAT_DIM_KEY} is {feat_dim}")
        config = StreamConfig.from_options(options, train=True, device=context.device)
        log_features_location(config.audio, options, context)
        shared = shared_collate(options, feat_dim, shards.longest, config.audio)
        self.dataset = ShardStream(shards, options.tokenizer, config, length_filter, feat_dim,
                                   context.rank, context.world_size, options.workers,
                                   FEAT_DIM_KEY, shared or collate)
        self.loader = batch_loader(self.dataset, shared, options, context.device,
                                   report=context.is_main, batch_size=None)
        self.progress = StreamProgress(shards, [])
        self._tokenizer_digest = _file_digest(options.tokenizer)

    @classmethod
    def open(cls, options: config_module.TrainOptions,
             length_filter_for: Callable[[int], LengthFilter], feat_dim: int,
             context: DistributedContext, log_dir: Path) -> StreamTrainData:
        """The shards of the patterns `options.trset` (`load_shard_list`)."""
        shards = load_shard_list(options.trset, options.utts_per_shard_estimate,
                                 options.read_timeout)
        data = cls(options, length_filter_for(shards.longest), feat_dim, context, log_dir,
                   shards)
        logger.info("training on %d shards (%d utterances) from %s", len(shards),
                    int(shards.num_utts.sum()), options.trset)
        return data

    def feature_samples(self, max_utts: int) -> Iterator[tuple[str, np.ndarray]]:
        """Utterances of shards taken in a seeded random order, so that every length
        group is represented by its share of the shards: up to `max_utts / min(shards,
        CMVN_SHARDS)` from the start of each (the packer shuffled each shard's contents),
        as the loader keeps them in epoch 1 (`ShardStream.samples`: its drops, length
        filter, decoding; a shard that cannot be read is skipped, or with `strict_shards`
        an error). Named by the shard and the utterance id."""
        shards = self.shards
        order = np.random.default_rng([self.options.seed, 1]).permutation(len(shards))
        per_shard = math.ceil(max_utts / min(len(shards), CMVN_SHARDS))
        taken = 0
        for shard in order.tolist():
            samples = self.dataset.samples([shard])
            try:
                for sample in itertools.islice(samples, min(per_shard, max_utts - taken)):
                    yield f"{shards.urls[shard]}: {sample['key']}", sample["features"]
                    taken += 1
            except (CorruptShardError, DataUnavailableError) as error:
                raise type(error)(f"{error}; read for the global CMVN statistics") from None
            finally:
                samples.close()
            if taken >= max_utts:
                return

    def identity(self) -> dict[str, Any]:
        """What decides the epochs' data and batches (compared on resume)."""
        options = self.options
        identity = {"kind": self.kind, "shards": self.shards.identity(),
                "weighting": self.dataset.weighting, "world_size": self.context.world_size,
                "workers": options.workers, "seed": options.seed, "filter": options.filter,
                # Where features are computed does not change the data (features within
                # 1e-4, the same batches): a resume may move them.
                "audio": options.audio and {key: value for key, value in options.audio.items()
                                            if key != "features"},
                "batching": [options.batch_size, options.max_frames, options.shuffle_buffer,
                             options.sort_buffer],
                "tokenizer": self._tokenizer_digest}
        if options.buckets:  # (absent before buckets were: those checkpoints still resume)
            identity["buckets"] = options.buckets
        return identity

    def _shard_urls(self) -> list[str]:
        return self.shards.urls

    def _worker_shards(self, epoch: int) -> list[list[int]]:
        workers = max(1, self.options.workers)
        return [self.dataset.worker_shards(epoch, w, workers) for w in range(workers)]

    def _start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        # Continues exactly where each worker stood after its last batch taken.
        worker_shards = self._worker_shards(epoch)
        self.progress = StreamProgress(self.shards, worker_shards)
        idle = sum(not shards for shards in worker_shards)
        if idle:
            logger.warning("rank %d has %d shards in epoch %d for %d workers: %d workers idle",
                           self.context.rank, len(self.progress.rank_shards), epoch,
                           len(worker_shards), idle)
        if state:
            self.progress.restore(state["progress"])
            logger.info("rank %d: epoch %d resumes after %d trained utterances, exactly where "
                        "each of its %d workers stood", self.context.rank, epoch,
                        self.progress.trained, len(self.progress.positions))
        self.dataset.set_epoch(epoch, self.progress.positions,
                               len(self.progress.corrupt) + len(self.progress.unavailable))

    def _note(self, batch: Batch, trained: bool) -> None:
        """Account for a batch taken from the loader (its events count either way)."""
        self.progress.update(batch, trained)
        self.logs.drops.write(self.progress.drop_lines)
        self.progress.drop_lines = []
        if trained and len(batch) and self.options.log_utterances:
            self.logs.utts.write([" ".join(batch.keys)])

    def trained(self) -> int:
        """Utterances this rank trained in the epoch so far."""
        return self.progress.trained

    def _position(self) -> dict[str, Any]:
        return {"progress": self.progress.state()}

    def summary(self) -> dict[str, Any]:
        """This rank's counts for the epoch."""
        return self.progress.summary()

    def cut_profile(self) -> dict[str, Any] | None:
        """Lengths of the utterances the epoch's end left untrained (`length_profile`)."""
        ids = self.progress.cut_ids()
        return None if ids is None else length_profile(self.shards, ids)

    def corpus_mean_frames(self) -> float | None:
        """Mean frames of the shards' utterances (None: some counts are estimated)."""
        shards = self.shards
        if shards.estimated.any():
            return None
        return float(shards.num_frames.sum() / shards.num_utts.sum())

    def check_epoch(self, record: dict[str, Any]) -> None:
        """Raise when the epoch trained nothing, or more of its shards failed than
        `bad_shard_limit` allows (`cat.training.report.check_epoch`)."""
        check_epoch(record, self.options.bad_shard_limit)


# --------------------------------------------------------------------------- dev


class DevData:
    """Development data: a map pack (`pack`, or `devset` checked against the tokenizer),
    or (dev_large_dataset) shards, split over ranks."""

    def __init__(self, options: config_module.TrainOptions, feat_dim: int,
                 context: DistributedContext, pack: MapPack | None = None) -> None:
        if options.dev_large_dataset:
            shards = load_shard_list(options.devset, options.utts_per_shard_estimate,
                                     options.read_timeout)
            config = StreamConfig.from_options(options, train=False, device=context.device)
            shared = shared_collate(options, feat_dim, shards.longest, config.audio)
            dataset = ShardStream(shards, options.tokenizer, config, None, feat_dim,
                                  context.rank, context.world_size, options.workers,
                                  FEAT_DIM_KEY, shared or collate)
            self.num_utts = int(shards.num_utts.sum())
            self.loader = batch_loader(dataset, shared, options, context.device,
                                       persistent=False, batch_size=None)
            self.pack = None
            return
        dataset = PackDataset(open_pack(options.devset[0], options.tokenizer) if pack is None
                              else pack, feat_dim, FEAT_DIM_KEY)
        dataset[0]  # fail early on a feature dimension mismatch
        sampler = BucketBatchSampler(dataset.num_frames, np.arange(len(dataset)),
                                     options.batch_size, options.max_frames, options.seed,
                                     context.rank, context.world_size, shuffle=False)
        self.num_utts = len(dataset)
        self.pack = dataset.pack
        shared = shared_collate(options, feat_dim, int(dataset.num_frames.max(initial=0)))
        self.loader = batch_loader(dataset, shared, options, context.device, persistent=False,
                                   batch_sampler=sampler, collate_fn=shared or collate)

    def close(self) -> None:
        """Stop the loader's workers, close the arks this process opened."""
        self.loader.close()
        if self.pack is not None:
            self.pack.close()
