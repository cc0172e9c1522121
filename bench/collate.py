"""Benchmark: the padding collate of feature batches and the non-finite check before it.

Feature utterances arrive as `.npy` views on pooled member buffers (float32, or float16
from shards packed with `dtype="float16"`) and are padded into one float32 `[B, T, D]`
batch by `cat.loading.batch.collate`. Timed in the same run on the same data:

* `pad_sequence`  the common way, for scale: a float32 tensor per utterance, then
                  `torch.nn.utils.rnn.pad_sequence` (two copies, the whole batch zeroed;
                  the features only, no labels);
* `before`        the previous collate (a copy here): numpy assignment per utterance
                  (the cast fused in, numpy's float16 cast), only the padding zeroed;
* `after`         `cat.loading.batch.collate` of this checkout.

Each into new memory (`out=None`) and into a reused slot (`out=`, as a DataLoader
worker pads into its shared-memory ring). Also the non-finite check every feature
utterance gets as it is read (`cat.formats.tables.feature_verdict`) against plain
`np.isfinite(x).all()`. The sources of one case cycle through enough batches to exceed
the CPU caches, as a worker's member buffers do. Outputs are checked equal byte for byte.

Printed per case: median milliseconds per batch and MB/s of float32 batch bytes
(1 MB = 1e6 bytes), and the after/before ratio. Then, end to end, one epoch of the
streaming loader (`ShardStream` in this process: tar reading, `.npy` decoding, the
non-finite check, tokenizing, the shuffle and sort buffers, collate) over the same
corpus packed as float32 and as float16 shards, with the previous collate and check
(before) and this checkout's (after): MB/s of float32 feature bytes, best of
`--stream-repeats` epochs, page-cached.

Usage:
    python bench/collate.py --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

import cat.loading.stages
from cat.formats import prep_wds
from cat.formats.tables import feature_verdict
from cat.loading.batch import Batch, StreamEvents, Utterance, collate, padded_shape
from cat.loading.samples import StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.features import random_transcript, utterance_ids, write_feature_corpus
from cat.text import tokenizer as tokenizers

MEGABYTE = 1e6
# (utterances, longest frames): batches of a sorted buffer under the 20,000-frame budget.
SHAPES = ((64, 300), (32, 600), (16, 1500), (64, 1500))


def collate_before(utterances: Sequence[Utterance], events: StreamEvents | None = None,
                   out: np.ndarray | None = None) -> Batch:
    """The previous `collate` (numpy assignment per utterance, numpy's float16 cast)."""
    feat_lens = np.fromiter((len(u.features) for u in utterances), np.int64, len(utterances))
    label_lens = np.fromiter((len(u.label) for u in utterances), np.int64, len(utterances))
    shape = padded_shape(utterances)
    feats = np.empty(shape, np.float32) if out is None else \
        out[:shape[0] * shape[1] * shape[2]].reshape(shape)
    labels = np.zeros((len(utterances), int(label_lens.max(initial=0))), np.int64)
    for row, utterance in enumerate(utterances):
        length = feat_lens[row]
        feats[row, :length] = utterance.features
        feats[row, length:] = 0.0
        labels[row, :label_lens[row]] = utterance.label
    ids = np.fromiter((u.sample_id for u in utterances), np.int64, len(utterances))
    return Batch([u.key for u in utterances], torch.from_numpy(feats),
                 torch.from_numpy(feat_lens), torch.from_numpy(labels),
                 torch.from_numpy(label_lens), ids, events)


def collate_pad_sequence(utterances: Sequence[Utterance], events: StreamEvents | None = None,
                         out: np.ndarray | None = None) -> torch.Tensor:
    """Per-utterance float32 tensors padded by torch (features only; `out` is not used)."""
    tensors = [torch.from_numpy(u.features).float() for u in utterances]
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)




def make_batches(batch_size: int, longest: int, dim: int, dtype: np.dtype, cache_mb: float,
                 rng: np.random.Generator) -> list[list[Utterance]]:
    """Enough distinct batches (sources in writable byte buffers, like pooled tar members)
    that cycling through them exceeds `cache_mb`."""
    batch_bytes = batch_size * longest * dim * np.dtype(dtype).itemsize
    batches = []
    for _ in range(max(2, int(cache_mb * MEGABYTE // batch_bytes) + 1)):
        lengths = rng.integers(int(longest * 0.9), longest + 1, batch_size)
        lengths[rng.integers(batch_size)] = longest
        batch = []
        for length in lengths:
            buffer = bytearray(rng.standard_normal((length, dim), np.float32)
                               .astype(dtype).tobytes())
            features = np.frombuffer(buffer, dtype).reshape(length, dim)
            batch.append(Utterance("u", features, np.ones(10, np.int32)))
        batches.append(batch)
    return batches


def median_ms(run: Callable[[list[Utterance]], object], batches: list[list[Utterance]],
              repeats: int) -> float:
    """Median milliseconds per batch over `repeats` passes over all batches."""
    run(batches[0])
    times = []
    for _ in range(repeats):
        for batch in batches:
            start = time.perf_counter()
            run(batch)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def plain_verdict(feats: np.ndarray) -> str:
    """The previous `feature_verdict` (numpy's `isfinite` for every dtype)."""
    finite = np.isfinite(feats)
    if finite.all():
        return ""
    nan = int(np.isnan(feats).sum())
    return f"non_finite nan={nan} inf={int(feats.size - finite.sum()) - nan}"


@contextlib.contextmanager
def verdict_of_stages(verdict: Callable[[np.ndarray], str]) -> Iterator[None]:
    """The streaming stages decide with `verdict` inside the block."""
    saved = cat.loading.stages.feature_verdict
    cat.loading.stages.feature_verdict = verdict
    try:
        yield
    finally:
        cat.loading.stages.feature_verdict = saved


def write_shards(root: Path, size_mb: float, dim: int, seed: int) -> tuple[Path, float]:
    """A corpus of `size_mb` float32 feature bytes (utterances of 300-1200 frames) packed
    as float32 and as float16 shards under `root/<dtype>`, and its tokenizer; returns the
    tokenizer and the float32 megabytes."""
    rng = np.random.default_rng(seed)
    num_utts = max(8, round(size_mb * MEGABYTE / (750 * dim * 4)))
    frames = [int(n) for n in rng.integers(300, 1201, num_utts)]
    keys = utterance_ids(num_utts, num_speakers=20)
    texts = {key: random_transcript(rng, 4, 20) for key in keys}
    corpus = write_feature_corpus(root / "feats", keys=keys, num_frames=frames, dim=dim,
                                  transcripts=texts, num_arks=4, seed=seed)
    tokenizer = root / "tokenizer.tknz"
    tokenizers.save(tokenizers.train_sentencepiece([corpus.text], "char", 0), tokenizer)
    for dtype in prep_wds.DTYPES:
        prep_wds.pack_data(corpus.feats_scp, corpus.text, root / dtype, utts_per_file=250,
                           dtype=dtype)
    return tokenizer, sum(frames) * dim * 4 / MEGABYTE


def stream_seconds(root: Path, dtype: str, tokenizer: Path, dim: int,
                   collate_fn: Callable[..., object]) -> float:
    """Seconds of one epoch of the streaming loader (in this process, page-cached shards,
    the schema's default buffers) with `collate_fn`."""
    shards = load_shard_list(str(root / dtype / "data-*.tar"))
    stream = ShardStream(shards, str(tokenizer), StreamConfig.with_defaults(), None, dim,
                         collate_fn=collate_fn)
    stream.set_epoch(1)
    start = time.perf_counter()
    for _ in stream:
        pass
    return time.perf_counter() - start


def measure_stream(size_mb: float, dim: int, repeats: int, seed: int) -> None:
    """Print the streaming loader's MB/s per dtype, before and after, best of `repeats`."""
    with tempfile.TemporaryDirectory(prefix="bench-collate-") as folder:
        root = Path(folder)
        tokenizer, megabytes = write_shards(root, size_mb, dim, seed)
        for dtype in prep_wds.DTYPES:
            stream_seconds(root, dtype, tokenizer, dim, collate)  # warm-up: page cache
            best = {"before": float("inf"), "after": float("inf")}
            for _ in range(repeats):  # interleaved, so that load changes hit both alike
                with verdict_of_stages(plain_verdict):
                    seconds = stream_seconds(root, dtype, tokenizer, dim, collate_before)
                best["before"] = min(best["before"], seconds)
                seconds = stream_seconds(root, dtype, tokenizer, dim, collate)
                best["after"] = min(best["after"], seconds)
            rates = {k: megabytes / v for k, v in best.items()}
            print(f"stream {dtype} shards, {megabytes:.0f} MB of float32 features: before "
                  f"{rates['before']:.0f} MB/s, after {rates['after']:.0f} MB/s, "
                  f"{rates['after'] / rates['before']:.2f}x", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=80, help="feature dimension")
    parser.add_argument("--repeats", type=int, default=10, help="passes over the batches")
    parser.add_argument("--cache-mb", type=float, default=96.0,
                        help="source bytes per case (more than the CPU caches)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-mb", type=float, default=200.0,
                        help="float32 feature MB of the streaming loader's corpus (0: skip)")
    parser.add_argument("--stream-repeats", type=int, default=3,
                        help="epochs per streaming variant; best kept")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as in a DataLoader worker
    rng = np.random.default_rng(args.seed)
    methods = (("pad_sequence", collate_pad_sequence), ("before", collate_before),
               ("after", collate))
    print(f"{'case':<26} {'memory':<6} " + " ".join(f"{m:>21}" for m, _ in methods)
          + "  after/before")
    for dtype in (np.float32, np.float16):
        for batch_size, longest in SHAPES:
            batches = make_batches(batch_size, longest, args.dim, dtype, args.cache_mb, rng)
            slot = np.empty(batch_size * longest * args.dim, np.float32)
            for batch in batches[:2]:
                expected = collate_before(batch).feats.numpy().tobytes()
                for name, method in methods:
                    for out in (None, slot):
                        result = method(batch, out=out)
                        feats = result.feats if isinstance(result, Batch) else result
                        if feats.numpy().tobytes() != expected:
                            raise SystemExit(f"{name} differs from before")
            batch_mb = batch_size * longest * args.dim * 4 / MEGABYTE
            case = f"{np.dtype(dtype).name} B={batch_size} T<={longest}"
            for memory, out in (("new", None), ("slot", slot)):
                times = [median_ms(lambda b, m=method, o=out: m(b, out=o), batches, args.repeats)
                         for _, method in methods]
                cells = " ".join(f"{t:8.2f} ms {batch_mb / t * 1e3:6.0f} MB/s" for t in times)
                print(f"{case:<26} {memory:<6} {cells}  {times[1] / times[2]:5.2f}x",
                      flush=True)
        sources = [[u.features for u in batch]
                   for batch in make_batches(64, 1000, args.dim, dtype, args.cache_mb, rng)]
        timings = [median_ms(lambda b, c=check: [c(f) for f in b], sources, args.repeats)
                   for check in (lambda f: bool(np.isfinite(f).all()), feature_verdict)]
        print(f"non-finite check {np.dtype(dtype).name} 64 x 1000 frames: np.isfinite "
              f"{timings[0]:.2f} ms, feature_verdict {timings[1]:.2f} ms, "
              f"{timings[0] / timings[1]:.2f}x")
    if args.stream_mb > 0:
        measure_stream(args.stream_mb, args.dim, args.stream_repeats, args.seed)


if __name__ == "__main__":
    main()
