"""A model's statistics: floats to their readers, read from the device in one copy
(`cat.models.stats`)."""

from __future__ import annotations

import pytest
import torch

from cat.models.stats import Stats, host_values
from cat.testing.device_reads import DeviceReads


def test_values_are_floats_when_read_and_tensors_until_then():
    loss_sum = torch.tensor(6.5, requires_grad=True) * 2
    stats = Stats(loss_sum=loss_sum, num_utts=4.0, num_infeasible=torch.tensor(1))
    assert stats.pending() == ["loss_sum", "num_infeasible"]
    assert isinstance(stats.value("loss_sum"), torch.Tensor)
    assert not stats.value("loss_sum").requires_grad  # held detached
    assert stats["num_utts"] == 4.0 and stats.pending()  # a host value reads nothing
    assert "loss_sum" in stats and stats.pending()
    assert stats["loss_sum"] == 13.0 and isinstance(stats["loss_sum"], float)
    assert stats.pending() == []  # every pending value was read with the first
    assert stats["num_infeasible"] == 1.0
    assert dict(stats) == {"loss_sum": 13.0, "num_utts": 4.0, "num_infeasible": 1.0}
    stats.update(extra=torch.tensor(0.25))
    assert stats.pending() == ["extra"] and stats["extra"] == 0.25


def test_pending_values_are_read_in_one_copy():
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    with torch.no_grad(), DeviceReads(device=[weight]) as reads:
        stats = Stats(a=weight.sum(), b=weight.max(), c=(weight > 1).sum(), d=2.0)
        assert [stats[k] for k in "abcd"] == [6.0, 3.0, 2.0, 2.0]
    assert [what for what, _ in reads.found] == ["tolist"]
    with torch.no_grad(), DeviceReads(device=[weight]) as reads:
        float(weight.sum()), float(weight.max())
    assert len(reads.found) == 2  # what reading them one by one costs


def test_host_values_keeps_floats_and_order():
    assert host_values([1, torch.tensor(2.5), 3.0, torch.tensor([4])]) == [1.0, 2.5, 3.0, 4.0]
    with pytest.raises(RuntimeError):
        host_values([torch.ones(2)])  # one element each
