"""Tests of the learning-rate schedules and optimizer construction."""

from __future__ import annotations

import math

import pytest
import torch

from cat.training.scheduler import (
    OPTIMIZERS,
    SchedulerNoam,
    SchedulerWarmupCosine,
    build_optimizer,
    build_scheduler,
)


def noam_config(**kwargs) -> dict:
    schedule = {"peak_lr": 1e-3, "warmup_steps": 10, "stop_step": 40}
    schedule.update(kwargs)
    return {"type": "SchedulerNoam", "kwargs": schedule,
            "optimizer": {"type": "AdamW", "kwargs": {"betas": [0.9, 0.98],
                                                      "weight_decay": 0.01}}}


def test_noam_warmup_peak_and_decay():
    scheduler = build_scheduler(noam_config(), torch.nn.Linear(2, 2).parameters())
    assert isinstance(scheduler, SchedulerNoam)
    assert scheduler.lr_at(1) == pytest.approx(1e-4)
    assert scheduler.lr_at(5) == pytest.approx(5e-4)
    assert scheduler.lr_at(10) == pytest.approx(1e-3)
    assert scheduler.lr_at(40) == pytest.approx(5e-4)
    assert scheduler.lr_at(90) == pytest.approx(1e-3 / 3)
    values = [scheduler.lr_at(step) for step in range(1, 100)]
    assert max(values) == pytest.approx(1e-3)
    assert values.index(max(values)) == 9


def test_optimizer_lr_follows_the_schedule():
    scheduler = build_scheduler(noam_config(), torch.nn.Linear(2, 2).parameters())
    assert scheduler.num_steps == 0
    for step in range(1, 15):
        assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.lr_at(step))
        assert scheduler.lr == pytest.approx(scheduler.lr_at(step))
        scheduler.step()
    assert scheduler.num_steps == 14


def test_optimizer_kwargs_are_passed():
    scheduler = build_scheduler(noam_config(), torch.nn.Linear(2, 2).parameters())
    assert isinstance(scheduler.optimizer, torch.optim.AdamW)
    group = scheduler.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98)
    assert group["weight_decay"] == 0.01


def test_stop_criterion():
    scheduler = build_scheduler(noam_config(stop_step=3), torch.nn.Linear(2, 2).parameters())
    stopped = []
    for _ in range(4):
        stopped.append(scheduler.should_stop())
        scheduler.step()
    assert stopped == [False, False, False, True]


def test_warmup_cosine_values():
    config = {"type": "SchedulerWarmupCosine",
              "kwargs": {"peak_lr": 2e-3, "warmup_steps": 4, "stop_step": 14, "min_lr": 1e-4},
              "optimizer": {"type": "SGD", "kwargs": {"momentum": 0.9}}}
    scheduler = build_scheduler(config, torch.nn.Linear(2, 2).parameters())
    assert isinstance(scheduler, SchedulerWarmupCosine)
    assert isinstance(scheduler.optimizer, torch.optim.SGD)
    assert scheduler.lr_at(2) == pytest.approx(1e-3)
    assert scheduler.lr_at(4) == pytest.approx(2e-3)
    assert scheduler.lr_at(9) == pytest.approx(1e-4 + 0.5 * 1.9e-3 * (1 + math.cos(math.pi / 2)))
    assert scheduler.lr_at(14) == pytest.approx(1e-4)
    assert scheduler.lr_at(100) == pytest.approx(1e-4)


def train_steps(model, scheduler, inputs, targets, steps):
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs[step]), targets[step])
        loss.backward()
        scheduler.optimizer.step()
        scheduler.optimizer.zero_grad()
        scheduler.step()


def test_state_dict_resume_is_exact():
    torch.manual_seed(0)
    inputs, targets = torch.randn(10, 4, 3), torch.randn(10, 4, 2)
    model = torch.nn.Linear(3, 2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    straight = torch.nn.Linear(3, 2)
    straight.load_state_dict(initial)
    straight_scheduler = build_scheduler(noam_config(), straight.parameters())
    train_steps(straight, straight_scheduler, inputs, targets, 10)

    first = torch.nn.Linear(3, 2)
    first.load_state_dict(initial)
    first_scheduler = build_scheduler(noam_config(), first.parameters())
    train_steps(first, first_scheduler, inputs[:6], targets[:6], 6)
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved = first_scheduler.state_dict()

    resumed = torch.nn.Linear(3, 2)
    resumed.load_state_dict(saved_model)
    resumed_scheduler = build_scheduler(noam_config(), resumed.parameters())
    resumed_scheduler.load_state_dict(saved)
    assert resumed_scheduler.num_steps == 6
    assert resumed_scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(
        first_scheduler.lr_at(7))
    train_steps(resumed, resumed_scheduler, inputs[6:], targets[6:], 4)

    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value)
    assert resumed_scheduler.lr == straight_scheduler.lr


def test_state_of_another_schedule_is_rejected():
    noam = build_scheduler(noam_config(), torch.nn.Linear(2, 2).parameters())
    config = {"type": "SchedulerWarmupCosine",
              "kwargs": {"peak_lr": 1e-3, "warmup_steps": 2, "stop_step": 8},
              "optimizer": {"type": "AdamW"}}
    cosine = build_scheduler(config, torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="SchedulerNoam"):
        cosine.load_state_dict(noam.state_dict())


def test_registries_hold_the_documented_names():
    assert set(OPTIMIZERS) == {"AdamW", "Adam", "SGD"}
    assert OPTIMIZERS["AdamW"] is torch.optim.AdamW


@pytest.mark.parametrize(("config", "message"), [
    ({"type": "Adagrad"}, "allowed: Adam, AdamW, SGD"),
    ({"type": "AdamW", "kwargs": {"lr": 0.1}}, "must not set 'lr'"),
])
def test_bad_optimizer_config_raises(config, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(config, torch.nn.Linear(2, 2).parameters(), lr=1e-3)


def test_unknown_schedule_raises():
    config = noam_config()
    config["type"] = "SchedulerStep"
    with pytest.raises(ValueError, match="SchedulerStep"):
        build_scheduler(config, torch.nn.Linear(2, 2).parameters())


def test_invalid_schedule_values_raise():
    with pytest.raises(ValueError, match="stop_step"):
        build_scheduler(noam_config(stop_step=0), torch.nn.Linear(2, 2).parameters())
    config = {"type": "SchedulerWarmupCosine",
              "kwargs": {"peak_lr": 1e-3, "warmup_steps": 5, "stop_step": 5},
              "optimizer": {"type": "AdamW"}}
    with pytest.raises(ValueError, match="stop_step > warmup_steps"):
        build_scheduler(config, torch.nn.Linear(2, 2).parameters())
