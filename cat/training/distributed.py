"""Where a training process stands among its ranks: rank, world size, device, collectives.

`init_distributed` joins the process group torchrun set up (nccl on GPU, gloo on CPU),
with a timeout for collectives (`train.option.dist_timeout_seconds`);
`DistributedContext` carries rank, world size and device and wraps the collectives the
trainer uses (sum, gather, barrier), so that one process without torchrun runs the same
code; `set_threads` shares the CPU cores among the ranks of a node.

Usage:
    context = init_distributed(datetime.timedelta(minutes=5))
    total = context.all_reduce_sum([loss, count])
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from cat.core.threads import configure_threads

logger = logging.getLogger(__name__)

DEFAULT_DIST_TIMEOUT = datetime.timedelta(minutes=5)  # train.option.dist_timeout_seconds


# --------------------------------------------------------------------------- distribution


@dataclasses.dataclass
class DistributedContext:
    """Where this process stands: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the one that writes files)."""
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """`value` of every rank, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.distributed:
            dist.barrier()


def init_distributed(timeout: datetime.timedelta = DEFAULT_DIST_TIMEOUT) -> DistributedContext:
    """Join the process group set up by torchrun (env RANK, WORLD_SIZE...), if any."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return DistributedContext(
        rank=int(os.environ.get("RANK", "0")), world_size=world_size, local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        device=device)


def shutdown_distributed() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- helpers


def set_threads(threads: int, context: DistributedContext) -> int:
    """Torch CPU threads: `threads`, or the usable CPUs (affinity and cgroup quota) shared
    by the local ranks (`cat.core.threads`)."""
    return configure_threads(threads, processes=context.local_world_size)
