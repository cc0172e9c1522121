"""Stage 5 configuration: `inference.lm` in hyper-p.json and LM experiments (lm.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cat.core.config import ConfigError, load_config, validate_hyper
from cat.lm.train import load_lm_config
from cat.stages.lm import _grid, _pass_name, decode_lm, train_lm

ROOT = Path(__file__).resolve().parents[2]


def hyper_with(lm: dict) -> dict:
    hyper = json.loads((ROOT / "egs/aishell/exp/tiny-ctc/hyper-p.json").read_text())
    hyper["inference"]["lm"] = lm
    return hyper


@pytest.mark.parametrize(("lm", "message"), [
    ({"settings": {"a": {"fusion": {"lm": "exp/x", "alpha": 0.3, "gamma": 1}}}},
     r"inference\.lm\.settings\.a\.fusion: unknown key 'gamma'"),
    ({"settings": {"a": {"fusion": {"lm": "exp/x", "alpha": 0.3, "lodr": "exp/y"}}}},
     "'lodr_weight' is a dependency of 'lodr'"),
    ({"settings": {"a": {"rescore": {"lm": "exp/x"}}}}, "'alpha' is a required property"),
    ({"settings": {"a": {"fusion": {"lm": "exp/x", "alpha": 0.3, "lodr": "exp/y",
                                    "lodr_weight": [-0.1]}}}},
     r"lodr_weight: \[-0.1\] is not valid"),
    ({"settings": {"a b": {"rescore": {"lm": "exp/x", "alpha": 0.3}}}}, "does not match"),
    ({"setting": {}}, "unknown key 'setting' \\(did you mean 'settings'\\?\\)"),
])
def test_bad_lm_settings_are_named(lm, message):
    with pytest.raises(ConfigError, match=message):
        validate_hyper(hyper_with(lm), "exp/x/hyper-p.json")


def test_published_experiments_validate():
    hypers = sorted((ROOT / "egs").glob("*/exp/**/hyper-p.json"))
    assert len(hypers) >= 13, hypers
    for path in hypers:
        validate_hyper(json.loads(path.read_text()), str(path.relative_to(ROOT)))
        load_config(path.with_name("config.json"))
    lms = list((ROOT / "egs").glob("*/exp/*lm-*"))
    assert len(lms) >= 3, lms
    for lm in lms:
        load_lm_config(lm)


def test_lm_config_errors_name_the_file_and_key(tmp_path):
    (tmp_path / "lm.json").write_text('{"unit": "char", "order": 3, "txt": ["a"]}')
    with pytest.raises(ConfigError, match=r"lm\.json: \(top level\): unknown key 'txt'"):
        load_lm_config(tmp_path)
    (tmp_path / "lm.json").write_text('{"unit": "char", "order": 3}')
    with pytest.raises(ConfigError, match="give training text"):
        load_lm_config(tmp_path)
    (tmp_path / "lm.json").write_text('{"unit": "tokenizer", "order": 3, "text": ["t"]}')
    with pytest.raises(ConfigError, match="tokenizer: required with unit 'tokenizer'"):
        load_lm_config(tmp_path)
    (tmp_path / "lm.json").write_text('{"unit": "char", "order": 3, "text": ["missing"]}')
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        train_lm(tmp_path)


def test_lm_stage_retrains_only_when_the_text_changes(tmp_path, caplog):
    text = tmp_path / "text"
    text.write_text("".join(f"u{i} {s}\n" for i, s in enumerate(
        ["今天天气很好", "今天很好", "天气很好", "我们出去", "好天气", "出去走走"] * 3)),
        encoding="utf-8")
    (tmp_path / "lm.json").write_text(json.dumps(
        {"unit": "char", "order": 2, "text": [str(text)],
         "discount_fallback": [0.5, 1.0, 1.5]}))
    arpa = train_lm(tmp_path)
    first = arpa.stat().st_mtime_ns
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["sentences"] == 18 and report["ngrams"][0] == 3 + len(set("今天气很好我们出去走"))
    caplog.set_level("INFO")
    train_lm(tmp_path)
    assert arpa.stat().st_mtime_ns == first and "up to date" in caplog.text
    text.write_text(text.read_text(encoding="utf-8") + "x 下雨\n", encoding="utf-8")
    train_lm(tmp_path)
    assert json.loads((tmp_path / "train.json").read_text())["sentences"] == 19


def test_grid_and_pass_names():
    from cat.decoding.inference import FusionSpec

    assert _grid(None) == [0.0] and _grid(0.5) == [0.5] and _grid([1, 2]) == [1.0, 2.0]
    assert _pass_name(None) == "nolm"
    spec = FusionSpec("exp/lm-char-5gram/lm.arpa", 0.3, 1.0, "exp/lm-char-2gram/lm.arpa", 0.2)
    assert _pass_name(spec) == "lm-char-5gram-a0.3-b1-lm-char-2gram-w0.2"


def test_experiment_without_lm_has_nothing_to_do(tmp_path):
    hyper = json.loads((ROOT / "egs/aishell/exp/synth-ctc/hyper-p.json").read_text())
    del hyper["inference"]["lm"]
    (tmp_path / "hyper-p.json").write_text(json.dumps(hyper))
    assert decode_lm(tmp_path) is None
