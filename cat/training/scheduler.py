"""Learning-rate schedules and optimizer construction from `config.json:scheduler`.

Config section (validated by the model-config schema)::

    "scheduler": {
        "type": "SchedulerNoam",
        "kwargs": {"peak_lr": 1e-3, "warmup_steps": 25000, "stop_step": 70000},
        "optimizer": {"type": "AdamW", "kwargs": {"betas": [0.9, 0.98], "weight_decay": 1e-6}}
    }

The optimizer's learning rate is owned by the schedule, so optimizer kwargs
have no `lr`. Usage in a training loop::

    scheduler = build_scheduler(config["scheduler"], model.parameters())
    while not scheduler.should_stop():
        ...                                  # forward/backward, accumulate, clip
        scheduler.optimizer.step()           # or scaler.step(scheduler.optimizer)
        scheduler.optimizer.zero_grad()
        scheduler.step()                     # count the update, set the next lr
    torch.save({"scheduler": scheduler.state_dict(), ...}, path)

`num_steps` counts optimizer updates done; the update about to run uses
`lr_at(num_steps + 1)`. `state_dict()` holds the step count and the optimizer
state, so `load_state_dict()` resumes exactly (same lr, same Adam moments).
Schedule kwargs come from the config on resume, so `stop_step` may be raised
to continue a finished run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch

# Read-only: optimizer names of config.json map to torch.optim classes only through this table.
OPTIMIZERS: Mapping[str, type[torch.optim.Optimizer]] = MappingProxyType({
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
})


def build_optimizer(config: dict[str, Any], parameters: Iterable[torch.nn.Parameter],
                    lr: float) -> torch.optim.Optimizer:
    """Build `config = {"type": name in OPTIMIZERS, "kwargs": {...}}` with the initial `lr`."""
    name = config["type"]
    if name not in OPTIMIZERS:
        raise ValueError(f"scheduler.optimizer.type {name!r} is unknown; "
                         f"allowed: {', '.join(sorted(OPTIMIZERS))}")
    kwargs = dict(config.get("kwargs", {}))
    if "lr" in kwargs:
        raise ValueError("scheduler.optimizer.kwargs must not set 'lr': the schedule sets it "
                         "(use scheduler.kwargs.peak_lr)")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return OPTIMIZERS[name](parameters, lr=lr, **kwargs)


class Scheduler:
    """Base class: owns an optimizer, sets its lr per update and says when to stop.

    Subclasses implement `lr_at(step)` for `step >= 1` (the step-th update).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stop_step: int) -> None:
        if stop_step < 1:
            raise ValueError(f"scheduler stop_step must be >= 1, got {stop_step}")
        self.optimizer = optimizer
        self.stop_step = stop_step
        self.num_steps = 0
        self._apply_lr()

    def lr_at(self, step: int) -> float:
        """Learning rate of the `step`-th optimizer update (1-based)."""
        raise NotImplementedError

    @property
    def lr(self) -> float:
        """Learning rate the next optimizer update will use."""
        return self.lr_at(self.num_steps + 1)

    def _apply_lr(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Record one optimizer update and set the lr of the next one."""
        self.num_steps += 1
        self._apply_lr()

    def should_stop(self) -> bool:
        """True once `stop_step` optimizer updates have been done."""
        return self.num_steps >= self.stop_step

    def state_dict(self) -> dict[str, Any]:
        """Step count, schedule name and optimizer state (for exact resume)."""
        return {"type": type(self).__name__, "num_steps": self.num_steps,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; the schedule type must match."""
        if state.get("type") != type(self).__name__:
            raise ValueError(f"scheduler state is for {state.get('type')!r}, "
                             f"not {type(self).__name__!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = int(state["num_steps"])
        self._apply_lr()


class SchedulerNoam(Scheduler):
    """Noam schedule: `lr = peak_lr * min(step / warmup_steps, sqrt(warmup_steps / step))`.

    Linear warmup to `peak_lr` at `step == warmup_steps`, then inverse square
    root decay. CAT's `peak_factor / sqrt(dim_model * warmup)` peak corresponds
    to `peak_lr = peak_factor / sqrt(dim_model * warmup_steps)`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int,
                 stop_step: int) -> None:
        if warmup_steps < 1 or peak_lr <= 0:
            raise ValueError(f"SchedulerNoam needs warmup_steps >= 1 and peak_lr > 0, got "
                             f"warmup_steps={warmup_steps}, peak_lr={peak_lr}")
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, stop_step)

    def lr_at(self, step: int) -> float:
        """Learning rate of the `step`-th update."""
        step = max(step, 1)
        return self.peak_lr * min(step / self.warmup_steps, math.sqrt(self.warmup_steps / step))


class SchedulerWarmupCosine(Scheduler):
    """Linear warmup to `peak_lr`, then cosine decay to `min_lr` at `stop_step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int,
                 stop_step: int, min_lr: float = 0.0) -> None:
        if warmup_steps < 1 or peak_lr <= 0 or not 0 <= min_lr <= peak_lr:
            raise ValueError(f"SchedulerWarmupCosine needs warmup_steps >= 1 and "
                             f"0 <= min_lr <= peak_lr, got warmup_steps={warmup_steps}, "
                             f"peak_lr={peak_lr}, min_lr={min_lr}")
        if stop_step <= warmup_steps:
            raise ValueError(f"SchedulerWarmupCosine needs stop_step > warmup_steps, got "
                             f"stop_step={stop_step}, warmup_steps={warmup_steps}")
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        self.min_lr = min_lr
        super().__init__(optimizer, stop_step)

    def lr_at(self, step: int) -> float:
        """Learning rate of the `step`-th update."""
        step = max(step, 1)
        if step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.stop_step - self.warmup_steps))
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1 + math.cos(math.pi * progress))


SCHEDULERS: Mapping[str, type[Scheduler]] = MappingProxyType({
    "SchedulerNoam": SchedulerNoam,
    "SchedulerWarmupCosine": SchedulerWarmupCosine,
})


def build_scheduler(config: dict[str, Any],
                    parameters: Iterable[torch.nn.Parameter]) -> Scheduler:
    """Build the optimizer and schedule of `config.json:scheduler` for `parameters`."""
    name = config["type"]
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.type {name!r} is unknown; "
                         f"allowed: {', '.join(sorted(SCHEDULERS))}")
    # The real lr is set by the schedule right after construction.
    optimizer = build_optimizer(config["optimizer"], parameters, lr=0.0)
    return SCHEDULERS[name](optimizer, **config.get("kwargs", {}))
