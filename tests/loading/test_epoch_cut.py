"""The epoch's end on several ranks: unbiased by length, small, and fully accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from cat.loading.samples import StreamConfig, split_ids
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.epochs import (
    cut_of_epoch,
    lockstep_epoch,
    longest_decile_share,
    write_bias_corpus,
    write_stream_corpus,
)
from cat.testing.shards import write_uneven_shards


@pytest.mark.slow
def test_the_cut_of_60_epochs_on_2_ranks_is_not_biased_towards_long_utterances(tmp_path):
    shards, tokenizer = write_bias_corpus(tmp_path)
    share, cut = longest_decile_share(shards, tokenizer, epochs=60, seed=0)
    # The longest 10 % of the corpus made 25.7 % of the cut when the sort buffer's last
    # batch was carried into the next buffer again and again.
    assert cut > 100 and share <= 0.15


def test_cut_ids_are_exactly_what_no_rank_trained_dropped_or_lost(tmp_path):
    rng = np.random.default_rng(3)
    sizes = [5, 17, 9, 26, 12]
    corpus, tokenizer = write_stream_corpus(tmp_path, [int(n) for n in
                                                       rng.integers(50, 301, sum(sizes))], 3)
    write_uneven_shards(corpus, tmp_path / "shards", sizes)
    shards = load_shard_list(str(tmp_path / "shards/*/data-*.tar"))
    config = StreamConfig.with_defaults(batch_size=4, max_frames=0, shuffle_buffer=8,
                                        sort_buffer=8, seed=3)
    streams = [ShardStream(shards, str(tokenizer), config, None, 2, rank, 3) for rank in range(3)]
    for epoch in (1, 2, 3):
        progresses = lockstep_epoch(streams, epoch)
        cut = np.concatenate([p.cut_ids() for p in progresses])
        assert len(cut) == len(set(cut.tolist())) == \
            sum(p.summary()["not_trained"] for p in progresses)
        summaries = [p.summary() for p in progresses]
        assert sum(s["trained"] + s["not_trained"] for s in summaries) == sum(sizes)
        # Every cut id names an utterance of the rank that held it.
        for progress, rank_cut in zip(progresses, (p.cut_ids() for p in progresses),
                                      strict=True):
            shard_of, ordinals = split_ids(rank_cut)
            assert set(shard_of.tolist()) <= set(progress.rank_shards)
            assert (ordinals < shards.num_utts[shard_of]).all()


def test_uneven_shards_leave_less_than_one_shard_per_rank_untrained(tmp_path):
    worst = 0.0
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        sizes = [int(n) for n in rng.integers(4, 31, 5)]
        corpus, tokenizer = write_stream_corpus(
            tmp_path / str(seed), [int(n) for n in rng.integers(50, 301, sum(sizes))], seed)
        write_uneven_shards(corpus, tmp_path / str(seed) / "shards", sizes)
        shards = load_shard_list(str(tmp_path / str(seed) / "shards/*/data-*.tar"))
        config = StreamConfig.with_defaults(batch_size=4, max_frames=0, shuffle_buffer=8,
                                            sort_buffer=8, seed=seed)
        for epoch in (1, 2):
            cut, total = cut_of_epoch(shards, tokenizer, config, 3, epoch)
            worst = max(worst, len(cut) / (3 * total / len(sizes)))
    # Shuffled dealing cut up to 0.65 shards per rank (39 % of an epoch) on these shards.
    assert worst < 0.5
