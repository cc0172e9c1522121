"""The CPU stand-in for CUDA's sync debug mode finds reads of device data and blocking
copies to the device, and nothing else (`cat.testing.device_reads`)."""

from __future__ import annotations

import torch

from cat.testing.device_reads import DeviceReads


def test_reads_of_device_data_are_found_and_host_reads_are_not():
    layer = torch.nn.Linear(3, 2)
    lengths = torch.tensor([3, 2])
    with torch.no_grad(), DeviceReads(device=layer, host=[lengths]) as reads:
        out = layer(torch.ones(2, 3))
        int(lengths.max()), lengths.tolist(), bool((lengths > 1).any())  # host: free
        steps = torch.arange(4)
        float(steps.sum())  # a constant: free
        mask = steps[None] < lengths[:, None]
        int(mask.sum())  # host data and a constant: free
        float(out.sum())
        if out.max() > 0:
            pass
        out.detach().tolist()
        moved = lengths.to(torch.device("cpu"), non_blocking=True)
        int(moved.max())  # moved to the device: a read
        lengths.to(torch.device("cpu"))  # a blocking copy to the device
        int(layer.weight.grad is None)  # no tensor read
    assert [what for what, _ in reads.found] == [
        "__float__", "__bool__", "tolist", "__int__", "to (blocking copy to the device)"]
    # lengths themselves stayed host data after their device copy was made
    with reads:
        int(lengths.sum())
    assert len(reads.found) == 5
