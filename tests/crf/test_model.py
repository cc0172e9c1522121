"""The CTC-CRF model family: config keys, the denominator graph file, one update."""

from __future__ import annotations

import pytest
import torch

from cat.core.config import ConfigError, model_kind
from cat.crf.model import CRFModel
from cat.graph.denominator import DenGraphError, build_den_graph, save_den_graph
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config

UNITS = ["<blk>", "<unk>", "a", "b", "c", "d"]


def crf_config(den_lm):
    config = tiny_model_config("ctc")
    config["trainer"] = {"use_crf": True, "lamb": 0.01, "den_lm": str(den_lm)}
    return config


def write_graph(path, units=UNITS, classes=6):
    save_den_graph(build_den_graph([[2, 3, 4], [3, classes - 1], [2, 2, classes - 1]],
                                   classes, order=3, units=units), path)


def test_use_crf_builds_a_crf_model_that_trains(tmp_path):
    write_graph(tmp_path / "den_lm.npz")
    config = crf_config(tmp_path / "den_lm.npz")
    assert model_kind(config) == "crf"
    model = build_model(config, num_classes=6)
    assert isinstance(model, CRFModel) and model.lamb == 0.01
    model.prepare_training(UNITS)
    torch.manual_seed(0)
    feats = torch.randn(2, 40, 8)
    labels = torch.tensor([[2, 3, 4], [3, 5, 0]])
    loss, stats = model(feats, torch.tensor([40, 32]), labels, torch.tensor([3, 2]))
    loss.backward()
    assert stats["num_infeasible"] == 0 and torch.isfinite(loss) and loss > 0
    assert model.head.weight.grad.abs().sum() > 0


def test_crf_keys_without_use_crf_are_an_error(tmp_path):
    config = tiny_model_config("ctc")
    config["trainer"] = {"den_lm": "x.npz"}
    with pytest.raises(ConfigError, match=r"trainer\.den_lm: only used by CTC-CRF"):
        build_model(config, num_classes=6)
    config["trainer"] = {"use_crf": True}
    with pytest.raises(ConfigError, match="needs its denominator graph"):
        build_model(config, num_classes=6)


def test_a_missing_den_lm_is_a_clear_error(tmp_path):
    model = build_model(crf_config(tmp_path / "nowhere.npz"), num_classes=6)
    with pytest.raises(DenGraphError, match=r"nowhere\.npz: denominator graph .* does not exist"):
        model.prepare_training(UNITS)


def test_a_graph_of_another_tokenizer_is_refused(tmp_path):
    write_graph(tmp_path / "other.npz", units=["<blk>", "<unk>", "x", "y", "z", "w"])
    model = build_model(crf_config(tmp_path / "other.npz"), num_classes=6)
    with pytest.raises(DenGraphError, match="built for another tokenizer"):
        model.prepare_training(UNITS)
    write_graph(tmp_path / "small.npz", units=UNITS[:5], classes=5)
    model = build_model(crf_config(tmp_path / "small.npz"), num_classes=6)
    with pytest.raises(DenGraphError, match="built for 5 classes, the model has 6"):
        model.prepare_training(UNITS)
