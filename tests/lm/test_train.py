"""LM experiments end to end: lm.json -> lm.arpa (+ lm.bin) and the training report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cat.core.config import ConfigError
from cat.lm import lmplz
from cat.lm import train as lm_train
from cat.lm.ngram import read_arpa
from cat.testing.lm import write_lm_text

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
    lm_dir, _ = make_lm_dir(tmp_path, estimator="ngram")
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


# ------------------------------------------------------------ lmplz against the fallback


def lmplz_lm_dirs(tmp_path, order, **config):
    """The same lm.json twice, one per estimator, over the factory's jieba-word text."""
    text, dev = tmp_path / "text", tmp_path / "dev"
    write_lm_text(text, 2000, seed=1)
    write_lm_text(dev, 50, seed=2)
    dirs = []
    for estimator in ("ngram", "lmplz"):
        lm_dir = tmp_path / estimator
        lm_dir.mkdir()
        (lm_dir / "lm.json").write_text(json.dumps({
            "unit": "char", "order": order, "text": [str(text)], "eval_text": [str(dev)],
            "estimator": estimator, **config}))
        dirs.append(lm_dir)
    return dirs


needs_lmplz = pytest.mark.skipif(
    lmplz.find_program("lmplz") is None,
    reason="kenlm's lmplz is not built (bash tools/build_kenlm_binary.sh lmplz; "
           "tools/install.sh --dev builds it)")


@needs_lmplz
@pytest.mark.parametrize(("order", "config"), [
    (2, {}), (4, {}), (3, {"discount_fallback": [0.5, 1.0, 1.5]})])
def test_lmplz_and_the_fallback_estimate_the_same_model(tmp_path, order, config):
    fallback_dir, lmplz_dir = lmplz_lm_dirs(tmp_path, order, **config)
    if config:  # no discount is defined: every order falls back alike
        (tmp_path / "text").write_text("u1 今天天气很好\n", encoding="utf-8")
    for lm_dir in (fallback_dir, lmplz_dir):
        lm_train.train(lm_dir)
    ours, theirs = (read_arpa(d / "lm.arpa") for d in (fallback_dir, lmplz_dir))
    assert [len(t) for t in ours] == [len(t) for t in theirs]
    for n, (mine, other) in enumerate(zip(ours, theirs, strict=True), 1):
        assert mine.keys() == other.keys(), f"{n}-grams differ"
        for gram, (prob, backoff) in mine.items():
            if gram != ("<s>",):  # never predicted: -99 here, 0 in lmplz's ARPA
                assert abs(prob - other[gram][0]) < 1e-5, (gram, prob, other[gram])
            assert abs(backoff - other[gram][1]) < 1e-5, (gram, backoff, other[gram])
    reports = [json.loads((d / "train.json").read_text()) for d in (fallback_dir, lmplz_dir)]
    assert [r["estimator"] for r in reports] == ["ngram", "lmplz"]
    for key in ("sentences", "tokens", "vocabulary", "ngrams"):
        assert reports[0][key] == reports[1][key], key
    assert np.ravel(reports[1]["discounts"]) == pytest.approx(
        np.ravel(reports[0]["discounts"]), abs=1e-5)
    dev = str(tmp_path / "dev")
    assert reports[1]["eval"][dev]["perplexity"] == pytest.approx(
        reports[0]["eval"][dev]["perplexity"], rel=1e-6)


@needs_lmplz
def test_lmplz_undefined_discounts_name_the_config(tmp_path):
    _, lm_dir = lmplz_lm_dirs(tmp_path, 3)
    (tmp_path / "text").write_text("u1 今天\nu2 今天天\n", encoding="utf-8")
    with pytest.raises(lm_train.DiscountError, match=r"lmplz/lm\.json: 1-grams: .*discount_"
                                                      "fallback"):
        lm_train.train(lm_dir)
    assert not (lm_dir / "lm.arpa").exists() and not list(lm_dir.glob(".*"))


def test_auto_estimator_falls_back_without_lmplz(tmp_path, monkeypatch):
    monkeypatch.setattr(lmplz, "find_program", lambda name: None)
    lm_dir, _ = make_lm_dir(tmp_path)  # no "estimator": auto
    lm_train.train(lm_dir)
    assert json.loads((lm_dir / "train.json").read_text())["estimator"] == "ngram"


def test_lmplz_estimator_builds_it_on_demand(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(lmplz, "find_program", lambda name: None)
    monkeypatch.setattr(lmplz, "build_program",
                        lambda name: built.append(name) or (_ for _ in ()).throw(
                            RuntimeError("no Boost")))
    lm_dir, _ = make_lm_dir(tmp_path, estimator="lmplz")
    with pytest.raises(RuntimeError, match="no Boost"):
        lm_train.train(lm_dir)
    assert built == ["lmplz"]


def test_memory_setting_is_checked(tmp_path):
    lm_dir, _ = make_lm_dir(tmp_path, memory="lots")
    with pytest.raises(ConfigError, match="memory"):
        lm_train.train(lm_dir)


@needs_lmplz
def test_lmplz_refuses_bad_tokens_and_leaves_nothing(tmp_path):
    # A tokenizer's pieces reach lmplz as they are: the fallback's checks apply.
    sentences = [["今", "天"], ["好", "</s>"]]
    with pytest.raises(ValueError, match="sentence 2: </s> is reserved"):
        lmplz.estimate_arpa(lmplz.find_program("lmplz"), sentences, 3, tmp_path / "lm.arpa",
                            "100M", (0.5, 1.0, 1.5))
    assert list(tmp_path.iterdir()) == []
    result = lmplz.estimate_arpa(lmplz.find_program("lmplz"), [["今", "<unk>", "天"]] * 3, 2,
                                 tmp_path / "lm.arpa", "100M", (0.5, 1.0, 1.5))
    assert (result.sentences, result.tokens, result.skipped_unk) == (3, 6, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["lm.arpa"]


def test_duplicate_keys_in_lm_json_are_named_with_their_line(tmp_path):
    lm_dir, _ = make_lm_dir(tmp_path)
    (lm_dir / "lm.json").write_text('{"unit": "char",\n "order": 3,\n "order": 5,\n'
                                    f' "text": ["{tmp_path / "text"}"]}}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        lm_train.train(lm_dir)
    assert str(error.value) == (f"{lm_dir}/lm.json:3: (top level): duplicate key 'order' "
                                "(first on line 2); JSON keeps only the last: remove one")


# ------------------------------------------------ estimator auto: the in-memory bound

# make_lm_dir's text: 2 x TEXT (104 characters) in `text`, 7 characters in `plain_text`,
# 22 sentences; an upper estimate for 3-grams: up to 3 per character and sentence end.
NEED = 200 * 3 * (111 + 22)


def without_lmplz(monkeypatch, build):
    """lmplz not built; `build` stands for tools/build_kenlm_binary.sh (calls recorded)."""
    built = []
    monkeypatch.setattr(lmplz, "find_program", lambda name: None)
    monkeypatch.setattr(lmplz, "build_program", lambda name: built.append(name) or build())
    return built


def test_text_size_and_memory_limits(tmp_path, monkeypatch):
    lm_dir, _ = make_lm_dir(tmp_path)
    config = lm_train.load_lm_config(lm_dir)
    size = lm_train.text_size(config)
    assert size == lm_train.TextSize(sentences=22, characters=111)
    assert size.ngram_memory(3) == NEED == 79800
    assert lm_train.memory_limit("2G") == (2 * 2 ** 30, "2G")
    assert lm_train.available_memory() > 0
    monkeypatch.setattr(lm_train, "available_memory", lambda: 3 * 2 ** 30)
    assert lm_train.memory_limit("50%") == (3 * 2 ** 29, "50% of 3.0 GiB available")
    assert lm_train.schema_default("ngram_memory_limit") == "50%"


def test_auto_estimator_within_the_memory_limit_estimates_in_memory(tmp_path, monkeypatch):
    built = without_lmplz(monkeypatch, lambda: pytest.fail("lmplz built"))
    lm_dir, _ = make_lm_dir(tmp_path, ngram_memory_limit="78K")  # 79872 bytes
    lm_train.train(lm_dir)
    assert json.loads((lm_dir / "train.json").read_text())["estimator"] == "ngram"
    assert built == []


@needs_lmplz
def test_auto_estimator_past_the_memory_limit_builds_and_uses_lmplz(tmp_path, monkeypatch):
    program = lmplz.find_program("lmplz")
    built = without_lmplz(monkeypatch, lambda: program)
    lm_dir, _ = make_lm_dir(tmp_path, ngram_memory_limit="77K")  # 78848
    lm_train.train(lm_dir)
    report = json.loads((lm_dir / "train.json").read_text())
    assert (report["estimator"], report["sentences"], built) == ("lmplz", 22, ["lmplz"])


def test_auto_estimator_past_the_memory_limit_without_lmplz_is_an_error(tmp_path, monkeypatch):
    failure = ("bash tools/build_kenlm_binary.sh lmplz failed (exit 1): ERROR: lmplz needs "
               "Boost's headers (boost/program_options.hpp is missing)")
    built = without_lmplz(monkeypatch, lambda: (_ for _ in ()).throw(RuntimeError(failure)))
    lm_dir, _ = make_lm_dir(tmp_path, ngram_memory_limit="64K")
    with pytest.raises(lm_train.EstimatorError) as error:
        lm_train.train(lm_dir)
    assert str(error.value) == (
        f"{lm_dir}/lm.json: the training text (111 characters in 22 sentences) needs about "
        "77.9 KiB to estimate a 3-gram model in memory (cat.lm.ngram: up to 3 n-grams per "
        "character and sentence end, 200 bytes each), more than ngram_memory_limit 64.0 KiB "
        f"(64K); kenlm's lmplz, which estimates on disk within lm.json's 'memory', is not "
        f"built and could not be built ({failure}). Install what the build needs (Boost: "
        "apt-get install libboost-program-options-dev libboost-thread-dev "
        "libboost-system-dev) and run bash tools/build_kenlm_binary.sh lmplz, or train on a "
        "machine with the memory (raise ngram_memory_limit, or set estimator 'ngram' to "
        "estimate in memory anyway)")
    assert built == ["lmplz"] and not (lm_dir / "lm.arpa").exists()


def test_ngram_estimator_past_the_memory_limit_is_warned_about(tmp_path, caplog):
    lm_dir, _ = make_lm_dir(tmp_path, estimator="ngram", ngram_memory_limit="64K")
    lm_train.train(lm_dir)
    assert json.loads((lm_dir / "train.json").read_text())["estimator"] == "ngram"
    assert "needs about 77.9 KiB to estimate a 3-gram model in memory (cat.lm.ngram: up to " \
           "3 n-grams per character and sentence end, 200 bytes each), more than " \
           "ngram_memory_limit 64.0 KiB (64K): estimating in memory all the same, as " \
           "estimator 'ngram' asks" in caplog.text
