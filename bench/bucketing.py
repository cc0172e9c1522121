"""Benchmark: padding of streaming batches with the sort buffer and with length buckets.

An epoch of the streaming loader (`ShardStream`, as training builds it) over feature
shards of a WenetSpeech-like length mix, batched by `exp/ctc-v1`'s budget (128
utterances, 60,000 padded frames) and the schema's buffers (shuffle 3,000, sort 500),
with the sort buffer (`buckets` 0, the default) and with `--buckets` length buckets
(`train.option.buckets`); beside them the map-style sampler (`BucketBatchSampler`, which
sorts the whole corpus: the least padding a batch budget allows). Printed per batcher:
padding share of the input frames (utterances x longest against the real frames),
batches, utterances per batch and the loader's rate (in this process). The buckets hold
at most one batch each; the sort buffer its 500 utterances and the batches cut from them.

The length mix is an assumption, not WenetSpeech's own statistics: log-normal
durations with a median of 2.8 s, clipped to the recipe's length filter (0.1-15 s);
`--median-seconds` and `--sigma` change it. Features are 2-dim (reading costs little, so
that the batcher's work shows).

Usage:
    python bench/bucketing.py                       # 20,000 utterances, about 1 minute
    python bench/bucketing.py --utterances 50000 --buckets 30 60
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cat.loading.batch import BucketBatchSampler
from cat.loading.samples import StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.epochs import write_stream_corpus
from cat.testing.shards import write_shards

BATCH_SIZE, MAX_FRAMES = 128, 60000


def length_mix(count: int, median_seconds: float, sigma: float, seed: int = 0) -> np.ndarray:
    """Frame counts (100 a second) of `count` utterances, log-normal, within 10-1500."""
    rng = np.random.default_rng(seed)
    seconds = rng.lognormal(np.log(median_seconds), sigma, count)
    return np.clip(np.round(seconds * 100), 10, 1500).astype(int)


def stream_epoch(shards: str, tokenizer: Path, buckets: int) -> dict[str, float]:
    """One epoch of the stream with `buckets` (0: the sort buffer): padding and rates."""
    config = StreamConfig.with_defaults(batch_size=BATCH_SIZE, max_frames=MAX_FRAMES,
                                        buckets=buckets, seed=1)
    stream = ShardStream(load_shard_list(shards), str(tokenizer), config, None, 2, 0, 1, 1)
    stream.set_epoch(1)
    frames = padded = batches = utterances = 0
    start = time.perf_counter()
    for batch in stream:  # in this process: the padding does not depend on the workers
        if not len(batch):
            continue
        batches += 1
        utterances += len(batch)
        frames += batch.num_frames
        padded += batch.padded_frames
    seconds = time.perf_counter() - start
    return {"padding": 1 - frames / padded, "batches": batches,
            "per_batch": utterances / batches, "utts_per_second": utterances / seconds}


def map_style(frames: np.ndarray) -> dict[str, float]:
    """The map-style sampler's batches of the same lengths (one epoch, one rank)."""
    sampler = BucketBatchSampler(frames, np.arange(len(frames)), BATCH_SIZE, MAX_FRAMES, 1)
    batches = [np.asarray(b) for b in sampler]
    real = sum(int(frames[b].sum()) for b in batches)
    padded = sum(len(b) * int(frames[b].max()) for b in batches)
    return {"padding": 1 - real / padded, "batches": len(batches),
            "per_batch": len(frames) / len(batches), "utts_per_second": float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=20000)
    parser.add_argument("--buckets", type=int, nargs="+", default=[30])
    parser.add_argument("--median-seconds", type=float, default=2.8)
    parser.add_argument("--sigma", type=float, default=0.6)
    args = parser.parse_args(argv)
    frames = length_mix(args.utterances, args.median_seconds, args.sigma)
    print(f"{args.utterances:,} utterances, {frames.sum() / 360000:.1f} h: median "
          f"{np.median(frames) / 100:.1f} s, mean {frames.mean() / 100:.1f} s, 99th "
          f"percentile {np.percentile(frames, 99) / 100:.1f} s; batches of {BATCH_SIZE} / "
          f"{MAX_FRAMES:,} frames; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench-bucketing-") as workdir:
        root = Path(workdir)
        corpus, tokenizer = write_stream_corpus(root, [int(n) for n in frames], 0)
        write_shards(corpus, root / "shards", 500)
        shards = str(root / "shards/data-*.tar")
        rows = {"stream, sort buffer 500": stream_epoch(shards, tokenizer, 0)}
        for buckets in args.buckets:
            rows[f"stream, {buckets} buckets"] = stream_epoch(shards, tokenizer, buckets)
        rows["map-style (whole corpus sorted)"] = map_style(frames)
    print(f"{'batcher':<32} {'padding':>8} {'batches':>8} {'utt/batch':>10} {'utt/s':>8}")
    for name, row in rows.items():
        print(f"{name:<32} {row['padding']:>8.1%} {row['batches']:>8} "
              f"{row['per_batch']:>10.1f} {row['utts_per_second']:>8.0f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
