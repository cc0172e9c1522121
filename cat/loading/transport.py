"""Hand padded batches from DataLoader workers to the training process through reused memory.

Torch's DataLoader moves every tensor a worker returns into new shared memory: the worker
writes into fresh pages (a page fault per 4 KiB, about 3 ms per 6 MB batch measured) and
the training process fetches each segment's file descriptor over a new connection to
the worker (about 0.85 ms). Here each worker instead pads its batches into a ring of
slots (`BatchRing`) allocated once, before the workers start, and mapped by both
processes; only a small `SlotBatch` (worker, slot, shape, keys, lengths, labels, events)
goes through the DataLoader's queue, and `RingLoader` turns it back into a `Batch` whose
features are a view on the slot.

Life of a slot (an int64 per slot in the ring's shared header):

    FREE (0) --worker claims and fills it--> in flight (the ring's generation, > 0)
      --the training process receives it--> HELD (-1)
      --the last tensor viewing its features is freed--> FREE

A slot is given back only when no tensor views it any more (a `Batch` kept in a list,
a slice of its features and `.numpy()` arrays all keep it), never earlier. A worker that
finds no free slot (the training loop keeps many batches) or a batch too large for a
slot returns a plain `Batch` (torch's own hand-over): nothing ever waits for a slot.
Persistent workers survive epochs, and the DataLoader drops the descriptors of an epoch
abandoned early without showing them; every iteration therefore starts a new generation
and, once the DataLoader has reset its workers, slots still in flight from an older
generation are freed. Non-persistent workers get new rings every iteration.

The memory is torch's shared memory (file-descriptor strategy by default: the segment
has no name once created, so nothing is left in /dev/shm, even after a crash); it is
released when the workers have exited and the last batch viewing it is freed.

Usage:
    collate = SharedCollate(slot_bytes=20000 * 80 * 4, num_slots=7)
    loader = RingLoader(torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                        collate_fn=collate, num_workers=2), collate)
    for batch in loader: ...  # cat.loading.batch.Batch
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from cat.features.fbank import FbankOptions
from cat.loading.batch import Batch, StreamEvents, Utterance, collate, padded_bytes

FREE = 0
HELD = -1
_PAGE = 4096


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _free_slot(states: np.ndarray, slot: int) -> None:
    states[slot] = FREE


class BatchRing:
    """One worker's slots in shared memory: a header (generation, slot states), then slots.

    Created in the training process; the worker inherits it (fork) or receives it once
    when it starts (spawn: torch passes the segment's descriptor).
    """

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots of some bytes, got {num_slots} x {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = _round_up(slot_bytes, _PAGE)
        self.header_bytes = _round_up(8 * (1 + num_slots), _PAGE)
        storage = torch.UntypedStorage._new_shared(
            self.header_bytes + num_slots * self.slot_bytes)
        self.memory = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._map()
        self.header[0] = 1

    def _map(self) -> None:
        array = self.memory.numpy()
        # [generation, state of slot 0, ..., state of slot n-1]
        self.header = array[:8 * (1 + self.num_slots)].view(np.int64)
        self.states = self.header[1:]
        self.slots = [array[start:start + self.slot_bytes]
                      for start in range(self.header_bytes, array.nbytes, self.slot_bytes)]
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        # The numpy views would be pickled by value; the tensor goes as shared memory.
        return {"num_slots": self.num_slots, "slot_bytes": self.slot_bytes,
                "header_bytes": self.header_bytes, "memory": self.memory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._map()

    @property
    def generation(self) -> int:
        """The current generation (set by the training process)."""
        return int(self.header[0])

    # ------------------------------------------------------------------ worker side

    def claim(self, num_bytes: int) -> tuple[int, int] | None:
        """`(slot, generation)` of a free slot now in flight, or None (full, or too small)."""
        if num_bytes > self.slot_bytes:
            return None
        for step in range(self.num_slots):
            slot = (self._next + step) % self.num_slots
            if self.states[slot] == FREE:
                generation = int(self.header[0])
                self.states[slot] = generation
                self._next = (slot + 1) % self.num_slots
                return slot, generation
        return None

    def abandon(self, slot: int) -> None:
        """Free a claimed slot that will not be sent (its batch failed)."""
        self.states[slot] = FREE

    # ------------------------------------------------------------------ training side

    def receive(self, slot: int, generation: int, shape: Sequence[int],
                dtype: np.dtype) -> torch.Tensor:
        """The array of `shape` and `dtype` in `slot` as a tensor; the slot is free again
        once it is freed."""
        if self.states[slot] != generation:
            raise RuntimeError(f"ring slot {slot} is in state {int(self.states[slot])}, expected "
                               f"generation {generation}: a batch was overwritten in flight")
        self.states[slot] = HELD
        size = math.prod(shape) * np.dtype(dtype).itemsize
        array = self.slots[slot][:size].view(dtype).reshape(shape)
        # The tensor's storage keeps `array` (and nothing else) alive: the slot is freed
        # exactly when the last view of the features is.
        weakref.finalize(array, _free_slot, self.states, slot).atexit = False
        return torch.from_numpy(array)

    def next_generation(self) -> None:
        """Start a new generation (before the DataLoader resets persistent workers)."""
        self.header[0] += 1

    def reclaim(self) -> int:
        """Free slots in flight from older generations (after the reset); returns how many."""
        generation = self.header[0]
        stale = (self.states > FREE) & (self.states < generation)
        self.states[stale] = FREE
        return int(stale.sum())


class WorkerRings:
    """The rings of a DataLoader's workers, one per worker id."""

    def __init__(self, num_workers: int, num_slots: int, slot_bytes: int) -> None:
        self.rings = [BatchRing(num_slots, slot_bytes) for _ in range(num_workers)]

    def __getitem__(self, worker: int) -> BatchRing:
        return self.rings[worker]

    def next_generation(self) -> None:
        """See `BatchRing.next_generation`."""
        for ring in self.rings:
            ring.next_generation()

    def reclaim(self) -> int:
        """See `BatchRing.reclaim`."""
        return sum(ring.reclaim() for ring in self.rings)


@dataclasses.dataclass
class SlotBatch:
    """What a worker sends instead of a `Batch` whose speech lies in a ring slot: its
    features (float32), or its waveforms (int16, with `wave_lens` and the `fbank`
    options the training device computes features with)."""

    worker: int
    slot: int
    generation: int
    shape: tuple[int, ...]
    keys: list[str]
    feat_lens: np.ndarray
    labels: np.ndarray
    label_lens: np.ndarray
    ids: np.ndarray | None
    events: StreamEvents | None
    wave_lens: np.ndarray | None = None
    fbank: FbankOptions | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def receive(self, rings: WorkerRings) -> Batch:
        """The `Batch`, its speech a view on the slot (training process)."""
        waves = self.wave_lens is not None
        speech = rings[self.worker].receive(self.slot, self.generation, self.shape,
                                            np.dtype(np.int16 if waves else np.float32))
        batch = Batch(self.keys, None if waves else speech, torch.from_numpy(self.feat_lens),
                      torch.from_numpy(self.labels), torch.from_numpy(self.label_lens),
                      self.ids, self.events)
        if waves:
            batch.waves, batch.wave_lens = speech, torch.from_numpy(self.wave_lens)
            batch.fbank = self.fbank
        return batch


class SharedCollate:
    """`collate` that, inside a DataLoader worker given rings, pads into the worker's ring.

    Use it as the DataLoader's `collate_fn` (map-style) or as the collate function of an
    iterable dataset, and iterate the DataLoader through `RingLoader`, which sets `rings`
    before the workers start. Elsewhere (no worker, no rings, no free or large enough
    slot) it returns the plain `collate` result.
    """

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.rings: WorkerRings | None = None

    def new_rings(self, num_workers: int) -> WorkerRings:
        """Rings for `num_workers` workers, installed for the workers to inherit."""
        self.rings = WorkerRings(num_workers, self.num_slots, self.slot_bytes)
        return self.rings

    def __call__(self, utterances: Sequence[Utterance], events: StreamEvents | None = None,
                 fbank: FbankOptions | None = None) -> Batch | SlotBatch:
        info = torch.utils.data.get_worker_info()
        if info is None or self.rings is None or not utterances:
            return collate(utterances, events, fbank=fbank)
        ring = self.rings[info.id]
        claimed = ring.claim(padded_bytes(utterances))
        if claimed is None:
            return collate(utterances, events, fbank=fbank)
        slot, generation = claimed
        try:
            batch = collate(utterances, events, out=ring.slots[slot], fbank=fbank)
        except BaseException:
            ring.abandon(slot)
            raise
        speech = batch.feats if batch.waves is None else batch.waves
        return SlotBatch(info.id, slot, generation, tuple(speech.shape), batch.keys,
                         batch.feat_lens.numpy(), batch.labels.numpy(),
                         batch.label_lens.numpy(), batch.ids, batch.events,
                         None if batch.wave_lens is None else batch.wave_lens.numpy(),
                         batch.fbank)


class RingLoader:
    """Iterates a DataLoader whose batches come from `SharedCollate`; yields `Batch`es.

    `pin_memory` is done here (the DataLoader's own pinning must be off): a batch is
    copied into page-locked memory, which frees its slot at once.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, collate_fn: SharedCollate | None,
                 pin_memory: bool = False) -> None:
        if loader.pin_memory:
            raise ValueError("RingLoader pins batches itself; create the DataLoader with "
                             "pin_memory=False")
        self.loader = loader
        self.collate_fn = collate_fn if loader.num_workers > 0 else None
        self.pin_memory = pin_memory
        self._persistent_rings: WorkerRings | None = None
        self.counts = {"ring": 0, "plain": 0}

    def __len__(self) -> int:
        return len(self.loader)

    def _rings(self) -> WorkerRings | None:
        if self.collate_fn is None:
            return None
        if not self.loader.persistent_workers:
            return self.collate_fn.new_rings(self.loader.num_workers)
        if self._persistent_rings is None:
            self._persistent_rings = self.collate_fn.new_rings(self.loader.num_workers)
        else:
            self._persistent_rings.next_generation()
        return self._persistent_rings

    def close(self) -> None:
        """Stop the DataLoader's persistent workers now, not when the loader is collected
        (the next iteration starts new ones)."""
        # The DataLoader keeps the iterator that owns its persistent workers here.
        iterator, self.loader._iterator = self.loader._iterator, None
        if iterator is not None:
            iterator._shutdown_workers()
        self._persistent_rings = None  # new workers, new rings

    def __iter__(self) -> Iterator[Batch]:
        # The DataLoader's iterator (its workers, its signal handlers) is made here, in
        # the calling thread, not when the first batch is asked for (maybe elsewhere).
        rings = self._rings()
        iterator = iter(self.loader)
        if rings is not None:
            # Persistent workers: the reset above drained the older descriptors unseen.
            rings.reclaim()
        return self._batches(iterator, rings)

    def _batches(self, iterator: Iterator[Any], rings: WorkerRings | None) -> Iterator[Batch]:
        for item in iterator:
            if isinstance(item, SlotBatch):
                if rings is None:
                    raise RuntimeError("a worker sent a ring slot, but this loader has no rings")
                batch = item.receive(rings)
                self.counts["ring"] += 1
            else:
                batch = item
                self.counts["plain"] += 1
            if self.pin_memory:
                batch = batch.pin_memory()
            yield batch
