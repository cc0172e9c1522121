"""LM experiments end to end: lm.json -> lm.arpa (+ lm.bin) and the training report."""

from __future__ import annotations

import json

import pytest

from cat.lm import train as lm_train
from cat.lm.ngram import read_arpa

kenlm = pytest.importorskip("kenlm")

TEXT = ["今天天气很好", "今天很好", "天气很好今天", "我们今天出去", "好天气", "出去走走",
        "我们很好", "天天出去", "今天我们出去走走", "天气好我们出去"]


def make_lm_dir(tmp_path, **config):
    text = tmp_path / "text"
    text.write_text("".join(f"utt{i} {s}\n" for i, s in enumerate(TEXT * 2)), encoding="utf-8")
    plain = tmp_path / "plain.txt"
    plain.write_text("下雨天\n\n天天下雨\n", encoding="utf-8")
    dev = tmp_path / "dev"
    dev.write_text("d1 今天下雨\nd2 很好\n", encoding="utf-8")
    lm_dir = tmp_path / "lm"
    lm_dir.mkdir()
    (lm_dir / "lm.json").write_text(json.dumps({
        "unit": "char", "order": 3, "text": [str(text)], "plain_text": [str(plain)],
        "discount_fallback": [0.5, 1.0, 1.5], "eval_text": [str(dev)], **config}))
    return lm_dir, dev


def test_training_writes_arpa_and_a_report(tmp_path):
    lm_dir, dev = make_lm_dir(tmp_path)
    arpa = lm_train.train(lm_dir)
    tables = read_arpa(arpa)
    assert len(tables) == 3
    assert ("下",) in tables[0] and ("雨", "天") in tables[1]
    report = json.loads((lm_dir / "train.json").read_text())
    assert report["sentences"] == 2 * len(TEXT) + 2
    assert report["ngrams"] == [len(t) for t in tables]
    model = kenlm.Model(str(arpa))
    total = sum(model.score(" ".join(s)) for s in ["今天下雨", "很好"])
    expected = 10 ** (-total / (4 + 1 + 2 + 1))
    assert report["eval"][str(dev)]["perplexity"] == pytest.approx(expected, rel=1e-6)


def test_binary_model_scores_like_the_arpa(tmp_path):
    # tools/install.sh --dev (the test command's set-up) builds kenlm's build_binary.
    lm_dir, _ = make_lm_dir(tmp_path, binary="trie")
    lm_train.train(lm_dir)
    arpa, binary = kenlm.Model(str(lm_dir / "lm.arpa")), kenlm.Model(str(lm_dir / "lm.bin"))
    for sentence in ["今 天 天 气", "下 雨 天 很 好", "未 知"]:
        assert binary.score(sentence) == pytest.approx(arpa.score(sentence), abs=1e-4)
    assert lm_train.model_file(lm_dir, {"binary": "trie"}).name == "lm.bin"


def test_binary_without_build_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_train.os, "access", lambda *args: False)
    lm_dir, _ = make_lm_dir(tmp_path, binary="probing")
    with pytest.raises(FileNotFoundError, match=r"bash tools/build_kenlm_binary\.sh"):
        lm_train.train(lm_dir)


def test_too_little_text_names_the_config(tmp_path):
    lm_dir, _ = make_lm_dir(tmp_path)
    config = json.loads((lm_dir / "lm.json").read_text())
    del config["discount_fallback"]
    (lm_dir / "lm.json").write_text(json.dumps(config))
    with pytest.raises(lm_train.DiscountError, match=r"lm\.json: 1-grams: .*discount_fallback"):
        lm_train.train(lm_dir)


def test_empty_text_names_the_config_and_files(tmp_path):
    lm_dir, _ = make_lm_dir(tmp_path)
    (tmp_path / "text").write_text("utt1\nutt2 \n", encoding="utf-8")
    (tmp_path / "plain.txt").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"lm\.json: the training text .*text.* holds no"):
        lm_train.train(lm_dir)
