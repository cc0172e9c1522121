"""The CTC-CRF model family: config keys, the denominator graph file, one update."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from cat.core.config import ConfigError, model_kind
from cat.crf.model import CRFHead
from cat.graph.den_graph import build_for_tokenizer
from cat.graph.denominator import DenGraphError, build_den_graph, save_den_graph
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config, write_tiny_experiment
from cat.training import setup
from cat.training.cli import train

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
    assert model.head_names == ("ctc",) and isinstance(model.ctc, CRFHead)
    assert model.ctc.lamb == 0.01 and model.frame_posteriors
    model.prepare_training(UNITS)
    torch.manual_seed(0)
    feats = torch.randn(2, 40, 8)
    labels = torch.tensor([[2, 3, 4], [3, 5, 0]])
    loss, stats = model(feats, torch.tensor([40, 32]), labels, torch.tensor([3, 2]))
    loss.backward()
    assert stats["num_infeasible"] == 0 and torch.isfinite(loss) and loss > 0
    assert model.ctc.weight.grad.abs().sum() > 0


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


# Utterances with more labels than encoder frames (14 input frames: 2 encoder frames): the
# CRF loss finds no path through their numerator graphs.
INFEASIBLE = {"BAC009S0009W9001": (14, "的一是在不了有和人这"),
              "BAC009S0009W9002": (14, "的一是在不")}


def test_training_counts_the_utterances_the_crf_loss_finds_infeasible(tmp_path, monkeypatch,
                                                                       caplog):
    experiment = write_tiny_experiment(tmp_path, num_train=16, extra_train=INFEASIBLE,
                                       options={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    build_for_tokenizer(experiment.exp_dir / "tokenizer.tknz", [experiment.train.text],
                        experiment.exp_dir / "den_lm.npz", order=2)
    path = experiment.exp_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["trainer"] = {"use_crf": True, "den_lm": "exp/tiny/den_lm.npz"}
    path.write_text(json.dumps(config), encoding="utf-8")
    # The length filter drops what the frame count alone rules out; let these through, as
    # utterances the graphs reject for other reasons pass it.
    build_filter = setup.build_length_filter
    monkeypatch.setattr(setup, "build_length_filter", lambda *args: dataclasses.replace(
        build_filter(*args), ctc=False))
    with caplog.at_level(logging.INFO):
        train("exp/tiny", "cat.ctc.train")
    record = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert (record["trained"], record["infeasible"]) == (18, 2)
    coverage = json.loads((experiment.exp_dir / "log/coverage.jsonl").read_text())
    assert coverage["infeasible"] == 2
    assert "epoch 1: 5 updates, 18 utterances trained (2 of them infeasible for the loss;" \
        in caplog.text
    assert ("epoch 1: 2 trained utterance(s) were infeasible for the loss (no alignment of "
            "the transcript fits the frames, or none passes the CTC-CRF graphs): they got "
            "loss 0 and no gradient") in caplog.text
