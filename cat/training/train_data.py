"""The training manager's data: map-style and streaming training sets, dev data, epoch logs.

`MapTrainData` (map pack + `BucketBatchSampler`) and `StreamTrainData` (tar shards through
`cat.loading.stream.ShardStream`) answer the same questions for `cat.shared.manager`:
the batches of an epoch (`start_epoch`, iteration), what a batch taken from the loader
changes (`note`), where the epoch stands (`state`, stored in checkpoints), what decides
the data (`identity`, compared on resume), and the epoch's counts (`summary`).

Epoch logs (`EpochLog`): `exp/<name>/log/utts/epoch-<EEE>.rank-<R>.txt` lists the trained
utterances, one line per batch (with `log_utterances`), and `log/drops/` the utterances
left out (`<utt> <reason> [detail]`). A checkpoint records each log's size and a resume
cuts the log back to it before appending, so the logs of a resumed epoch are those of an
uninterrupted one: nothing written after the checkpoint by a killed run is kept twice.

Usage:
    data = StreamTrainData(options, length_filter, feat_dim, context, log_dir, shards)
    data.start_epoch(1, None)
    for batch in data: data.note(batch, trained=True)
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cat.audio.codec import decode
from cat.core import config as config_module
from cat.core.io import write_table
from cat.core.process import loader_worker_init
from cat.features.fbank import FbankOptions, compute_fbank
from cat.formats.mappack import MapPack
from cat.loading.batch import Batch, BucketBatchSampler, LengthFilter, PackDataset, collate
from cat.loading.progress import StreamProgress, length_profile
from cat.loading.samples import AUDIO_TYPES, AudioConfig, StreamConfig, decode_npy
from cat.loading.shardlist import ShardList, describe_change, load_shard_list
from cat.loading.sources import read_shard
from cat.loading.stream import ShardStream
from cat.loading.tar import CorruptShardError
from cat.loading.transport import RingLoader, SharedCollate
from cat.training.distributed import DistributedContext

logger = logging.getLogger(__name__)

FEAT_DIM_KEY = "config.json encoder.kwargs.idim"
#: Shards read for the global CMVN sample at most (`feature_samples`).
CMVN_SHARDS = 32


def shared_collate(options: config_module.TrainOptions, feat_dim: int,
                   longest: int) -> SharedCollate | None:
    """Ring slots for the largest batch the options allow (None: no workers, or unbounded).

    Per worker: `prefetch` batches in flight plus its share of what the training loop
    holds (`grad_accum` batches, and as many from the previous update while it takes
    them). A batch that finds no slot travels the DataLoader's own way.
    """
    frames = (max(options.max_frames, longest) if options.max_frames
              else options.batch_size * longest)
    if options.workers <= 0 or frames <= 0:
        return None
    held = -(-(2 * options.grad_accum + 1) // options.workers)
    return SharedCollate(frames * feat_dim * 4, options.prefetch + held)


def batch_loader(dataset: torch.utils.data.Dataset, shared: SharedCollate | None,
                 options: config_module.TrainOptions, device: torch.device,
                 persistent: bool = True, **kwargs: Any) -> RingLoader:
    """A DataLoader of `Batch`es whose workers hand them over through `shared`'s rings."""
    # Own generator: creating a loader iterator must not consume the global torch RNG,
    # or an extra evaluation would change the training randomness (exact resume).
    generator = torch.Generator()
    generator.manual_seed(options.seed)
    if options.workers > 0:
        kwargs.update(prefetch_factor=options.prefetch, persistent_workers=persistent,
                      worker_init_fn=loader_worker_init())
    loader = torch.utils.data.DataLoader(dataset, num_workers=options.workers,
                                         generator=generator, **kwargs)
    return RingLoader(loader, shared, pin_memory=device.type == "cuda")


def audio_config(options: config_module.TrainOptions, train: bool) -> AudioConfig | None:
    """How audio members become features (`train.option.audio`; evaluation: no speed
    perturbation), or None."""
    audio = options.audio
    if audio is None:
        return None
    rate = int(audio.get("sample_rate", 16000))
    return AudioConfig(rate, tuple(audio.get("speed_perturb", ())) if train else (),
                       FbankOptions(int(audio.get("num_mel_bins", 80)), rate))


def stream_config(options: config_module.TrainOptions, train: bool) -> StreamConfig:
    """The streaming pipeline's settings from `train.option` (evaluation: no shuffling)."""
    return StreamConfig(options.batch_size, options.max_frames,
                        options.shuffle_buffer if train else 0, options.sort_buffer,
                        options.read_ahead_mb, options.strict_shards, options.seed, train,
                        options.read_timeout, options.read_retries,
                        bad_shard_limit=options.bad_shard_limit,
                        audio=audio_config(options, train))


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]


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


# --------------------------------------------------------------------------- map-style


class MapTrainData:
    """Map-style training data: pack dataset + `BucketBatchSampler` + DataLoader."""

    kind = "map"

    def __init__(self, options: config_module.TrainOptions, length_filter: LengthFilter,
                 feat_dim: int, context: DistributedContext, log_dir: Path,
                 pack: MapPack | None = None) -> None:
        self.options = options
        self.context = context
        self.log_dir = log_dir
        self.dataset = PackDataset(options.trset[0] if pack is None else pack, feat_dim,
                                   FEAT_DIM_KEY)
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
                                   batch_sampler=self.sampler, collate_fn=shared or collate)
        self.epoch = 1
        self.batches = 0
        self.trained = 0
        self.logs = _EpochLogs(log_dir, context.rank)
        if context.is_main and self.filtered:
            write_table(log_dir / "drops" / "filtered-train.txt", self.filtered)
            logger.info("%d of %d training utterances do not pass the length filter; "
                        "listed in %s", len(self.filtered), len(self.dataset),
                        log_dir / "drops" / "filtered-train.txt")

    def feature_samples(self, max_utts: int) -> Iterator[tuple[str, np.ndarray]]:
        """(name, feature matrix) of up to `max_utts` utterances drawn with the run's seed;
        the name is the pack and the utterance id."""
        pack = self.dataset.pack
        count = len(pack)
        rng = np.random.default_rng(self.options.seed)
        for index in np.sort(rng.choice(count, min(count, max_utts), replace=False)):
            yield f"{self.options.trset[0]}: {pack.key(int(index))}", pack.features(int(index))

    def identity(self) -> dict[str, Any]:
        """What decides the epochs' batches (compared on resume)."""
        options = self.options
        meta = self.dataset.pack.meta
        return {"kind": self.kind, "pack": options.trset[0], "num_utts": len(self.dataset),
                "tokenizer": meta.get("tokenizer", {}).get("sha256"),
                "kept": len(self.sampler.indices), "filter": options.filter,
                "batching": [options.batch_size, options.max_frames], "seed": options.seed,
                "world_size": self.context.world_size}

    def identity_changes(self, recorded: dict[str, Any] | None) -> list[str]:
        """What changed since a checkpoint recorded `identity()`, in words."""
        return identity_changes(recorded, self.identity())

    def plan(self) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
        """The epoch's batches per rank and the left-over batches."""
        return self.sampler.plan(self.epoch)

    def start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        """Prepare `epoch`, continuing after `state` (this rank's) when given."""
        self.epoch = epoch
        self.batches = int(state["batches"]) if state else 0
        self.trained = int(state["trained"]) if state else 0
        self.sampler.set_epoch(epoch, self.batches)
        self.logs.start(epoch, state)
        if self.context.is_main and state is None:
            left_over = self.plan()[1]
            self.logs.drops.write([f"{self.dataset.pack.key(i)} epoch_remainder"
                                   for b in left_over for i in b])

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def note(self, batch: Batch, trained: bool) -> None:
        """Account for a batch taken from the loader."""
        if trained:
            self.batches += 1
            self.trained += len(batch)
            if self.options.log_utterances:
                self.logs.utts.write([" ".join(batch.keys)])

    def steps_hint(self) -> int | None:
        """Updates this epoch will take (for the progress bar)."""
        return len(self.plan()[0][self.context.rank]) // self.options.grad_accum

    def state(self) -> dict[str, Any]:
        """This rank's position in the epoch."""
        return {"batches": self.batches, "trained": self.trained, "logs": self.logs.state()}

    def summary(self) -> dict[str, Any]:
        """This rank's counts for the epoch."""
        rank_batches, left_over = self.plan()
        expected = int(sum(len(b) for b in rank_batches[self.context.rank]))
        summary: dict[str, Any] = {"expected": expected, "trained": self.trained,
                                   "not_trained": expected - self.trained, "dropped": {},
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

    def cut_profile(self) -> dict[str, Any] | None:
        """Lengths of the utterances the epoch's end left untrained: none here (every rank
        takes the same number of batches; the remainder is listed as dropped)."""
        return None

    def end_epoch(self) -> None:
        """Close the epoch's log files."""
        self.logs.close()

    def close(self) -> None:
        """Close the arks this process opened."""
        self.logs.close()
        self.dataset.pack.close()


# --------------------------------------------------------------------------- streaming


def sample_features(shards: ShardList, max_utts: int, seed: int, strict: bool,
                    audio: AudioConfig | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(shard:member, feature matrix) of about `max_utts` utterances drawn with `seed` from
    all shards (the global CMVN statistics are computed from them).

    Shards are taken in a seeded random order, so every length group is represented by
    its share of the shards, and up to `max_utts / min(shards, 32)` utterances are read
    from the start of each (the packer shuffled each shard's contents). A shard that
    cannot be read is skipped with a warning, or is an error when `strict`. Audio members
    become fbank as `audio` says (without speed perturbation).
    """
    order = np.random.default_rng([seed, 1]).permutation(len(shards))
    per_shard = math.ceil(max_utts / min(len(shards), CMVN_SHARDS))
    taken = 0
    for shard in order.tolist():
        url = shards.urls[shard]
        try:
            features = []
            for name, data in read_shard(url, shards.timeout):
                extension = name.rpartition(".")[2]
                if extension == "npy":
                    features.append((f"{url}:{name}", decode_npy(data)))
                elif extension in AUDIO_TYPES:
                    if audio is None:
                        raise ValueError(f"shard {url} holds {extension} audio, but "
                                         "train.option.audio is not set")
                    waveform, _ = decode(data, f"{url}:{name}", audio.sample_rate)
                    features.append((f"{url}:{name}",
                                     compute_fbank(waveform, audio.sample_rate, audio.fbank)))
                else:
                    continue
                if len(features) >= min(per_shard, max_utts - taken):
                    break
        except (OSError, CorruptShardError, ValueError) as error:
            if strict:
                raise CorruptShardError(f"shard {url}: {error} (read for the global CMVN "
                                        "statistics; strict_shards is set)") from None
            logger.warning("global CMVN: skipping shard %s: %s", url, error)
            continue
        yield from features
        taken += len(features)
        if taken >= max_utts:
            return



class StreamTrainData:
    """Streaming training data: tar shards through `cat.loading.stream.ShardStream`."""

    kind = "stream"

    def __init__(self, options: config_module.TrainOptions, length_filter: LengthFilter,
                 feat_dim: int, context: DistributedContext, log_dir: Path,
                 shards: ShardList) -> None:
        self.options = options
        self.context = context
        self.log_dir = log_dir
        self.shards = shards
        if shards.feat_dim is not None and shards.feat_dim != feat_dim:
            raise ValueError(f"trset {options.trset}: the shards hold {shards.feat_dim}-dim "
                             f"features (index.jsonl), but {FEAT_DIM_KEY} is {feat_dim}")
        config = stream_config(options, train=True)
        shared = shared_collate(options, feat_dim, shards.longest)
        self.dataset = ShardStream(shards, options.tokenizer, config, length_filter, feat_dim,
                                   context.rank, context.world_size, options.workers,
                                   FEAT_DIM_KEY, shared or collate)
        self.loader = batch_loader(self.dataset, shared, options, context.device,
                                   batch_size=None)
        self.progress = StreamProgress(shards, [])
        self.epoch = 1
        self.last_steps: int | None = None
        self.logs = _EpochLogs(log_dir, context.rank)
        self._tokenizer_digest = _file_digest(options.tokenizer)

    def feature_samples(self, max_utts: int) -> Iterator[tuple[str, np.ndarray]]:
        """(shard:member, feature matrix) of about `max_utts` utterances
        (`sample_features`)."""
        return sample_features(self.shards, max_utts, self.options.seed,
                               self.options.strict_shards, audio_config(self.options, False))

    def identity(self) -> dict[str, Any]:
        """What decides the epochs' data and batches (compared on resume)."""
        options = self.options
        return {"kind": self.kind, "shards": self.shards.identity(),
                "weighting": self.dataset.weighting, "world_size": self.context.world_size,
                "workers": options.workers, "seed": options.seed, "filter": options.filter,
                "audio": options.audio,
                "batching": [options.batch_size, options.max_frames, options.shuffle_buffer,
                             options.sort_buffer],
                "tokenizer": self._tokenizer_digest}

    def identity_changes(self, recorded: dict[str, Any] | None) -> list[str]:
        """What changed since a checkpoint recorded `identity()`, in words."""
        return identity_changes(recorded, self.identity(), self.shards.urls)

    def _worker_shards(self, epoch: int) -> list[list[int]]:
        workers = max(1, self.options.workers)
        return [self.dataset.worker_shards(epoch, w, workers) for w in range(workers)]

    def start_epoch(self, epoch: int, state: dict[str, Any] | None) -> None:
        """Prepare `epoch`, continuing exactly after `state` (this rank's) when given."""
        self.epoch = epoch
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
        self.logs.start(epoch, state)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def note(self, batch: Batch, trained: bool) -> None:
        """Account for a batch taken from the loader (its events count either way)."""
        self.progress.update(batch, trained)
        self.logs.drops.write(self.progress.drop_lines)
        self.progress.drop_lines = []
        if trained and len(batch) and self.options.log_utterances:
            self.logs.utts.write([" ".join(batch.keys)])

    def steps_hint(self) -> int | None:
        """Updates of the previous epoch (the best guess for the progress bar)."""
        return self.last_steps

    def state(self) -> dict[str, Any]:
        """This rank's position in the epoch."""
        return {"progress": self.progress.state(), "logs": self.logs.state()}

    def summary(self) -> dict[str, Any]:
        """This rank's counts for the epoch."""
        return self.progress.summary()

    def cut_profile(self) -> dict[str, Any] | None:
        """Lengths of the utterances the epoch's end left untrained (`length_profile`)."""
        ids = self.progress.cut_ids()
        return None if ids is None else length_profile(self.shards, ids)

    def end_epoch(self) -> None:
        """Close the epoch's log files."""
        self.logs.close()

    def close(self) -> None:
        """Close the epoch's log files."""
        self.end_epoch()


# --------------------------------------------------------------------------- dev


class DevData:
    """Development data: a map pack, or (dev_large_dataset) shards, split over ranks."""

    def __init__(self, options: config_module.TrainOptions, feat_dim: int,
                 context: DistributedContext, pack: MapPack | None = None) -> None:
        if options.dev_large_dataset:
            shards = load_shard_list(options.devset, options.utts_per_shard_estimate,
                                     options.read_timeout)
            config = stream_config(options, train=False)
            shared = shared_collate(options, feat_dim, shards.longest)
            dataset = ShardStream(shards, options.tokenizer, config, None, feat_dim,
                                  context.rank, context.world_size, options.workers,
                                  FEAT_DIM_KEY, shared or collate)
            self.num_utts = int(shards.num_utts.sum())
            self.loader = batch_loader(dataset, shared, options, context.device,
                                       persistent=False, batch_size=None)
            self.pack = None
            return
        pack = PackDataset(options.devset[0] if pack is None else pack, feat_dim, FEAT_DIM_KEY)
        pack[0]  # fail early on a feature dimension mismatch
        sampler = BucketBatchSampler(pack.num_frames, np.arange(len(pack)), options.batch_size,
                                     options.max_frames, options.seed, context.rank,
                                     context.world_size, shuffle=False)
        self.num_utts = len(pack)
        self.pack = pack.pack
        shared = shared_collate(options, feat_dim, int(pack.num_frames.max(initial=0)))
        self.loader = batch_loader(pack, shared, options, context.device, persistent=False,
                                   batch_sampler=sampler, collate_fn=shared or collate)

    def close(self) -> None:
        """Close the arks this process opened."""
        if self.pack is not None:
            self.pack.close()
