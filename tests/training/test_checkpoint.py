"""Checkpoints: weights-only round trip, the list, keep last N + best N, selection."""

from __future__ import annotations

import json

import pytest
import torch

from cat.decoding.avgmodel import average_checkpoints
from cat.training.checkpoint import (
    LIST_NAME,
    CheckpointManager,
    checkpoint_name,
    load_checkpoint,
    read_model_state,
    save_checkpoint,
)


def _state(value: float, step: int) -> dict:
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return {"format": "cat-checkpoint", "version": 1, "model": model.state_dict(),
            "scheduler": {"type": "SchedulerNoam", "num_steps": step,
                          "optimizer": optimizer.state_dict()},
            "scaler": {}, "epoch": 1, "step": step, "dev_loss": value,
            "data": {"kind": "stream", "ranks": [{"consumed": [3, 1], "partial": [[2, 5]]}]},
            "rng": [{"torch": torch.get_rng_state(), "cuda": None}], "meta": {}}


def test_round_trip_is_weights_only_and_averageable(tmp_path):
    state = _state(0.5, 7)
    save_checkpoint(tmp_path / "a.pt", state)
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert loaded["step"] == 7 and loaded["data"] == state["data"]
    assert torch.equal(loaded["rng"][0]["torch"], state["rng"][0]["torch"])
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    restored = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    restored.load_state_dict(loaded["scheduler"]["optimizer"])
    # The averaging tool of the decoding stage reads the same files.
    assert read_model_state(tmp_path / "a.pt").keys() == state["model"].keys()
    save_checkpoint(tmp_path / "b.pt", _state(1.5, 8))
    averaged = average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    assert torch.allclose(averaged["weight"], torch.ones(2, 2) * 1.0, atol=0.01)
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_bad_files_are_named(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk.pt: not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt: not a cat-checkpoint file"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*none.pt does not exist"):
        load_checkpoint(tmp_path / "none.pt")
    (tmp_path / LIST_NAME).write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"checkpoints.json: not a cat-checkpoint-list file"):
        CheckpointManager(tmp_path)


def test_keeps_the_last_and_the_best(tmp_path):
    manager = CheckpointManager(tmp_path / "check", keep=2)
    losses = [5.0, 1.0, 4.0, 0.5, 3.0, 3.5]
    for step, loss in enumerate(losses, 1):
        manager.save(_state(loss, step), epoch=1, step=step, dev_loss=loss)
    kept = sorted(p.name for p in (tmp_path / "check").glob("*.pt"))
    # last two: steps 5, 6; best two: steps 4 (0.5) and 2 (1.0)
    assert kept == [checkpoint_name(1, s) for s in (2, 4, 5, 6)]
    assert manager.latest().name == checkpoint_name(1, 6)
    assert manager.best().name == checkpoint_name(1, 4)
    assert [p.name for p in manager.select("best", 2)] == [checkpoint_name(1, 4),
                                                           checkpoint_name(1, 2)]
    assert [p.name for p in manager.select("last", 3)] == [checkpoint_name(1, s)
                                                           for s in (4, 5, 6)]
    listed = json.loads((tmp_path / "check" / LIST_NAME).read_text(encoding="utf-8"))
    assert [r["step"] for r in listed["checkpoints"]] == [2, 4, 5, 6]
    assert listed["checkpoints"][1] == {"file": checkpoint_name(1, 4), "epoch": 1, "step": 4,
                                        "dev_loss": 0.5}
    reopened = CheckpointManager(tmp_path / "check", keep=2)
    assert reopened.records == manager.records
    reopened.save(_state(9.0, 6), epoch=1, step=6, dev_loss=float("nan"))
    assert [r["step"] for r in reopened.records] == [2, 4, 5, 6]
    assert reopened.records[-1]["dev_loss"] is None
    with pytest.raises(ValueError, match="unknown checkpoint selection 'worst'"):
        reopened.select("worst", 1)


def _old_layout_name(key: str) -> str:
    """A state-dict key as the one-class-per-family transducer model named it."""
    for new, old in (("transducer.", ""), ("ctc.", "ctc_head.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def test_a_transducer_checkpoint_of_the_earlier_layout_resumes_with_its_optimizer_state():
    """The earlier transducer class registered its auxiliary CTC head first, then the
    encoder, predictor and joiner: its checkpoint's keys are renamed and Adam's moments,
    indexed by parameter position, follow their parameters into the new order."""
    from cat.models.registry import build_model
    from cat.training.checkpoint import upgrade_training_checkpoint
    from tests.models.test_registry import rnnt_config

    config = rnnt_config()
    config["ctc"] = {"weight": 0.3}
    torch.manual_seed(0)
    model = build_model(config, num_classes=6)
    named = dict(model.named_parameters())
    old_order = ([k for k in named if k.startswith("ctc.")]
                 + [k for k in named if not k.startswith("ctc.")])
    assert old_order != list(named)  # the layouts differ in order, not only in names
    old_optimizer = torch.optim.AdamW([named[k] for k in old_order], lr=0.1)
    for index, key in enumerate(old_order):
        named[key].grad = torch.full_like(named[key], float(index + 1))
    old_optimizer.step()
    buffers = [k for k in model.state_dict() if k not in named]
    state = {"model": {_old_layout_name(k): model.state_dict()[k]
                       for k in old_order + buffers},
             "scheduler": {"optimizer": old_optimizer.state_dict()}}
    upgrade_training_checkpoint(state, model)
    assert list(state["model"]) == old_order + buffers
    new_optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    new_optimizer.load_state_dict(state["scheduler"]["optimizer"])
    for key, parameter in named.items():
        moment = new_optimizer.state[parameter]["exp_avg"]
        assert torch.allclose(moment, torch.full_like(moment, 0.1 * (old_order.index(key) + 1)))
    current = {"model": model.state_dict(),
               "scheduler": {"optimizer": new_optimizer.state_dict()}}
    before = {k: dict(v) for k, v in current["scheduler"]["optimizer"]["state"].items()}
    upgrade_training_checkpoint(current, model)  # the current layout: left alone
    assert current["scheduler"]["optimizer"]["state"].keys() == before.keys()
