"""Tests of SpecAugment on padded batches."""

from __future__ import annotations

import pytest
import torch

from cat.models.specaug import SpecAugment


def padded_batch(lengths: list[int], dim: int = 40, pad_value: float = -7.0) -> torch.Tensor:
    """Features of value 1 + small noise on valid frames and `pad_value` on padding."""
    feats = torch.full((len(lengths), max(lengths), dim), pad_value)
    for index, length in enumerate(lengths):
        feats[index, :length] = 1.0 + 0.01 * torch.rand(length, dim)
    return feats


def runs(flags: list[bool]) -> list[int]:
    """Lengths of the runs of True values."""
    lengths, current = [], 0
    for flag in flags:
        if flag:
            current += 1
        elif current:
            lengths.append(current)
            current = 0
    return [*lengths, current] if current else lengths


def test_frequency_masks_are_within_bounds():
    augment = SpecAugment(num_freq_masks=2, max_freq_mask_width=5, max_freq_mask_ratio=None,
                          num_time_masks=0)
    lengths = [50, 30, 20, 10]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = augment(padded_batch(lengths), torch.tensor(lengths), generator)
        for index, length in enumerate(lengths):
            masked_bins = (out[index, :length] == 0).all(dim=0)
            # A masked bin is masked on every valid frame, and never on padding.
            assert torch.equal((out[index, :length] == 0).any(dim=0), masked_bins)
            assert int(masked_bins.sum()) <= 10
            assert all(run <= 10 for run in runs(masked_bins.tolist()))
            assert torch.all(out[index, length:] == -7.0)


def test_frequency_ratio_bounds_width():
    augment = SpecAugment(num_freq_masks=1, max_freq_mask_ratio=0.1, num_time_masks=0)
    generator = torch.Generator().manual_seed(3)
    widths = set()
    for _ in range(50):
        out = augment(padded_batch([20]), torch.tensor([20]), generator)
        widths.add(int((out[0] == 0).all(dim=0).sum()))
    assert widths <= set(range(0, 5))
    assert len(widths) > 1


def test_time_masks_stay_inside_each_utterance():
    augment = SpecAugment(num_freq_masks=0, num_time_masks=3, max_time_mask_width=8,
                          max_time_mask_ratio=0.2)
    lengths = [60, 40, 12]
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        out = augment(padded_batch(lengths), torch.tensor(lengths), generator)
        for index, length in enumerate(lengths):
            masked_frames = (out[index, :length] == 0).all(dim=1)
            assert torch.equal((out[index, :length] == 0).any(dim=1), masked_frames)
            max_width = min(8, int(0.2 * length))
            assert int(masked_frames.sum()) <= 3 * max_width
            assert torch.all(out[index, length:] == -7.0)


def test_something_is_masked_with_default_settings():
    lengths = [80, 80]
    out = SpecAugment()(padded_batch(lengths), torch.tensor(lengths),
                        torch.Generator().manual_seed(0))
    assert int((out == 0).sum()) > 0


def test_same_seed_gives_same_masks_and_other_seeds_differ():
    augment = SpecAugment(max_time_warp=3)
    lengths = [50, 35]
    feats = padded_batch(lengths)
    first = augment(feats, torch.tensor(lengths), torch.Generator().manual_seed(7))
    again = augment(feats, torch.tensor(lengths), torch.Generator().manual_seed(7))
    other = augment(feats, torch.tensor(lengths), torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_input_is_not_modified():
    feats = padded_batch([30])
    copy = feats.clone()
    SpecAugment(max_time_warp=2)(feats, torch.tensor([30]), torch.Generator().manual_seed(0))
    assert torch.equal(feats, copy)


def test_mean_mask_value_uses_the_utterance_mean():
    augment = SpecAugment(num_freq_masks=1, max_freq_mask_width=40, max_freq_mask_ratio=None,
                          num_time_masks=0, mask_value="mean")
    feats = torch.full((1, 10, 40), 3.0)
    feats[0, 8:] = 100.0  # padding must not enter the mean
    lengths = torch.tensor([8])
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        out = augment(feats, lengths, generator)
        torch.testing.assert_close(out[0, :8], feats[0, :8])
        assert torch.all(out[0, 8:] == 100.0)


def test_time_warp_keeps_padding_and_values_range():
    augment = SpecAugment(num_freq_masks=0, num_time_masks=0, max_time_warp=4)
    lengths = [40, 25, 6]
    feats = padded_batch(lengths)
    ramp = torch.arange(40, dtype=torch.float32)[:, None].expand(40, 40)
    feats[0] = ramp
    generator = torch.Generator().manual_seed(5)
    changed = False
    for _ in range(10):
        out = augment(feats, torch.tensor(lengths), generator)
        assert torch.equal(out[1, 25:], feats[1, 25:])
        # Too short to warp (needs more than 2 * window + 1 frames).
        assert torch.equal(out[2], feats[2])
        # Warping a ramp keeps it monotonic and inside its range.
        column = out[0, :, 0]
        assert torch.all(column[1:] >= column[:-1] - 1e-5)
        assert float(column.min()) >= 0.0
        assert float(column.max()) <= 39.0
        changed |= not torch.equal(out[0], feats[0])
    assert changed


def test_disabled_augment_is_identity():
    feats = padded_batch([20, 10])
    out = SpecAugment(num_freq_masks=0, num_time_masks=0)(feats, torch.tensor([20, 10]))
    assert torch.equal(out, feats)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mask_value": "noise"}, "mask_value"),
    ({"max_time_mask_ratio": 1.5}, "max_time_mask_ratio"),
    ({"num_time_masks": -1}, "num_time_masks"),
])
def test_invalid_options_raise_with_the_option_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecAugment(**kwargs)


def test_start_batch_delays_augmentation_and_counts_in_the_state_dict():
    augment = SpecAugment(num_freq_masks=2, max_freq_mask_width=4, num_time_masks=2,
                          max_time_mask_width=5, start_batch=2)
    feats = torch.ones(3, 20, 8)
    lengths = torch.tensor([20, 15, 10])
    for _ in range(2):
        assert torch.equal(augment(feats, lengths), feats)
    generator = torch.Generator().manual_seed(0)
    assert not torch.equal(augment(feats, lengths, generator), feats)
    assert int(augment.state_dict()["batches_seen"]) == 3


def test_start_batch_counts_on_from_a_loaded_state_without_reading_the_device():
    from cat.testing.device_reads import DeviceReads

    augment = SpecAugment(num_freq_masks=2, max_freq_mask_width=4, num_time_masks=2,
                          max_time_mask_width=5, start_batch=3)
    feats = torch.ones(3, 20, 8)
    lengths = torch.tensor([20, 15, 10])
    assert torch.equal(augment(feats, lengths), feats)  # batch 1: the count read once
    with DeviceReads(device=augment, host=[feats, lengths]) as reads:
        for _ in range(5):
            augment(feats, lengths)
    assert reads.found == []
    assert int(augment.batches_seen) == 6
    # a resumed run: the loaded count decides, not the one counted before loading
    resumed = SpecAugment(num_freq_masks=2, max_freq_mask_width=4, num_time_masks=2,
                          max_time_mask_width=5, start_batch=3)
    assert torch.equal(resumed(feats, lengths), feats)
    resumed.load_state_dict({"batches_seen": torch.tensor(2)})
    assert torch.equal(resumed(feats, lengths), feats)  # batch 3
    generator = torch.Generator().manual_seed(0)
    assert not torch.equal(resumed(feats, lengths, generator), feats)  # batch 4
