"""kenlm-backed scorers, N-best files and rescoring on models estimated here."""

from __future__ import annotations

import math

import pytest

from cat.lm.ngram import estimate, write_arpa
from cat.lm.rescore import NBestScores, read_nbest, write_hyp, write_nbest
from cat.lm.scorer import ShallowFusion, TokenLM, WordRescorer
from cat.lm.text import make_splitter

kenlm = pytest.importorskip("kenlm")

SENTENCES = ["今天天气很好", "今天很好", "天气很好今天", "我们今天出去", "好天气", "出去走走",
             "我们很好", "天天出去", "今天我们出去走走", "天气好我们出去"]
FALLBACK = (0.5, 1.0, 1.5)


@pytest.fixture(scope="module")
def char_arpa(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "char.arpa"
    write_arpa(estimate([list(s) for s in SENTENCES], 3, FALLBACK), path)
    return path


@pytest.fixture(scope="module")
def char_bigram(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "char2.arpa"
    write_arpa(estimate([list(s) for s in SENTENCES[:5]], 2, FALLBACK), path)
    return path


PIECES = ["<blk>", "<unk>", *sorted(set("".join(SENTENCES)) | {"雨"})]


def test_token_lm_steps_add_up_to_kenlm_sentence_scores(char_arpa):
    lm = TokenLM(char_arpa, PIECES)
    model = kenlm.Model(str(char_arpa))
    for text in ["今天天气很好", "雨天", "好"]:
        state, total = lm.initial_state(), 0.0
        for char in text:
            score, state = lm.step(state, PIECES.index(char))
            total += score
        total += lm.final(state)
        assert total == pytest.approx(model.score(" ".join(text)) * math.log(10), abs=1e-5)


def test_shallow_fusion_weights_lm_lodr_and_length(char_arpa, char_bigram):
    lm, lodr = TokenLM(char_arpa, PIECES), TokenLM(char_bigram, PIECES)
    fusion = ShallowFusion(lm, alpha=0.7, beta=1.5, lodr=lodr, lodr_weight=0.2)
    token = PIECES.index("天")
    state = fusion.initial_state()
    score, (lm_state, lodr_state) = fusion.step(state, token)
    lm_score, _ = lm.step(lm.initial_state(), token)
    lodr_score, _ = lodr.step(lodr.initial_state(), token)
    assert score == pytest.approx(0.7 * lm_score - 0.2 * lodr_score + 1.5)
    final = fusion.final((lm_state, lodr_state))
    assert final == pytest.approx(0.7 * lm.final(lm_state) - 0.2 * lodr.final(lodr_state))
    plain = ShallowFusion(lm, alpha=0.7)
    assert plain.step(plain.initial_state(), token)[0] == pytest.approx(0.7 * lm_score)


def test_word_rescorer_scores_jieba_words(tmp_path):
    split = make_splitter("word")
    words = [split(s) for s in SENTENCES]
    arpa = tmp_path / "word.arpa"
    write_arpa(estimate(words, 2, FALLBACK), arpa)
    rescorer = WordRescorer(arpa, split)
    score, count = rescorer.score("今天天气很好")
    expected = split("今天天气很好")
    assert count == len(expected) > 1
    assert score == pytest.approx(
        kenlm.Model(str(arpa)).score(" ".join(expected)) * math.log(10), abs=1e-5)


def test_rescoring_picks_the_hypothesis_the_weights_favour(char_arpa, tmp_path):
    nbest = {"u1": [("今天天汽很好", -1.0), ("今天天气很好", -1.5)], "u2": [], "u0": [("好", 0.0)]}
    path = tmp_path / "nbest.jsonl"
    write_nbest(path, nbest.items())
    assert [line.split('"')[3] for line in path.read_text(encoding="utf-8").splitlines()] == \
        ["u0", "u1", "u2"]
    read = read_nbest(path)
    assert read == nbest
    scores = NBestScores.compute(read, WordRescorer(char_arpa, make_splitter("char")))
    assert scores.best(0.0, 0.0) == {"u0": "好", "u1": "今天天汽很好", "u2": ""}
    assert scores.best(1.0, 0.0)["u1"] == "今天天气很好"
    write_hyp(tmp_path / "hyp", scores.best(1.0, 0.0))
    assert (tmp_path / "hyp").read_text(encoding="utf-8") == "u0 好\nu1 今天天气很好\nu2\n"


def test_bad_nbest_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "nbest.jsonl"
    path.write_text('{"utt": "a", "hyps": [["x", -1]]}\n{"utt": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"nbest\.jsonl:2: not an N-best record"):
        read_nbest(path)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.arpa does not exist"):
        TokenLM(tmp_path / "missing.arpa", PIECES)
