"""A model's statistics of a batch (loss sums, counts): floats to whoever reads them, but
kept as device tensors until then, so that computing them never makes the host wait for
the device.

Reading a value of a GPU tensor (`float(t)`, `.item()`) waits for every kernel queued
before it. `Stats` holds such values as they are computed; the first read of one copies
all of them to the host in one transfer (`host_values`), and values computed on the host
(counts of CPU lengths) are read without any. The trainer reads the tensors themselves
(`Stats.value`) and copies what an update needs once (`cat.training.update`).

Usage:
    stats = Stats(loss_sum=losses.sum().detach(), num_utts=4.0)
    stats.value("loss_sum")   # the tensor, no transfer
    stats["loss_sum"]         # a float: every pending tensor copied in one transfer
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping

import torch

Value = float | torch.Tensor


def host_values(values: Iterable[Value]) -> list[float]:
    """`values` (floats, or tensors of one element) as floats; the tensors of each device
    are copied to the host together, in one transfer."""
    values = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(index)
    for indices in by_device.values():
        copied = torch.stack([values[i].detach().reshape(()).to(torch.float64)
                              for i in indices]).tolist()
        for index, value in zip(indices, copied, strict=True):
            values[index] = value
    return [float(v) for v in values]


class Stats(MutableMapping[str, float]):
    """Name -> float, each value a float or a tensor of one element until read (see the
    module docstring)."""

    def __init__(self, values: dict[str, Value] | None = None, **more: Value) -> None:
        self._values: dict[str, Value] = {}
        self.update({**(values or {}), **more})

    def __getitem__(self, key: str) -> float:
        if isinstance(self._values[key], torch.Tensor):
            self.resolve()
        return self._values[key]

    def __setitem__(self, key: str, value: Value) -> None:
        self._values[key] = value.detach() if isinstance(value, torch.Tensor) else value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __repr__(self) -> str:
        return f"Stats({self._values!r})"

    def value(self, key: str) -> Value:
        """The value as held: a float, or a tensor not yet read (no transfer)."""
        return self._values[key]

    def pending(self) -> list[str]:
        """The names whose values are tensors not yet read."""
        return [k for k, v in self._values.items() if isinstance(v, torch.Tensor)]

    def resolve(self) -> None:
        """Read every pending tensor, in one transfer from the device."""
        keys = self.pending()
        for key, value in zip(keys, host_values(self._values[k] for k in keys), strict=True):
            self._values[key] = value
