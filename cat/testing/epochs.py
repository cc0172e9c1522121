"""Streaming epochs of several ranks in one process, ended the way DDP training ends them.

`lockstep_epoch` drives one `ShardStream` per rank (`workers: 0`): every step takes one
batch from each rank; at the first step where a rank has none, the epoch ends on all of
them, and the batches taken in that step are not trained (`cat.shared.manager` does the
same with an all-reduced flag). Each rank's `StreamProgress` then says what was trained,
dropped, and cut (`cut_ids`). Used by the epoch-cut tests and `bench/epoch_cut.py`, with
the corpora below: `write_bias_corpus` (1,600 utterances of 50-1000 frames in 8 shards)
and `longest_decile_share`, the length bias of what the epochs' ends cut.

`run_epoch` runs one epoch of one stream through a DataLoader as training does (the
batches trained, with their features or only their keys, and the epoch's progress) and
`features_by_key` checks that no utterance was trained twice.

Usage:
    streams = [ShardStream(shards, tokenizer, config, None, 80, rank, 2) for rank in (0, 1)]
    progresses = lockstep_epoch(streams, epoch=1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from cat.loading.batch import Batch
from cat.loading.progress import StreamProgress
from cat.loading.samples import ORDINAL_BITS, StreamConfig
from cat.loading.shardlist import ShardList, load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.features import (
    FeatureCorpus,
    random_transcript,
    utterance_ids,
    write_feature_corpus,
)
from cat.testing.shards import write_uneven_shards
from cat.text import tokenizer as tk


def _next_batch(batches: Iterator[Batch], progress: StreamProgress) -> Batch | None:
    for batch in batches:
        if len(batch):
            return batch
        progress.update(batch, trained=False)  # events only
    return None


def lockstep_epoch(streams: Sequence[ShardStream], epoch: int) -> list[StreamProgress]:
    """Run `epoch` on every rank's stream until one runs out; returns each rank's
    accounting (see the module docstring)."""
    progresses, iterators = [], []
    for stream in streams:
        stream.set_epoch(epoch)
        progresses.append(StreamProgress(stream.shards, [stream.worker_shards(epoch, 0, 1)]))
        iterators.append(iter(stream))
    while True:
        batches = [_next_batch(i, p) for i, p in zip(iterators, progresses, strict=True)]
        done = any(batch is None for batch in batches)
        for batch, progress in zip(batches, progresses, strict=True):
            if batch is not None:
                progress.update(batch, trained=not done)
        if done:
            return progresses


def write_bias_corpus(root: Path) -> tuple[ShardList, Path]:
    """The `bias` experiment's shards (8 x 200 utterances, 50-1000 frames) and tokenizer."""
    rng = np.random.default_rng(0)
    frames = [int(n) for n in rng.integers(50, 1001, 1600)]
    corpus, tokenizer = write_stream_corpus(root, frames, 0)
    write_uneven_shards(corpus, root / "shards", [200] * 8)
    return load_shard_list(str(root / "shards/*/data-*.tar")), tokenizer


def write_stream_corpus(root: Path, frames: list[int], seed: int) -> tuple[FeatureCorpus, Path]:
    """A corpus of 2-dim features with these frame counts and random transcripts, and a
    character tokenizer of it (`root/tokenizer.tknz`)."""
    keys = utterance_ids(len(frames), num_speakers=7)
    rng = np.random.default_rng(seed)
    texts = {key: random_transcript(rng, 2, 6) for key in keys}
    corpus = write_feature_corpus(root / "feats", keys=keys, num_frames=frames, dim=2,
                                  transcripts=texts, seed=seed)
    tokenizer = root / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([corpus.text], "char", 0), tokenizer)
    return corpus, tokenizer


def cut_of_epoch(shards: ShardList, tokenizer: Path, config: StreamConfig, world_size: int,
              epoch: int) -> tuple[set[int], int]:
    """(ids of the utterances the epoch's end cut, utterances in the epoch): `world_size`
    streams of `config` run in lockstep."""
    streams = [ShardStream(shards, str(tokenizer), config, None, 2, rank, world_size, 0)
               for rank in range(world_size)]
    progresses = lockstep_epoch(streams, epoch)
    cut = set(np.concatenate([p.cut_ids() for p in progresses]).tolist())
    assert len(cut) == sum(p.summary()["not_trained"] for p in progresses)
    return cut, int(shards.num_utts.sum())


def longest_decile_share(shards: ShardList, tokenizer: Path, epochs: int, seed: int = 0
                         ) -> tuple[float, int]:
    """Share of the corpus's longest 10 % among the utterances cut over `epochs` epochs
    (2 ranks, the buffers of the `bias` experiment), and how many were cut."""
    frames = shards.utterance_frames(range(len(shards)))
    lengths = {(shard << ORDINAL_BITS) | i: int(n) for shard, f in frames.items()
               for i, n in enumerate(f)}
    threshold = np.quantile(list(lengths.values()), 0.9)
    config = StreamConfig.with_defaults(batch_size=64, max_frames=2000, shuffle_buffer=300,
                                        sort_buffer=20, seed=seed)
    cut_total = cut_long = 0
    for epoch in range(1, epochs + 1):
        cut, _ = cut_of_epoch(shards, tokenizer, config, 2, epoch)
        cut_total += len(cut)
        cut_long += sum(lengths[i] >= threshold for i in cut)
    return cut_long / max(cut_total, 1), cut_total


def epoch_progress(stream: ShardStream, epoch: int, workers: int) -> StreamProgress:
    """A fresh `StreamProgress` of `stream`'s `epoch` read by `workers` workers."""
    return StreamProgress(stream.shards, [stream.worker_shards(epoch, w, max(workers, 1))
                                          for w in range(max(workers, 1))])


def run_epoch(stream: ShardStream, epoch: int, workers: int = 0, limit: int | None = None,
              progress: StreamProgress | None = None, loader: Iterable[Batch] | None = None,
              features: bool = False, on_batch: Callable[[int], None] | None = None
              ) -> tuple[list, StreamProgress]:
    """(the non-empty batches trained, in order, progress) of one epoch: each batch its
    keys, or with `features` (keys, each utterance's unpadded features, computed here
    from the batch's waveforms when the device computes them); stops after
    `limit` batches; `progress` (restored from a checkpoint) resumes the epoch; `on_batch`
    gets the number of batches so far after each one."""
    progress = progress or epoch_progress(stream, epoch, workers)
    stream.set_epoch(epoch, progress.positions)
    if loader is None:
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    batches: list = []
    for batch in loader:
        if limit is not None and len(batches) >= limit:
            break
        progress.update(batch, trained=True)
        if len(batch):
            keys = list(batch.keys)
            if features:
                batch = batch.featurize()
            batches.append((keys, [batch.feats[i, :n].numpy()
                                   for i, n in enumerate(batch.feat_lens)])
                           if features else keys)
            if on_batch is not None:
                on_batch(len(batches))
    return batches, progress


def features_by_key(batches: Iterable[tuple[list[str], list[np.ndarray]]]
                    ) -> dict[str, np.ndarray]:
    """{key: features} of `run_epoch(..., features=True)`'s batches; an utterance trained
    twice fails."""
    found: dict[str, np.ndarray] = {}
    for keys, arrays in batches:
        for key, array in zip(keys, arrays, strict=True):
            assert key not in found, f"{key} trained twice"
            found[key] = array
    return found
