"""Shared-memory batch hand-over (`cat.loading.transport`): the batches a `RingLoader`
yields equal plain `collate` batches, slots are reused only once nothing views them, and
every case without a slot falls back to torch's own hand-over."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from cat.loading.batch import Utterance, collate
from cat.loading.transport import FREE, HELD, BatchRing, RingLoader, SharedCollate

FEAT_DIM = 4


class Utterances(torch.utils.data.Dataset):
    """Utterance i: i + 1 frames filled with i, a label of i % 3 + 1 ids."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Utterance:
        features = np.full((index + 1, FEAT_DIM), index, np.float32)
        return Utterance(f"utt{index:03d}", features,
                         np.arange(1, index % 3 + 2, dtype=np.int32))


BATCHES = [[0, 5, 2], [7, 1], [3, 4, 6, 8], [9], [11, 10]]


def expected(indices: list[int]):
    dataset = Utterances(12)
    return collate([dataset[i] for i in indices])


def make_loader(collate_fn, workers: int = 2, persistent: bool = False,
                batches=BATCHES) -> RingLoader:
    loader = torch.utils.data.DataLoader(
        Utterances(12), batch_sampler=batches, collate_fn=collate_fn, num_workers=workers,
        persistent_workers=persistent and workers > 0,
        multiprocessing_context="fork" if workers else None)
    return RingLoader(loader, collate_fn if isinstance(collate_fn, SharedCollate) else None)


def assert_same(batch, reference) -> None:
    assert batch.keys == reference.keys
    assert batch.feats.dtype == torch.float32
    assert torch.equal(batch.feats, reference.feats)
    assert torch.equal(batch.feat_lens, reference.feat_lens)
    assert torch.equal(batch.labels, reference.labels)
    assert torch.equal(batch.label_lens, reference.label_lens)


def test_ring_batches_equal_plain_collate_and_use_the_rings():
    shared = SharedCollate(slot_bytes=12 * 12 * FEAT_DIM * 4, num_slots=3)
    loader = make_loader(shared)
    batches = []
    for batch in loader:
        batches.append(batch)
    for batch, indices in zip(batches, BATCHES, strict=True):
        assert_same(batch, expected(indices))
    assert loader.counts == {"ring": len(BATCHES), "plain": 0}


def test_collate_into_a_used_slot_zeroes_the_padding():
    dataset = Utterances(12)
    utterances = [dataset[3], dataset[0]]
    slot = np.full(64, 7.0, np.float32)  # what an earlier, longer batch left there
    batch = collate(utterances, out=slot)
    assert_same(batch, collate(utterances))
    assert np.shares_memory(batch.feats.numpy(), slot)
    assert batch.feats[1, 1:].abs().sum() == 0


def test_slot_is_held_while_a_view_lives_and_freed_after():
    ring = BatchRing(num_slots=2, slot_bytes=64)
    slot, generation = ring.claim(32)
    ring.slots[slot][:32].view(np.float32)[:] = np.arange(8)
    feats = ring.receive(slot, generation, (2, 4), np.dtype(np.float32))
    view = feats[1]
    del feats
    gc.collect()
    assert ring.states[slot] == HELD          # the row view keeps the slot
    assert view.tolist() == [4.0, 5.0, 6.0, 7.0]
    del view
    gc.collect()
    assert ring.states[slot] == FREE


def test_full_ring_and_oversized_batches_fall_back_to_plain_batches():
    # Slots fit 6 frames; batch [11, 10] pads to 12 frames and must travel plainly.
    shared = SharedCollate(slot_bytes=2 * 6 * FEAT_DIM * 4, num_slots=1)
    batches = [[0, 1], [2, 3], [4, 5], [11, 10]]
    loader = make_loader(shared, workers=1, batches=batches)
    kept = list(loader)  # holding every batch: the single slot stays HELD
    for batch, indices in zip(kept, batches, strict=True):
        assert_same(batch, expected(indices))
    # The first batch takes the slot and keeps it; the next two find it taken, and the
    # last is too large for it.
    assert loader.counts == {"ring": 1, "plain": 3}


def test_without_workers_collate_is_plain():
    shared = SharedCollate(slot_bytes=1 << 16, num_slots=2)
    loader = make_loader(shared, workers=0)
    for batch, indices in zip(loader, BATCHES, strict=True):
        assert_same(batch, expected(indices))
    assert loader.counts == {"ring": 0, "plain": len(BATCHES)}


def test_persistent_workers_survive_an_abandoned_epoch():
    shared = SharedCollate(slot_bytes=12 * 12 * FEAT_DIM * 4, num_slots=2)
    loader = make_loader(shared, workers=2, persistent=True)
    for _ in range(3):
        iterator = iter(loader)
        first = next(iterator)  # abandon the epoch after one batch (others in flight)
        assert_same(first, expected(BATCHES[0]))
        del first, iterator
        gc.collect()
    # Slots claimed for the abandoned epochs' batches (drained unseen when the next
    # epoch reset the workers) are reclaimed one epoch later: after two whole epochs
    # with every batch freed, every slot is free again.
    for _ in range(2):
        for batch, indices in zip(loader, BATCHES, strict=True):
            assert_same(batch, expected(indices))
            del batch
        gc.collect()
    rings = loader._persistent_rings
    assert rings is not None
    for ring in rings.rings:
        assert (ring.states == FREE).all(), ring.states
    assert loader.counts["ring"] > 0


def test_overwritten_slot_is_detected():
    ring = BatchRing(num_slots=1, slot_bytes=64)
    slot, generation = ring.claim(16)
    ring.next_generation()
    assert ring.reclaim() == 1
    with pytest.raises(RuntimeError, match="overwritten in flight"):
        ring.receive(slot, generation, (1, 4), np.dtype(np.float32))


def test_rejects_a_pinning_dataloader():
    loader = torch.utils.data.DataLoader(Utterances(2), batch_size=1, collate_fn=collate,
                                         pin_memory=True)
    with pytest.raises(ValueError, match="pin_memory=False"):
        RingLoader(loader, SharedCollate(64, 1))
