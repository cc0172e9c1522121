"""Training-data adapters: the global CMVN sample of shards, epoch logs across a resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cat.core import config as config_module
from cat.formats.tables import FrameRange
from cat.loading.batch import LengthFilter
from cat.loading.shardlist import ShardList, load_shard_list
from cat.loading.tar import CorruptShardError
from cat.testing.features import write_feature_corpus
from cat.testing.shards import truncate_file, write_shards
from cat.text import tokenizer as tk
from cat.training.distributed import DistributedContext
from cat.training.train_data import EpochLog, StreamTrainData, identity_changes


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """60 utterances in two length groups (20-69 and 70-119 frames), 5 per shard, and a
    character tokenizer of their transcripts."""
    root = tmp_path_factory.mktemp("grouped")
    corpus = write_feature_corpus(root / "feats", num_utts=60, dim=3, frame_range=(20, 119))
    write_shards(corpus, root / "wds", 5, filter_group=["0:70", "70:"])
    tk.save(tk.train_sentencepiece([corpus.text], "char", 0), root / "tokenizer.tknz")
    return root


def _cmvn_sample(root, shards: ShardList, seed: int, strict: bool = False, max_utts: int = 20
                 ) -> list[tuple[str, np.ndarray]]:
    """The global CMVN sample of the streaming training data over `shards` (every length
    passes its filter)."""
    options = config_module.TrainOptions(
        large_dataset=True, trset=[f"{root}/wds/*/data-*.tar"], workers=0, seed=seed,
        tokenizer=str(root / "tokenizer.tknz"), strict_shards=strict)
    length_filter = LengthFilter(None, np.arange(200), 1, ctc=False)
    data = StreamTrainData(options, length_filter, 3, DistributedContext(),
                           root / "log", shards)
    try:
        return [(name, features.copy()) for name, features in data.feature_samples(max_utts)]
    finally:
        data.close()


def test_cmvn_sample_spans_every_length_group_and_follows_the_seed(grouped):
    shards = load_shard_list(f"{grouped}/wds/*/data-*.tar")
    first = [f for _, f in _cmvn_sample(grouped, shards, seed=0)]
    assert len(first) == 20
    lengths = [len(f) for f in first]
    # Shards are read in a seeded order across groups, not the short group first.
    assert min(lengths) < 70 <= max(lengths)
    again = [f for _, f in _cmvn_sample(grouped, shards, seed=0)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    other = [f for _, f in _cmvn_sample(grouped, shards, seed=1)]
    assert [len(f) for f in other] != lengths


def test_cmvn_sample_skips_a_corrupt_shard_unless_strict(grouped, tmp_path, caplog):
    shards = load_shard_list(f"{grouped}/wds/*/data-*.tar")
    order = np.random.default_rng([0, 1]).permutation(len(shards))
    broken = tmp_path / "broken.tar"
    shutil.copy(shards.urls[order[0]], broken)
    truncate_file(broken, 0.05)  # inside its first utterance
    shards.urls[order[0]] = str(broken)
    features = _cmvn_sample(grouped, shards, seed=0)
    assert len(features) == 20 and "broken.tar" not in "".join(n for n, _ in features)
    assert "skipping the rest of shard" in caplog.text and "broken.tar" in caplog.text
    with pytest.raises(CorruptShardError, match=r"broken.tar: .*strict_shards.*global CMVN"):
        _cmvn_sample(grouped, shards, seed=0, strict=True)


def test_cmvn_sample_has_the_loader_verdicts(grouped):
    """Utterances the loader leaves out (here: by the length filter) are not sampled."""
    shards = load_shard_list(f"{grouped}/wds/*/data-*.tar")
    options = config_module.TrainOptions(
        large_dataset=True, trset=[f"{grouped}/wds/*/data-*.tar"], workers=0,
        tokenizer=str(grouped / "tokenizer.tknz"), filter="0:70")
    short = LengthFilter(FrameRange.parse("0:70"), np.arange(200), 1, ctc=False)
    data = StreamTrainData(options, short, 3, DistributedContext(), grouped / "log", shards)
    lengths = [len(f) for _, f in data.feature_samples(60)]
    data.close()
    assert lengths and max(lengths) < 70


def test_epoch_log_is_cut_back_to_the_checkpoint_on_resume(tmp_path):
    log = EpochLog(tmp_path / "utts/epoch-001.rank-0.txt")
    log.start(None)
    log.write(["a b", "c d"])
    size = log.mark()
    log.write(["e f"])  # written after the checkpoint, then the run was killed
    log.close()
    resumed = EpochLog(log.path)
    resumed.start(size)
    resumed.write(["e f", "g h"])
    resumed.close()
    assert log.path.read_text() == "a b\nc d\ne f\ng h\n"
    fresh = EpochLog(log.path)
    fresh.start(None)  # a new epoch (or one restarted from its beginning) starts empty
    assert not log.path.exists() and fresh.mark() == 0


def test_identity_changes_name_what_changed():
    recorded = {"kind": "stream", "world_size": 2, "batching": [64, 20000, 3000, 500]}
    assert identity_changes(recorded, dict(recorded)) == []
    changed = {**recorded, "world_size": 3}
    assert identity_changes(recorded, changed) == ["world_size 2 -> 3"]
    assert "older format" in identity_changes(None, recorded)[0]
