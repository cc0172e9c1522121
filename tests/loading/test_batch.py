"""Map-style data: collate, length filter, bucketing distributed batch sampler, dataset."""

from __future__ import annotations

import warnings

import kaldiio
import numpy as np
import pytest
import torch

from cat.formats.mappack import write_map_pack
from cat.formats.tables import FrameRange
from cat.loading.batch import (
    BucketBatchSampler,
    LengthFilter,
    PackDataset,
    StreamEvents,
    Utterance,
    collate,
    form_batches,
    label_repeats,
)
from cat.models.encoder import ConformerNet
from cat.testing.features import write_feature_corpus
from cat.text import tokenizer as tk
from cat.training.setup import build_length_filter


def _conv_lengths(frames):
    return np.maximum(((np.asarray(frames) - 1) // 2 - 1) // 2, 0)


def _filter(frame_range=None, ctc=True, limit=200):
    return LengthFilter(frame_range, _conv_lengths(np.arange(limit + 1)), 4, ctc)


def test_collate_pads_features_and_labels():
    rng = np.random.default_rng(0)
    utterances = [Utterance("a", rng.normal(size=(5, 3)).astype(np.float32), np.array([3, 4])),
                  Utterance("b", rng.normal(size=(2, 3)).astype(np.float16), np.array([7, 8, 9]),
                            sample_id=(4 << 32) | 7)]
    events = StreamEvents(finished=[(4, 2)])
    batch = collate(utterances, events)
    assert batch.keys == ["a", "b"] and len(batch) == 2 and batch.num_frames == 7
    assert batch.feats.dtype == torch.float32 and batch.feats.shape == (2, 5, 3)
    assert torch.equal(batch.feats[0], torch.from_numpy(utterances[0].features))
    second = torch.from_numpy(utterances[1].features.astype(np.float32))
    assert torch.equal(batch.feats[1, :2], second)
    assert torch.count_nonzero(batch.feats[1, 2:]) == 0
    assert batch.feat_lens.tolist() == [5, 2] and batch.label_lens.tolist() == [2, 3]
    assert batch.labels.tolist() == [[3, 4, 0], [7, 8, 9]] and batch.labels.dtype == torch.int64
    assert batch.ids.tolist() == [-1, (4 << 32) | 7] and batch.events is events
    moved = batch.to("cpu")
    assert torch.equal(moved.feats, batch.feats) and moved.keys == batch.keys
    with pytest.raises(ValueError, match="empty list"):
        collate([])


def _reference_feats(utterances):
    """Zero-padded float32 features, built the plain way."""
    longest = max(len(u.features) for u in utterances)
    feats = np.zeros((len(utterances), longest, utterances[0].features.shape[1]), np.float32)
    for row, utterance in enumerate(utterances):
        feats[row, :len(utterance.features)] = utterance.features.astype(np.float32)
    return feats


def _in_buffer(array, writable=True):
    """`array` as a view on member bytes, as the stream's `.npy` decoding gives it."""
    data = array.tobytes()
    return np.frombuffer(bytearray(data) if writable else data,
                         array.dtype).reshape(array.shape)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("writable", [True, False])
@pytest.mark.parametrize("lengths", [[1], [7, 0, 3, 7, 1], [0], [4, 4]])
def test_collate_equals_a_plain_padding_byte_for_byte(dtype, writable, lengths):
    rng = np.random.default_rng(len(lengths))
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, np.inf, -np.inf, 1.5])
    utterances = []
    for index, length in enumerate(lengths):
        values = rng.normal(scale=100, size=(length, 9))
        values.flat[:min(values.size, len(special))] = special[:values.size]
        utterances.append(Utterance(f"u{index}", _in_buffer(values.astype(dtype), writable),
                                    np.arange(1, index + 2, dtype=np.int32)))
    expected = _reference_feats(utterances)
    slot = np.full(expected.size + 5, np.nan, np.float32)  # stale contents, as in a ring
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch refusing a read-only array
        batches = [collate(utterances), collate(utterances, out=slot)]
    for batch in batches:
        assert batch.feats.dtype == torch.float32
        assert batch.feats.numpy().tobytes() == expected.tobytes()
        assert batch.feat_lens.tolist() == lengths
        assert batch.labels.tolist() == [list(range(1, i + 2)) + [0] * (len(lengths) - i - 1)
                                         for i in range(len(lengths))]
    assert not expected.size or np.shares_memory(batches[1].feats.numpy(), slot)


def test_label_repeats_match_a_direct_count():
    rng = np.random.default_rng(1)
    sequences = [rng.integers(2, 5, n) for n in (0, 1, 4, 7, 3, 0, 9)]
    flat = np.concatenate(sequences)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])])
    expected = [int(np.count_nonzero(s[1:] == s[:-1])) for s in sequences]
    assert label_repeats(flat, offsets).tolist() == expected


def test_length_filter_reasons():
    length_filter = _filter(FrameRange(10, 100))
    assert length_filter.reason(9, np.array([2])).startswith("out_of_range num_frames=9")
    assert length_filter.reason(100, np.array([2])).startswith("out_of_range")
    assert length_filter.reason(10, np.array([2])) == ""  # 10 frames -> 1 encoder frame
    assert length_filter.reason(30, np.array([2] * 6)).startswith(
        "label_too_long encoder_frames=6 labels+repeats=11")
    assert length_filter.reason(30, np.array([2, 3, 2, 3, 2, 3])) == ""
    assert _filter(None).reason(6, np.array([2])).startswith("no_encoder_frames")
    rnnt = _filter(None, ctc=False)
    assert rnnt.reason(30, np.array([2] * 50)) == "" and rnnt.reason(6, np.array([2])) != ""
    # Vectorised and per-utterance decisions agree, also beyond the length table.
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 400, 300)
    labels = [rng.integers(2, 4, n) for n in rng.integers(1, 40, 300)]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in labels])])
    flat = np.concatenate(labels)
    for check in (_filter(FrameRange(5, 350)), _filter(None, ctc=False)):
        vectorised = check.reasons(frames, np.diff(offsets), label_repeats(flat, offsets))
        assert vectorised.tolist() == [check.reason(int(f), x)
                                       for f, x in zip(frames, labels, strict=True)]


def test_filter_uses_the_encoder_subsampling():
    encoder = ConformerNet(idim=8, hdim=8, num_cells=1, num_heads=2, time_reduction_factor=2)
    model = torch.nn.Module()
    model.encoder = encoder
    length_filter = build_length_filter(model, FrameRange(0, 50), longest=5000)
    frames = torch.arange(0, 8000)
    exact = encoder.output_lengths(frames).numpy()
    ours = length_filter.output_frames(frames.numpy())
    assert np.array_equal(ours[:5001], exact[:5001])
    # Beyond the table the count is extrapolated with the frame-rate factor.
    assert np.abs(ours[5001:] - exact[5001:]).max() <= 1
    assert length_filter.frame_rate_factor == 8 and not length_filter.ctc


def test_form_batches_respects_both_budgets():
    rng = np.random.default_rng(3)
    frames = rng.integers(5, 200, 500)
    order = np.argsort(frames, kind="stable")
    for batch_size, max_frames in ((8, 0), (64, 600), (3, 10**6), (50, 100)):
        batches = form_batches(frames, order, batch_size, max_frames)
        assert np.array_equal(np.concatenate(batches), order)
        for batch in batches:
            assert 1 <= len(batch) <= batch_size
            if max_frames and len(batch) > 1:
                assert frames[batch].max() * len(batch) <= max_frames


def test_sampler_single_rank_covers_kept_utterances_once_per_epoch():
    rng = np.random.default_rng(4)
    frames = rng.integers(5, 100, 200)
    keep = np.setdiff1d(np.arange(200), [3, 50, 199])
    sampler = BucketBatchSampler(frames, keep, batch_size=16, max_frames=500, seed=7)
    orders = []
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        seen = np.concatenate(batches)
        assert np.array_equal(np.sort(seen), keep)
        orders.append(seen.tolist())
    assert orders[0] != orders[1]
    again = BucketBatchSampler(frames, keep, batch_size=16, max_frames=500, seed=7)
    again.set_epoch(2)
    assert np.concatenate(list(again)).tolist() == orders[1]
    other_seed = BucketBatchSampler(frames, keep, batch_size=16, max_frames=500, seed=8)
    other_seed.set_epoch(2)
    assert np.concatenate(list(other_seed)).tolist() != orders[1]
    again.set_epoch(2, start=3)
    assert [b for b in again] == [b for b in list(sampler)[3:]]


def test_sampler_deals_equal_batch_counts_to_ranks():
    rng = np.random.default_rng(5)
    frames = rng.integers(5, 100, 301)
    samplers = [BucketBatchSampler(frames, np.arange(301), 8, 400, seed=1, rank=r, world_size=3)
                for r in range(3)]
    for epoch in (1, 2):
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            per_rank.append([np.asarray(b) for b in sampler])
        assert len({len(batches) for batches in per_rank}) == 1
        left_over = samplers[0].plan(epoch)[1]
        assert len(left_over) < 3
        seen = np.concatenate([b for batches in per_rank for b in batches] + left_over)
        assert np.array_equal(np.sort(seen), np.arange(301))
    evaluation = [BucketBatchSampler(frames, np.arange(301), 8, 400, rank=r, world_size=3,
                                     shuffle=False) for r in range(3)]
    seen = np.concatenate([b for sampler in evaluation for b in sampler])
    assert np.array_equal(np.sort(seen), np.arange(301))
    assert evaluation[0].plan(1)[1] == []
    with pytest.raises(ValueError, match="rank 3 outside a world of 3"):
        BucketBatchSampler(frames, np.arange(3), 8, 0, rank=3, world_size=3)


def test_pack_dataset_reads_the_arks_and_checks_the_dimension(tmp_path):
    corpus = write_feature_corpus(tmp_path / "corpus", num_utts=6, dim=5, frame_range=(4, 9))
    tokenizer = tmp_path / "char.tknz"
    tk.save(tk.train_sentencepiece([corpus.text], "char", 0), tokenizer)
    write_map_pack(corpus.feats_scp, corpus.text, tokenizer, tmp_path / "train.npz")
    dataset = PackDataset(tmp_path / "train.npz", feat_dim=5)
    assert len(dataset) == 6
    for index in range(len(dataset)):
        utterance = dataset[index]
        location = dict(line.split() for line in corpus.feats_scp.read_text().splitlines())
        assert np.array_equal(utterance.features, kaldiio.load_mat(location[utterance.key]))
        assert tk.load(tokenizer).decode(utterance.label) == corpus.transcripts[utterance.key]
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=BucketBatchSampler(dataset.num_frames, np.arange(6), 4, 0),
        collate_fn=collate, num_workers=1)
    assert sorted(k for batch in loader for k in batch.keys) == corpus.keys
    dataset.pack.close()
    wrong = PackDataset(tmp_path / "train.npz", feat_dim=80, feat_dim_source="config idim")
    with pytest.raises(ValueError, match=r"train.npz: utterance 'BAC009S0001W0000' has features "
                                         r"of shape \(\d+, 5\), but config idim is 80"):
        wrong[0]
