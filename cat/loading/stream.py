"""Streaming training data from webdataset tar shards (`train.option.large_dataset: true`).

Shards are the stage-2 output of `cat.formats.prep_wds`: tar files of `<encoded key>.npy`
(features) and `<encoded key>.txt` (transcript) members, with an `index.jsonl` next to
them giving each shard's counts. `cat.loading.shardlist` expands `trset` into a
`ShardList` and deals its shards to the ranks every epoch (`assign_shards`); each rank's
shards go round-robin to its DataLoader workers.

Each worker runs a flat list of generator stages, assembled in `ShardStream.pipeline`:

    ShardReader      stream each tar in order (`cat.loading.readahead`: one read per member,
                     read-ahead across shard boundaries) and group members into samples
                     by key (`decode_key`); every sample gets an id, `(shard << 32) |
                     ordinal`, its shard and its position in that shard
    prepare_samples  as each sample is read: .npy decoded (a view on the bytes),
                     transcript tokenized with the experiment's tokenizer, then the
                     verdict: `transcript_verdict` (shared with the map-style packer) and
                     `LengthFilter`. Verdicts ride with the sample; doing this before the
                     shuffle buffer overlaps it with reading
    ShuffleBuffer    in-memory shuffle buffer (`shuffle_buffer` utterances)
    settle_samples   verdicts are acted on as samples leave the shuffle buffer: drops
                     reported, errors raised, so both keep their place in the stream
    SortBatcher      sort buffer (`sort_buffer`) cut into batches by padded frames, or
    BucketBatcher    with `buckets`, length buckets, each a batch when full (training; the
                     bounds from the index's frame counts of a sample of shards)
    collate_batches  padding collate into `cat.loading.batch.Batch` (or, in a DataLoader
                     worker, into a shared-memory slot: `cat.loading.transport`)

Exact resume: every batch carries, in `batch.events.position`, a `WorkerPosition`: where
its worker's stream stands once that batch is out (the shard being read and how many of
its samples were taken, the ids in the shuffle and sort buffers and in the batches cut
but not yet sent, and the random generator's state). The training process keeps the
position of the last batch it took from each worker; a checkpoint stores them, and
`set_epoch(epoch, positions)` rebuilds each worker's stages exactly there: the buffered
samples are read again from their shards (`fetch_samples`, only those members), the
shard being read continues after its taken samples (passed over with a seek on local
files; a gzip-compressed shard is decompressed again from its start, and counted:
`StreamProgress.resume_reread_shards`). The epoch then trains the same utterances, each
once, and with up to one worker per rank the same batches in the same order, as an
uninterrupted run. The work is proportional to the shards the buffers hold, not to the
corpus.

Nothing is dropped silently: every utterance left out is reported as a
`StreamEvents.dropped` entry (reasons `empty_label`, `no_tokens`, `all_unk`,
`out_of_range` (for audio also decided before decoding, by the length its header
claims), `no_encoder_frames`, `label_too_long`, `too_long` (a member larger than the
length filter lets its format be, passed over unread), `incomplete_sample`, `bad_key`,
`duplicate_key` (a key of a shard without an index entry that the rank already took this
epoch, from whichever worker: `cat.loading.reader.SeenKeys`), `non_finite`,
`corrupt_features`, `bad_audio` (audio that fails to decode in any way, is damaged, cut
short, or claims a length its bytes cannot hold), `bad_text`), and shards whose tar
breaks off or ends early are reported as `corrupt` (skipped with a warning).
`strict_shards` turns the shard and member faults into errors (not the length verdicts).
Features whose dimension differs from the model's are always an error naming the shard
and the utterance.

Duplicate keys of shards without an index (`utts_per_shard_estimate`): within a rank and
an epoch, the first sample of a key is trained and every later one dropped as
`duplicate_key`, whichever of the rank's workers reads it. Not covered: a key whose
first sample a rank took before a resume (the table starts empty in the new process),
and a key held by shards of two ranks (each rank sees only its own shards); both are
trained again, and `StreamProgress` counts them (`repeated_keys`, within a rank; across
ranks the training loop compares the ranks' `trained_key_hashes`). Indexed shards are
checked for duplicates across the whole corpus by `prep_wds index`.

Every sort buffer leaves whole: its last, partial batch (its longest utterances) is sent
too instead of waiting for the next buffer. Carried from buffer to buffer, the longest
utterances gathered at the end of each worker's stream, exactly where the epoch's end
cuts (`bench/epoch_cut.py`: the longest 10 % were 17.5 % of the cut utterances when
carried every time, 13-15 % when carried once, 9.8 % never carried). Never carrying
costs 1-3 % more, smaller batches and no more padded frames.

Usage:
    shards = load_shard_list(["data/wds/train/10_1000/data-*.tar"])
    stream = ShardStream(shards, "exp/asr/tokenizer.tknz", StreamConfig.with_defaults(),
                         length_filter, feat_dim=80, rank=0, world_size=1, num_workers=2)
    stream.set_epoch(1)
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2): ...
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cat.formats.shard_format import CONTENT_AUDIO, CONTENT_FEATURES
from cat.loading.batch import (
    Batch,
    LengthFilter,
    StreamEvents,
    collate,
)
from cat.loading.reader import FailureBudget, SeenKeys, ShardReader, fetch_samples
from cat.loading.samples import StreamConfig, WorkerPosition
from cat.loading.shardlist import ShardList, assign_shards
from cat.loading.stages import (
    BucketBatcher,
    Judge,
    ShuffleBuffer,
    SortBatcher,
    bucket_bounds,
    collate_batches,
    prepare_samples,
    settle_samples,
)
from cat.loading.tar import BufferPool
from cat.text.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)

#: Shards whose index frame counts place the length buckets' bounds (`train.option.buckets`).
BUCKET_SAMPLE_SHARDS = 64


# --------------------------------------------------------------------------- positions


class ShardStream(torch.utils.data.IterableDataset):
    """Batches of one rank's shards (see the module docstring).

    `num_workers` must equal the DataLoader's; training needs at least
    `world_size * max(num_workers, 1)` shards. `collate_fn`: `collate`, or a
    `cat.loading.transport.SharedCollate` when a `RingLoader` iterates the DataLoader
    (its workers then yield `SlotBatch`es).
    """

    def __init__(self, shards: ShardList, tokenizer: str, config: StreamConfig,
                 length_filter: LengthFilter | None, feat_dim: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0,
                 feat_dim_source: str = "config.json encoder.kwargs.idim",
                 collate_fn: Callable[..., Any] = collate) -> None:
        super().__init__()
        slots = world_size * max(num_workers, 1)
        if config.audio is not None and config.audio.fbank.num_mel_bins != feat_dim:
            raise ValueError(f"train.option.audio makes {config.audio.fbank.num_mel_bins}-dim "
                             f"fbank, but {feat_dim_source} is {feat_dim}")
        if config.audio is None and CONTENT_AUDIO in shards.contents:
            raise ValueError(f"{shards.contents[CONTENT_AUDIO]} lists audio shards, but "
                             "train.option.audio (how audio becomes features) is not set")
        if config.audio is not None and CONTENT_FEATURES in shards.contents:
            raise ValueError(f"{shards.contents[CONTENT_FEATURES]} lists feature shards, but "
                             "train.option.audio is set (it is for audio shards); remove it "
                             "or point trset at audio shards")
        if config.train and len(shards) < slots:
            raise ValueError(f"trset has {len(shards)} shards, fewer than ranks x workers = "
                             f"{world_size} x {max(num_workers, 1)}; repack with fewer "
                             "utterances per shard or lower train.option.workers")
        self.shards = shards
        self.tokenizer_path = tokenizer
        self.config = config
        self.length_filter = length_filter
        self.feat_dim = feat_dim
        self.feat_dim_source = feat_dim_source
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        # The epoch, shared with worker processes (persistent workers see set_epoch), and
        # the shards each worker failed to read this epoch (`FailureBudget`).
        self._control = torch.ones(1, dtype=torch.int64).share_memory_()
        self._failures = torch.zeros(max(num_workers, 1), dtype=torch.int64).share_memory_()
        self._resume: dict[int, WorkerPosition] = {}
        self._seen = self._seen_keys(shards, world_size)
        self._tokenizer = None
        self._pool: tuple[int, BufferPool] | None = None
        self.bucket_bounds = self._bucket_bounds() if config.train and config.buckets else None

    @staticmethod
    def _seen_keys(shards: ShardList, world_size: int) -> SeenKeys | None:
        """The rank's table of keys taken from shards without an index entry (None when
        every shard has one), sized for the rank's share of their estimated utterances
        with room for an uneven share."""
        estimated = int(shards.num_utts[shards.estimated].sum())
        return SeenKeys(-(-2 * estimated // world_size)) if estimated else None

    def _bucket_bounds(self) -> np.ndarray | None:
        """Bounds of `config.buckets` length buckets from the index's frame counts of up to
        `BUCKET_SAMPLE_SHARDS` shards drawn with the seed (None, and a warning, when no
        shard has an index: then the sort buffer batches)."""
        shards = self.shards
        indexed = np.flatnonzero(~shards.estimated)
        rng = np.random.default_rng(self.config.seed)
        chosen = np.sort(rng.permutation(indexed)[:BUCKET_SAMPLE_SHARDS])
        frames = shards.utterance_frames(chosen.tolist()) if len(chosen) else {}
        if not frames:
            logger.warning("train.option.buckets: no shard of trset has frame counts in an "
                           "index.jsonl to place the bucket bounds by; batching with the "
                           "sort buffer instead")
            return None
        return bucket_bounds(np.concatenate(list(frames.values())), self.config.buckets)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        state["_pool"] = None
        return state

    def set_epoch(self, epoch: int, positions: Mapping[int, WorkerPosition] | None = None,
                  failed: int = 0) -> None:
        """Select the epoch (its shard order); `positions` (per worker) resume it exactly,
        `failed` shards of the rank already failed in it.

        Positions reach the workers with the dataset, so give them before the DataLoader
        starts its workers (the first epoch of a process, where a resume happens).
        """
        self._control[0] = epoch
        self._failures.zero_()
        self._failures[0] = failed
        self._resume = dict(positions or {})

    @property
    def epoch(self) -> int:
        """The epoch `set_epoch` selected."""
        return int(self._control[0])

    @property
    def weighting(self) -> str:
        """What rank balancing counts: `frames` when batches are frame-bounded, else
        `utterances`."""
        shards = self.shards
        if self.config.max_frames and not shards.estimated.any() and (shards.num_frames > 0).all():
            return "frames"
        return "utterances"

    def weights(self) -> np.ndarray:
        """Work per shard for rank balancing (see `weighting`)."""
        return self.shards.num_frames if self.weighting == "frames" else self.shards.num_utts

    def rank_shards(self, epoch: int, rank: int | None = None) -> np.ndarray:
        """All shards of `rank` (default: this one) in `epoch`, in reading order."""
        plan = assign_shards(self.weights(), self.config.seed, epoch, self.world_size,
                             self.config.train)
        return plan[self.rank if rank is None else rank]

    def worker_shards(self, epoch: int, worker: int, num_workers: int) -> list[int]:
        """Shards a worker reads: its round-robin share of the rank's shards."""
        return [int(s) for s in self.rank_shards(epoch)[worker::num_workers]]

    def _encode(self) -> Callable[[str], list[int]]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer.encode

    def _buffer_pool(self) -> BufferPool:
        # One per process, kept across epochs (persistent workers): its buffers are then
        # already mapped when the next epoch's shuffle buffer fills.
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), BufferPool())
        return self._pool[1]

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.pipeline(self.epoch, worker, num_workers)

    def pipeline(self, epoch: int, worker: int, num_workers: int) -> Iterator[Batch]:
        """The stages of one worker for one epoch (continuing at its resume position)."""
        config = self.config
        shards = self.worker_shards(epoch, worker, num_workers)
        rng = random.Random(f"{config.seed}/{epoch}/{self.rank}/{worker}")
        events = StreamEvents()
        pool = self._buffer_pool()
        judge = self._judge(epoch)
        budget = FailureBudget(self._failures, worker, len(self.rank_shards(epoch)),
                               config.bad_shard_limit if config.train else 1.0)
        reader = ShardReader(shards, self.shards, events, config, pool, budget, self._seen,
                             epoch, judge.member_caps())
        shuffle = ShuffleBuffer(config.shuffle_buffer if config.train else 0, rng)
        batcher: SortBatcher | BucketBatcher
        if self.bucket_bounds is not None:
            batcher = BucketBatcher(self.bucket_bounds, config.batch_size, config.max_frames, rng)
        else:
            batcher = SortBatcher(config.sort_buffer, config.batch_size, config.max_frames,
                                  rng if config.train else None)
        resume = self._resume.get(worker)
        if resume is not None and resume.epoch == epoch:
            self._restore(resume, num_workers, reader, shuffle, batcher, judge, pool)

        def position() -> WorkerPosition:
            return WorkerPosition(
                epoch, worker, num_workers, *reader.position, shuffle.sample_ids(),
                shuffle.draining, batcher.buffer_ids(), list(batcher.pending_ids),
                batcher.upstream_done, rng.getstate())

        stream: Iterable[Any] = prepare_samples(reader, judge)
        stream = shuffle(stream)
        stream = settle_samples(stream, events, pool, judge.finish)
        audio = config.audio
        return collate_batches(batcher(stream), events, self.feat_dim, pool, self.collate_fn,
                               position, audio.fbank if audio and audio.on_device else None)

    def _judge(self, epoch: int) -> Judge:
        config = self.config
        return Judge(self.feat_dim, self.feat_dim_source, self.shards.urls, self._encode(),
                     self.length_filter if config.train else None, config.strict_shards,
                     config.audio, config.seed, epoch)

    def samples(self, shards: Sequence[int], epoch: int = 1) -> Iterator[dict[str, Any]]:
        """The samples of `shards` a worker keeps in `epoch`, in tar order: stages 1, 2 and
        4 of `pipeline` without the shuffle and the batching, so with the same verdicts
        (drops, length filter, decoding, errors). Each sample holds its `key`, `shard`
        and `features` (computed here also when the batches' are the device's). The
        rank's table of keys taken (`SeenKeys`) and its shard failure budget are left
        alone: these samples are not the epoch's. Close the iterator when done with it
        before its end (its shard stays open until then)."""
        judge = self._judge(epoch)
        events = StreamEvents()
        reader = ShardReader(shards, self.shards, events, self.config, epoch=epoch,
                             caps=judge.member_caps())
        return settle_samples(prepare_samples(reader, judge), events, finish=judge.fbank)

    def _restore(self, position: WorkerPosition, num_workers: int, reader: ShardReader,
                 shuffle: ShuffleBuffer, batcher: SortBatcher | BucketBatcher, judge: Judge,
                 pool: BufferPool) -> None:
        if position.num_workers != num_workers:
            raise ValueError(f"the resume position is of a stream with {position.num_workers} "
                             f"workers, this one has {num_workers}")
        samples = fetch_samples(self.shards.urls, position.buffered(), self.config.read_timeout,
                                pool)
        for sample in samples.values():
            judge(sample)
        settled = [samples[int(i)] for i in np.concatenate([position.sort, *position.pending])]
        for sample in settled:
            if "drop" in sample or "error" in sample:
                raise ValueError(f"cannot resume exactly: utterance {sample['key']!r} of shard "
                                 f"{self.shards.urls[sample['shard']]} was trained before, now "
                                 f"its verdict is {sample.get('drop') or sample.get('error')}")
            judge.finish(sample)
        reader.position = (position.shard, position.ordinal)
        shuffle.restore([samples[int(i)] for i in position.shuffle], position.draining)
        batcher.restore([samples[int(i)] for i in position.sort],
                        [[samples[int(i)] for i in batch] for batch in position.pending],
                        position.upstream_done)
        shuffle.rng.setstate(position.rng)
