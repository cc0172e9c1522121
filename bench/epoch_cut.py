"""Benchmark: what the DDP epoch cut leaves untrained, and whether it favours long utterances.

The streaming path ends an epoch on every rank as soon as one rank runs out of data
(`cat.shared.manager`); whatever the other ranks still hold is not trained in that
epoch. This script replays that rule in one process: one `ShardStream` per rank
(`workers: 0`), one batch per rank per step, the epoch ends at the first rank without a
batch. It uses the real stage-2 shards (`prep_wds.pack_data`) and the real pipeline, so
it measures the code, not a model of it. Two experiments:

* `bias`: 2 ranks, 8 shards of 200 utterances whose lengths are spread uniformly over
  50-1000 frames, small buffers (shuffle 300, sort 20, 2,000 frames per batch: a few
  batches per sort buffer, where a length bias shows most), `--epochs` epochs. Prints
  the share of the longest 10 % of utterances among the cut ones (10 % when unbiased).
* `balance`: 3 ranks, 5 shards of 4-30 utterances (random sizes, one draw per seed),
  `--seeds` seeds x 3 epochs. Prints the untrained share of each epoch (mean and
  worst), and the worst cut in shards per rank.

Usage:
    python bench/epoch_cut.py                  # both experiments (about 1 min)
    python bench/epoch_cut.py --epochs 60 --seeds 10
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np

from cat.loading.samples import StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.testing.epochs import (
    cut_of_epoch,
    longest_decile_share,
    write_bias_corpus,
    write_stream_corpus,
)
from cat.testing.shards import write_uneven_shards


def bias(root: Path, epochs: int) -> None:
    shards, tokenizer = write_bias_corpus(root)
    share, cut_total = longest_decile_share(shards, tokenizer, epochs)
    epoch_share = cut_total / epochs / int(shards.num_utts.sum())
    print(f"bias: {epochs} epochs, 2 ranks: {cut_total} utterances cut ({epoch_share:.1%} of "
          f"an epoch); longest decile among them: {share:.1%} (unbiased: 10%)")


def balance(root: Path, seeds: int) -> None:
    shares, worst_in_shards = [], 0.0
    for seed in range(seeds):
        rng = np.random.default_rng(100 + seed)
        sizes = [int(n) for n in rng.integers(4, 31, 5)]
        frames = [int(n) for n in rng.integers(50, 301, sum(sizes))]
        folder = root / f"balance-{seed}"
        corpus, tokenizer = write_stream_corpus(folder, frames, seed)
        write_uneven_shards(corpus, folder / "shards", sizes)
        shards = load_shard_list(str(folder / "shards/*/data-*.tar"))
        config = StreamConfig.with_defaults(batch_size=4, max_frames=0, shuffle_buffer=8,
                                            sort_buffer=8, seed=seed)
        for epoch in (1, 2, 3):
            cut, total = cut_of_epoch(shards, tokenizer, config, 3, epoch)
            shares.append(len(cut) / total)
            worst_in_shards = max(worst_in_shards, len(cut) / (3 * np.mean(sizes)))
    print(f"balance: 3 ranks, 5 uneven shards, {seeds} seeds x 3 epochs: untrained share "
          f"mean {np.mean(shares):.1%}, worst {max(shares):.1%}; worst cut = "
          f"{worst_in_shards:.2f} shards per rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=60, help="epochs of the bias run")
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the balance run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as directory:
        bias(Path(directory), args.epochs)
        balance(Path(directory), args.seeds)


if __name__ == "__main__":
    main()
