"""Benchmark: the resume position every streaming batch carries, built two ways.

A worker's `WorkerPosition` names the sample ids held in its shuffle buffer, sort buffer
and cut batches after each batch. The schema defaults (shuffle buffer 3000, sort buffer
500, batch 64) are run over synthetic samples through the real stages
(`cat.loading.stages.ShuffleBuffer`, `SortBatcher`), and after every batch the position's
id arrays are built:

* `ids kept`    as the stream builds them: copies of the id arrays the stages keep
                alongside their samples (`sample_ids`, `buffer_ids`, `pending_ids`);
* `dict pass`   as it built them before: one pass over every held sample's dict per
                array (`np.fromiter(s["id"] for s in samples)`).

Both include `random.Random.getstate()` as the position has it. Printed: microseconds per
batch, and the share of a batch's time at the feature-shard loader's rate per worker
(`--batch-ms`, the time one worker takes for a batch of 64 feature utterances).

Usage:
    python bench/positions.py --samples 20000 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import numpy as np

from cat.loading.stages import ShuffleBuffer, SortBatcher


def _dict_pass(shuffle: ShuffleBuffer, batcher: SortBatcher) -> tuple:
    def ids(samples):
        return np.fromiter((s["id"] for s in samples), np.int64)
    return (ids(shuffle.samples), ids(batcher.buffer), [ids(b) for b in batcher.pending],
            shuffle.rng.getstate())


def _ids_kept(shuffle: ShuffleBuffer, batcher: SortBatcher) -> tuple:
    return (shuffle.sample_ids(), batcher.buffer_ids(), list(batcher.pending_ids),
            shuffle.rng.getstate())


def _run(samples: list[dict], build) -> tuple[float, int]:
    """Seconds spent building positions over one pass, and the batches."""
    rng = random.Random(1)
    shuffle, batcher = ShuffleBuffer(3000, rng), SortBatcher(500, 64, 0, rng)
    spent, batches = 0.0, 0
    for _ in batcher(shuffle(iter(samples))):
        start = time.perf_counter()
        build(shuffle, batcher)
        spent += time.perf_counter() - start
        batches += 1
    return spent, batches


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-ms", type=float, default=64 / 4278 * 1000,
                        help="one worker's time per batch of 64 feature utterances "
                             "(default: 4,278 utt/s, bench/audio_loader.py's figure)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = rng.integers(300, 500, args.samples)
    samples = [{"id": i, "key": f"U{i:08d}", "features": range(int(n))}
               for i, n in enumerate(lengths)]
    rows = []
    for name, build in (("dict pass (before)", _dict_pass), ("ids kept (now)", _ids_kept)):
        best = min(_run(samples, build)[0] for _ in range(args.repeats))
        batches = _run(samples, build)[1]
        rows.append((name, best / batches * 1e6))
    print(f"{args.samples} samples, shuffle buffer 3000, sort buffer 500, batch 64; "
          f"best of {args.repeats}")
    print(f"{'position built by':<22} {'us/batch':>9} {'share of a batch':>17}")
    for name, micros in rows:
        print(f"{name:<22} {micros:>9.1f} {micros / 1e3 / args.batch_ms:>16.1%}")
    print(f"speed-up: {rows[0][1] / rows[1][1]:.1f}x")


if __name__ == "__main__":
    main()
