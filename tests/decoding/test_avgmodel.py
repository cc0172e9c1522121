"""Tests of checkpoint averaging."""

from __future__ import annotations

import pytest
import torch

from cat.decoding.avgmodel import average_checkpoints, main


def save_checkpoint(path, model: torch.nn.Module, **extra) -> str:
    torch.save({"model": model.state_dict(), **extra}, path)
    return str(path)


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.train()
    for _ in range(seed + 1):  # different running stats and num_batches_tracked
        model(torch.randn(8, 3))
    return model


def test_average_of_two_checkpoints(tmp_path):
    first, second = tiny_model(0), tiny_model(1)
    paths = [save_checkpoint(tmp_path / "a.pt", first, step=10),
             save_checkpoint(tmp_path / "b.pt", second, step=20)]
    averaged = average_checkpoints(paths)
    states = [first.state_dict(), second.state_dict()]
    assert averaged.keys() == states[0].keys()
    for key, value in averaged.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, (states[0][key] + states[1][key]) / 2)
            assert value.dtype == states[0][key].dtype
        else:
            assert torch.equal(value, states[1][key])
    assert int(averaged["1.num_batches_tracked"]) == 2


def test_cli_writes_a_loadable_checkpoint_atomically(tmp_path):
    paths = [save_checkpoint(tmp_path / f"{i}.pt", tiny_model(i)) for i in range(3)]
    out = tmp_path / "avg" / "avg-3.pt"
    assert main(["--out", str(out), *paths]) == 0
    saved = torch.load(out, weights_only=True)
    assert saved["averaged_from"] == paths
    expected = average_checkpoints(paths)
    for key, value in expected.items():
        assert torch.equal(saved["model"][key], value)
    model = tiny_model(0)
    model.load_state_dict(saved["model"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["avg-3.pt"]


def test_single_checkpoint_is_returned_unchanged(tmp_path):
    model = tiny_model(2)
    averaged = average_checkpoints([save_checkpoint(tmp_path / "a.pt", model)])
    for key, value in model.state_dict().items():
        assert torch.equal(averaged[key], value)


def test_mismatched_checkpoints_are_rejected(tmp_path):
    good = save_checkpoint(tmp_path / "a.pt", tiny_model(0))
    other = save_checkpoint(tmp_path / "b.pt", torch.nn.Linear(3, 5))
    with pytest.raises(ValueError, match=r"b\.pt: model keys differ"):
        average_checkpoints([good, other])
    reshaped = save_checkpoint(tmp_path / "c.pt", torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5)))
    with pytest.raises(ValueError, match=r"c\.pt: '0\.weight' is torch.float32 \(5, 3\)"):
        average_checkpoints([good, reshaped])


def test_files_without_a_model_state_are_rejected(tmp_path):
    path = tmp_path / "bad.pt"
    torch.save({"weights": {}}, path)
    with pytest.raises(ValueError, match=r"bad\.pt: not a checkpoint dict with a 'model'"):
        average_checkpoints([str(path)])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"garbage\.pt: not a readable checkpoint"):
        average_checkpoints([str(garbage)])
    with pytest.raises(ValueError, match="no checkpoints"):
        average_checkpoints([])


def test_failed_average_leaves_no_output(tmp_path):
    good = save_checkpoint(tmp_path / "a.pt", tiny_model(0))
    other = save_checkpoint(tmp_path / "b.pt", torch.nn.Linear(3, 5))
    out = tmp_path / "avg.pt"
    with pytest.raises(ValueError):
        main(["--out", str(out), good, other])
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt"]


def test_cli_keeps_the_config_the_checkpoints_were_trained_with(tmp_path, caplog):
    config = {"encoder": {"kwargs": {"hdim": 4}}, "scheduler": {"kwargs": {"peak_lr": 0.1}}}
    later = {**config, "encoder": {"kwargs": {"hdim": 4, "dropout": 0.1}}}
    paths = [save_checkpoint(tmp_path / "a.pt", tiny_model(0),
                             meta={"settings": {"config.json": config}}),
             save_checkpoint(tmp_path / "b.pt", tiny_model(1),
                             meta={"settings": {"config.json": later}, "num_classes": 4})]
    out = tmp_path / "avg.pt"
    assert main(["--out", str(out), *paths]) == 0
    saved = torch.load(out, weights_only=True)
    assert saved["meta"] == {"settings": {"config.json": later}, "num_classes": 4}
    assert (f"averaging checkpoints trained with different model configs: {paths[0]} -> "
            f"{paths[1]}: encoder.kwargs.dropout: (absent) -> 0.1; the average records the "
            "last one's") in caplog.text
