"""Tests of the WER/CER scorer (library and CLI)."""

from __future__ import annotations

import random

import pytest

from cat.core.io import TableError
from cat.scoring import ScoreResult, align, format_summary, main, score, tokenize


def reference_edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Textbook Levenshtein dynamic programme."""
    previous = list(range(len(hyp) + 1))
    for i, ref_unit in enumerate(ref, 1):
        current = [i]
        for j, hyp_unit in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ref_unit != hyp_unit)))
        previous = current
    return previous[-1]


def test_tokenize_units():
    assert tokenize(" 我们 好\t的 ", "char") == ["我", "们", "好", "的"]
    assert tokenize(" hello  big\tworld ", "word") == ["hello", "big", "world"]
    with pytest.raises(ValueError, match="unknown scoring unit"):
        tokenize("x", "phone")


def test_counts_on_hand_made_cases():
    refs = {"u1": "今天天气很好", "u2": "我们去公园", "u3": "你好"}
    hyps = {"u1": "今天天汽很好啊",  # 1 sub + 1 ins
            "u2": "我们公园",  # 1 del
            "u3": "你好"}
    result = score(refs, hyps, unit="char")
    assert (result.substitutions, result.insertions, result.deletions) == (1, 1, 1)
    assert result.errors == 3
    assert result.total == 6 + 5 + 2
    assert result.sentences == 3
    assert result.sentence_errors == 2
    assert result.error_rate == pytest.approx(300 / 13)
    assert result.sentence_error_rate == pytest.approx(200 / 3)
    assert result.missing == []
    assert result.extra == []


def test_word_units():
    result = score({"a": "the cat sat"}, {"a": "the cat sat down"}, unit="word")
    assert (result.insertions, result.deletions, result.substitutions) == (1, 0, 0)
    assert result.total == 3


def test_missing_hypotheses_are_deletions_and_extra_ones_are_ignored():
    refs = {"a": "一二三", "b": "四五", "c": ""}
    hyps = {"a": "一二三", "z": "多余的"}
    result = score(refs, hyps)
    assert result.missing == ["b", "c"]
    assert result.extra == ["z"]
    assert result.deletions == 2
    assert result.insertions == 0
    assert result.total == 5
    assert result.sentences == 3
    # A missing hypothesis of an empty reference is not an error.
    assert result.sentence_errors == 1


def test_empty_hypothesis_and_empty_reference():
    result = score({"a": "你好", "b": ""}, {"a": "", "b": "嗯"})
    assert (result.deletions, result.insertions) == (2, 1)
    assert result.sentence_errors == 2
    assert result.missing == []
    only_insertions = score({"b": ""}, {"b": "嗯"})
    assert only_insertions.error_rate == float("inf")
    assert score({"b": ""}, {"b": ""}).error_rate == 0.0


def test_ids_are_matched_not_zipped_by_order():
    refs = {"a": "甲", "b": "乙"}
    hyps = {"b": "乙", "a": "甲"}
    assert score(refs, hyps).errors == 0


def test_alignment_marks_operations():
    alignment = align(list("ABCD"), list("AXCDE"))
    assert alignment.ref == ["A", "B", "C", "D", None]
    assert alignment.hyp == ["A", "X", "C", "D", "E"]
    assert alignment.ops == ["C", "S", "C", "C", "I"]
    deletion = align(list("ABC"), list("AC"))
    assert deletion.ops == ["C", "D", "C"]
    assert deletion.hyp == ["A", None, "C"]


def test_random_strings_agree_with_reference_dynamic_programme():
    rng = random.Random(0)
    for _ in range(200):
        ref = [rng.choice("abcd") for _ in range(rng.randint(0, 8))]
        hyp = [rng.choice("abcd") for _ in range(rng.randint(0, 8))]
        alignment = align(ref, hyp)
        errors = len(alignment.ops) - alignment.count("C")
        assert errors == reference_edit_distance(ref, hyp)
        assert [u for u in alignment.ref if u is not None] == ref
        assert [u for u in alignment.hyp if u is not None] == hyp
        assert alignment.count("C") + alignment.count("S") + alignment.count("D") == len(ref)


def test_summary_format():
    result = ScoreResult(unit="char", insertions=66, deletions=172, substitutions=4655,
                         total=104765, sentences=7176, sentence_errors=2226,
                         missing=["x"], extra=["y", "z"])
    assert format_summary(result).splitlines() == [
        "%CER 4.67 [ 4893 / 104765, 66 ins, 172 del, 4655 sub ]",
        "%SER 31.02 [ 2226 / 7176 ]",
        "Scored 7176 sentences, 1 not present in hyp, 2 extra in hyp.",
    ]
    result.unit = "word"
    assert format_summary(result).startswith("%WER 4.67 [ 4893 / 104765,")


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_cli_prints_summary_and_writes_alignments(tmp_path, capsys, caplog):
    ref = write(tmp_path / "ref", ["u1 今天 天气", "u2 你好", "u3 再见"])
    hyp = write(tmp_path / "hyp", ["u1 啊今天天汽", "u2", "u9 多余"])
    per_utt = tmp_path / "out" / "per_utt"
    assert main(["--cer", "--per-utt", str(per_utt), ref, hyp]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "%CER 75.00 [ 6 / 8, 1 ins, 4 del, 1 sub ]",
        "%SER 100.00 [ 3 / 3 ]",
        "Scored 3 sentences, 1 not present in hyp, 1 extra in hyp.",
    ]
    assert "reference ids without a hypothesis in" in caplog.text
    assert "(scored as deletions): 1 (u3)" in caplog.text
    assert "(ignored): 1 (u9)" in caplog.text
    assert per_utt.read_text(encoding="utf-8").splitlines() == [
        "u1 ref * 今 天 天 气",
        "u1 hyp 啊 今 天 天 汽",
        "u1 op I C C C S",
        "u1 #csid 3 1 1 0",
        "u2 ref 你 好",
        "u2 hyp * *",
        "u2 op D D",
        "u2 #csid 0 0 0 2",
        "u3 ref 再 见",
        "u3 hyp * *",
        "u3 op D D",
        "u3 #csid 0 0 0 2",
    ]


def test_cli_word_mode(tmp_path, capsys):
    ref = write(tmp_path / "ref", ["a the cat sat", "b on the mat"])
    hyp = write(tmp_path / "hyp", ["a the cat sat", "b on a mat"])
    assert main([ref, hyp]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        "%WER 16.67 [ 1 / 6, 0 ins, 0 del, 1 sub ]",
        "%SER 50.00 [ 1 / 2 ]",
    ]


def test_duplicate_ids_are_an_error_naming_the_file(tmp_path):
    ref = write(tmp_path / "ref", ["a 一", "a 二"])
    hyp = write(tmp_path / "hyp", ["a 一"])
    with pytest.raises(TableError, match="ref:2: duplicate key 'a'"):
        main(["--cer", ref, hyp])
