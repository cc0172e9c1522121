"""Lexicons and the lexicon (phone) tokenizer."""

from __future__ import annotations

import pytest

from cat.text.lexicon import LexiconError, LexiconTokenizer, pinyin_phones, read_lexicon
from cat.text.tokenizer import load, save

LEXICON = """SIL sil
<SPOKEN_NOISE> sil
今天 j in1 t ian1
天气 t ian1 q i4
今 j in1
天 t ian1
很 h en3
好 h ao3
好 h ao4
"""


@pytest.fixture
def lexicon_file(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_text(LEXICON, encoding="utf-8")
    return path


def test_read_lexicon_keeps_first_pronunciation_and_drops_non_speech(lexicon_file):
    lexicon = read_lexicon(lexicon_file)
    assert lexicon["好"] == ["h", "ao3"]
    assert "SIL" not in lexicon and "<SPOKEN_NOISE>" not in lexicon


def test_a_lexicon_line_without_phones_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_text("今天 j in1 t ian1\n天气\n", encoding="utf-8")
    with pytest.raises(LexiconError, match=r"lexicon\.txt:2: word '天气' has no phones"):
        read_lexicon(path)
    with pytest.raises(LexiconError, match="does not exist"):
        read_lexicon(tmp_path / "none.txt")


def test_words_missing_from_the_lexicon(lexicon_file, tmp_path):
    tokenizer = LexiconTokenizer.from_lexicon(read_lexicon(lexicon_file))
    units = tokenizer.units
    assert units[:2] == ["<blk>", "<unk>"] and units[2:] == sorted(units[2:])
    phones = [units[i] for i in tokenizer.encode("今天 天气很好")]
    assert phones == ["j", "in1", "t", "ian1", "t", "ian1", "q", "i4", "h", "en3", "h", "ao3"]
    # 今天很 is no word of the lexicon: split into its longest lexicon words, 今天 + 很
    assert tokenizer.pronounce("今天很") == ["j", "in1", "t", "ian1", "h", "en3"]
    # a character no entry covers becomes <unk>, counted
    assert [units[i] for i in tokenizer.encode("很冷")] == ["h", "en3", "<unk>"]
    assert tokenizer.missing == {"冷": 1}
    save(tokenizer, tmp_path / "t.tknz")
    again = load(tmp_path / "t.tknz")
    assert isinstance(again, LexiconTokenizer) and again.encode("今天") == tokenizer.encode("今天")


def test_pinyin_phones_follow_aishell():
    assert pinyin_phones("hang2") == ["h", "ang2"]
    assert pinyin_phones("yi1") == ["ii", "i1"]
    assert pinyin_phones("yu2") == ["vv", "v2"]
    assert pinyin_phones("wo3") == ["uu", "uo3"]
    assert pinyin_phones("de") == ["d", "e5"]


def test_pinyin_lexicon_covers_the_transcripts_and_counts_unreadable_words(tmp_path):
    from cat.core.io import write_table
    from cat.text.lexicon import main

    write_table(tmp_path / "text", [("u1", "今天 天气 很好"), ("u2", "银行 OK 了")])
    main(["pinyin", "--text", str(tmp_path / "text"), "--out", str(tmp_path / "lexicon.txt")])
    lexicon = read_lexicon(tmp_path / "lexicon.txt")
    assert lexicon["了"] == ["l", "e5"]
    assert lexicon["银行"] == ["ii", "in2", "h", "ang2"]  # pypinyin's phrase reading
    assert "OK" not in lexicon
    tokenizer = LexiconTokenizer.from_lexicon(lexicon)
    assert 1 not in tokenizer.encode("今天天气很好")
