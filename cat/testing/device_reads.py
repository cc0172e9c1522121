"""Reads of device data by the host, found on a CPU: what would make the host wait for a
GPU (`.item()`, `float(t)`, `int(t)`, `bool(t)` and `if t:`, `.tolist()`, `.cpu()`,
`.numpy()`, `nonzero`, and copies to the device without `non_blocking=True`), a stand-in
for `torch.cuda.set_sync_debug_mode` where there is no GPU.

On a CPU every tensor is on the host, so `DeviceReads` follows where each tensor's data
would live on a GPU: the model's parameters and buffers are device data, the batch as the
loader gives it is host data, `.to(device)` (or `.cuda()`) makes device data, and an
operation's output is device data when any of its inputs is, host data when any is and
none is device data, and neither (a constant: `torch.arange(n)`, `torch.tensor(...)`) when
it has no tensor input. A read counts when the tensor read is device data. Reads inside
torch's C++ code (e.g. `ctc_loss` copying lengths to the host) are not seen; on a GPU,
`torch.cuda.set_sync_debug_mode("warn")` sees those too.

Usage:
    with DeviceReads(device=model, host=[batch.feats, batch.feat_lens]) as reads:
        updater.update([batch], normalizer)
    reads.found   # [(what, where), ...]
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

NEITHER, HOST, DEVICE = 0, 1, 2
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                   "__format__", "numpy", "cpu", "nonzero"})
MOVES = frozenset({"to", "cuda"})
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


def _moves_to_a_device(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a `.to(...)`/`.cuda()` call names a device (not only a dtype)."""
    if name == "cuda":
        return True
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor))
                                     for a in args[1:])


class DeviceReads(TorchFunctionMode):
    """Counts the host's reads of device data while active (see the module docstring)."""

    def __init__(self, device: torch.nn.Module | Iterable[torch.Tensor] = (),
                 host: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._where: dict[int, tuple[weakref.ref, int]] = {}
        self.found: list[tuple[str, str]] = []
        if isinstance(device, torch.nn.Module):
            device = [*device.parameters(), *device.buffers()]
        for tensor in device:
            self._set(tensor, DEVICE)
        for tensor in host:
            self._set(tensor, HOST)

    def _get(self, tensor: torch.Tensor) -> int:
        entry = self._where.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else NEITHER

    def _set(self, tensor: torch.Tensor, where: int) -> None:
        self._where[id(tensor)] = (weakref.ref(tensor), where)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        where = max((self._get(t) for t in inputs), default=NEITHER)
        if name in READS and inputs and self._get(inputs[0]) == DEVICE:
            self.found.append((name, _caller()))
        moves = name in MOVES and _moves_to_a_device(name, args, kwargs)
        if (moves and inputs and self._get(inputs[0]) != DEVICE
                and not kwargs.get("non_blocking", False)):
            # a copy from the host that returns when done: the host waits for the stream
            self.found.append((f"{name} (blocking copy to the device)", _caller()))
        out = func(*args, **kwargs)
        if moves:
            where = DEVICE
            if any(out is t for t in inputs):
                # On the CPU `.to(device)` gives back the host tensor itself; on a GPU it
                # is a copy, and the host tensor stays host data.
                out = out.view_as(out)
        elif name == "cpu":
            where = HOST
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._set(tensor, where)
        return out

    def summary(self) -> dict[str, int]:
        """Reads per place (`file:line function: what`)."""
        counts: dict[str, int] = {}
        for what, where in self.found:
            key = f"{where}: {what}"
            counts[key] = counts.get(key, 0) + 1
        return counts


def _caller() -> str:
    """The innermost frame of this package (outside this module), as `path:line function`."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(PACKAGE_ROOT) and path != Path(__file__).resolve():
            return f"{path.relative_to(PACKAGE_ROOT.parent)}:{frame.lineno} {frame.name}"
    return "outside cat/"
