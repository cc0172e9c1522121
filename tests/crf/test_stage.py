"""CTC-CRF's stage-2 hook (`cat.crf.stage`): the stage driver reaches it through the registry
by the model kind, and the den_lm settings it leaves out take the schema's defaults."""

from __future__ import annotations

import json

import pytest

from cat.core import config as config_module
from cat.core.config import CONFIG_NAME
from cat.core.io import write_table
from cat.crf import stage
from cat.graph.denominator import load_den_graph
from cat.models import registry
from cat.stages.driver import prepare_model_kind
from cat.stages.plan import Plan
from cat.testing.training import tiny_model_config
from cat.text import tokenizer as tk
from cat.text.lexicon import LexiconTokenizer


def write_inputs(tmp_path):
    """A phone tokenizer and a training set's transcripts (its `text`)."""
    tokenizer = LexiconTokenizer.from_lexicon({"今天": ["j", "in1", "t", "ian1"],
                                               "好": ["h", "ao3"]})
    tk.save(tokenizer, tmp_path / "t.tknz")
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    write_table(train / "text", {"u1": "今天好", "u2": "好", "u3": "今天"}.items())
    return tmp_path / "t.tknz", train


def write_experiment(tmp_path, trainer):
    exp = tmp_path / "exp"
    exp.mkdir()
    config = tiny_model_config("ctc")
    config["trainer"] = trainer
    (exp / CONFIG_NAME).write_text(json.dumps(config), encoding="utf-8")
    return exp


def test_the_defaults_of_the_den_lm_settings_are_the_schemas(monkeypatch):
    assert stage.den_graph_options({}) == {"order": 4, "extra_states": 1000,
                                           "estimator": "chain"}
    assert stage.den_graph_options({"den_lm_order": 3}) == {
        "order": 3, "extra_states": 1000, "estimator": "chain"}
    # The schema is where they are read: another default there is the hook's default.
    schema = config_module.load_config_schema()
    trainer = schema["$defs"]["trainer"]["properties"]
    trainer["den_lm_order"]["default"] = 2
    trainer["den_lm_estimator"]["default"] = "kneser-ney"
    monkeypatch.setattr(config_module, "load_config_schema", lambda: schema)
    assert stage.den_graph_options({}) == {"order": 2, "extra_states": 1000,
                                           "estimator": "kneser-ney"}


def test_the_registry_finds_the_hook_by_the_kind():
    assert registry.before_training("crf") is stage.prepare
    assert registry.before_training("ctc") is None
    assert registry.before_training("rnnt") is None


def test_stage_two_builds_the_den_graph_of_a_crf_experiment(tmp_path, monkeypatch):
    tokenizer, train = write_inputs(tmp_path)
    den_lm = tmp_path / "exp" / "den_lm.npz"
    exp = write_experiment(tmp_path, {"use_crf": True, "den_lm": str(den_lm),
                                      "den_lm_order": 2})
    plan = Plan(exp, {"data": {"train": [str(train)]}}, None)
    prepare_model_kind(plan, tokenizer)
    graph = load_den_graph(den_lm)
    assert graph.info["sentences"] == 3
    # Up to date: not built again (a build would fail now).
    monkeypatch.setattr("cat.graph.den_graph.build_for_tokenizer",
                        lambda *args, **kwargs: pytest.fail("rebuilt an up-to-date den_lm"))
    prepare_model_kind(plan, tokenizer)


def test_stage_two_builds_nothing_for_a_ctc_experiment(tmp_path, monkeypatch):
    tokenizer, train = write_inputs(tmp_path)
    exp = write_experiment(tmp_path, {})
    monkeypatch.setattr("cat.graph.den_graph.build_for_tokenizer",
                        lambda *args, **kwargs: pytest.fail("built a den_lm for CTC"))
    prepare_model_kind(Plan(exp, {"data": {"train": [str(train)]}}, None), tokenizer)
    assert list(exp.iterdir()) == [exp / CONFIG_NAME]
