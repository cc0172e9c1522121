"""Benchmark: the streaming loader's bookkeeping at WenetSpeech scale (15 M utterances).

WenetSpeech L is about 15 million utterances in 7,500 shards of 2,000. This script writes
an `index.jsonl` of that size (real keys and frame counts; the 7,500 shard files are hard
links to `--real-shards` real shards of 2,000 utterances each, 80-dim float16 features,
so disk use stays small) and measures, in one run:

* loading the shard list and its index (`load_shard_list`): time and peak memory
  (tracemalloc), against the baseline of parsing every index line in full with
  `json.loads` (what the loader did before it parsed only the counts);
* planning an epoch (`assign_shards` and the worker split) for 8 and 64 ranks;
* the data state one rank stores in a checkpoint (`StreamProgress.state()`, saved with
  `torch.save`) after training a few hundred batches with the recipe's buffers (shuffle
  3,000, sort 500, 20,000 frames per batch), and the identity of the shard list that
  every checkpoint stores once;
* the time `--resume` spends before its first batch (a new stream restoring that state:
  the buffered samples are read again from their shards), against the time a fresh epoch
  takes to its first batch.

Targets (issue): load under 2 s and 200 MB, under 1 MB of data state per rank, resume
setup under 2 s.

Usage:
    python bench/resume.py                      # 7,500 x 2,000 (about 2 min the first time)
    python bench/resume.py --shards 750         # a tenth
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

from cat.formats import prep_wds, shard_format
from cat.loading.progress import StreamProgress
from cat.loading.samples import StreamConfig
from cat.loading.shardlist import assign_shards, load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.features import random_transcript, write_feature_corpus
from cat.text import tokenizer as tk

UTTS_PER_SHARD = 2000
DEFAULT_OUT = Path(__file__).resolve().parent / "out"


def _keys(shard: int) -> list[str]:
    # WenetSpeech-style segment ids.
    return [f"Y{shard:010d}_{i:06d}XXXXX_S{i:08d}" for i in range(UTTS_PER_SHARD)]


def prepare(root: Path, num_shards: int, real_shards: int) -> Path:
    """Write (or reuse) the shards and the index; returns the shard folder."""
    folder = root / f"wds-{num_shards}"
    if (folder / shard_format.INDEX_NAME).is_file():
        return folder
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    real = []
    for index in range(real_shards):
        keys = _keys(index)
        frames = [int(n) for n in rng.integers(100, 1500, UTTS_PER_SHARD) // 10]
        texts = {k: random_transcript(rng, 4, 20) for k in keys}
        corpus = write_feature_corpus(root / f"corpus-{index}", keys=keys, num_frames=frames,
                                      dim=80, transcripts=texts, seed=index)
        prep_wds.pack_data(corpus.feats_scp, corpus.text, root / f"real-{index}",
                           utts_per_file=UTTS_PER_SHARD, dtype="float16")
        record = shard_format.read_index(root / f"real-{index}").shards[0]
        real.append((root / f"real-{index}" / record["shard"], record))
        if index == 0:
            tk.save(tk.train_sentencepiece([corpus.text], "char", 0), root / "tokenizer.tknz")
    folder.mkdir(parents=True)
    header = {"format": shard_format.INDEX_FORMAT, "version": shard_format.INDEX_VERSION,
              "fmt": prep_wds.DEFAULT_FMT, "dtype": "float16", "feat_dim": 80,
              "utts_per_file": UTTS_PER_SHARD, "seed": 0, "frame_range": None,
              "num_shards": num_shards, "num_utts": 0, "num_frames": 0}
    lines = []
    for shard in range(num_shards):
        path, record = real[shard % real_shards]
        name = prep_wds.DEFAULT_FMT % shard
        os.link(path, folder / name)
        lines.append(json.dumps({**record, "shard": name}, ensure_ascii=False))
        header["num_utts"] += record["num_utts"]
        header["num_frames"] += record["num_frames"]
    (folder / shard_format.INDEX_NAME).write_text(
        json.dumps(header) + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def _peak(function, *args):
    """Result, seconds and peak traced memory (tracing slows code: a separate run)."""
    result, seconds = _timed(function, *args)
    tracemalloc.start()
    function(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def _parse_everything(index: Path) -> int:
    count = 0
    with open(index, "rb") as f:
        for line in f:
            record = json.loads(line)
            count += len(record.get("keys", ()))
    return count


def _first_batch(stream: ShardStream) -> float:
    start = time.perf_counter()
    for batch in stream:
        if len(batch):
            return time.perf_counter() - start
    raise RuntimeError("the stream gave no batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=7500, help="shards in the index")
    parser.add_argument("--real-shards", type=int, default=4, help="distinct shard files")
    parser.add_argument("--batches", type=int, default=300, help="batches before the state")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "resume")
    args = parser.parse_args()
    folder = prepare(args.out, args.shards, args.real_shards)
    index = folder / shard_format.INDEX_NAME
    utts = args.shards * UTTS_PER_SHARD
    print(f"index: {args.shards} shards, {utts / 1e6:.1f} M utterances, "
          f"{index.stat().st_size / 1e6:.0f} MB")

    index.read_bytes()  # both loaders read it from the page cache
    _, full_seconds, full_peak = _peak(_parse_everything, index)
    shards, load_seconds, load_peak = _peak(load_shard_list, f"{folder}/data-*.tar")
    print(f"load: {load_seconds:.2f} s, peak {load_peak / 1e6:.0f} MB (target < 2 s, "
          f"< 200 MB); baseline (every line parsed in full): {full_seconds:.2f} s, peak "
          f"{full_peak / 1e6:.0f} MB; ratio {full_seconds / load_seconds:.1f}x faster")

    for ranks in (8, 64):
        plan, seconds = _timed(assign_shards, shards.num_frames, 0, 1, ranks)
        split = [p[w::8] for p in plan for w in range(8)]
        loads = [int(shards.num_frames[p].sum()) for p in plan]
        print(f"plan, {ranks} ranks x 8 workers: {seconds * 1e3:.0f} ms; {len(split)} worker "
              f"lists; rank loads within {(max(loads) - min(loads)) / np.mean(loads):.2%}")

    config = StreamConfig.with_defaults()  # the recipe's buffers: the schema's defaults
    tokenizer = str(args.out / "tokenizer.tknz")
    stream = ShardStream(shards, tokenizer, config, None, 80, 0, 8, 0)
    stream.set_epoch(1)
    progress = StreamProgress(shards, [stream.worker_shards(1, 0, 1)])
    fresh_first = None
    start = time.perf_counter()
    taken = 0
    for batch in stream:
        if fresh_first is None and len(batch):
            fresh_first = time.perf_counter() - start
        progress.update(batch, trained=True)
        taken += bool(len(batch))
        if taken >= args.batches:
            break
    buffer = io.BytesIO()
    torch.save(progress.state(), buffer)
    identity = io.BytesIO()
    torch.save(shards.identity(), identity)
    print(f"data state of a rank after {taken} batches ({progress.trained} utterances): "
          f"{len(buffer.getvalue()) / 1e3:.0f} kB (target < 1 MB); shard-list identity, once "
          f"per checkpoint: {len(identity.getvalue()) / 1e3:.0f} kB")

    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    begin = time.perf_counter()
    resumed_shards = load_shard_list(f"{folder}/data-*.tar")
    stream = ShardStream(resumed_shards, tokenizer, config, None, 80, 0, 8, 0)
    progress = StreamProgress(resumed_shards, [stream.worker_shards(1, 0, 1)])
    progress.restore(state)
    stream.set_epoch(1, progress.positions)
    first = _first_batch(stream)
    total = time.perf_counter() - begin
    buffered = len(progress.positions[0].buffered())
    print(f"resume: {total:.2f} s to the first batch (target < 2 s), of which {first:.2f} s "
          f"rebuilding {buffered} buffered utterances; a fresh epoch's first batch: "
          f"{fresh_first:.2f} s")


if __name__ == "__main__":
    main()
