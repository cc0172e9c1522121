"""Lexicons and the lexicon (phone) tokenizer."""

from __future__ import annotations

import logging

import pytest

from cat.text.lexicon import (
    LexiconError,
    LexiconTokenizer,
    lexicon_tokenizer,
    pinyin_phones,
    read_lexicon,
    read_pronunciations,
)
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


def test_a_gbk_lexicon_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_bytes("SIL sil\n天气 t ian1 q i4\n".encode("gbk"))
    with pytest.raises(LexiconError, match=r"lexicon\.txt:2: not valid UTF-8 \(invalid "
                       r"continuation byte at byte 1 of the line\); it may be GBK/GB18030, "
                       r"which reads '天气 t ian1 q i4': convert it with 'iconv -f GB18030 -t "
                       r"UTF-8'"):
        read_lexicon(path)


def test_a_byte_order_mark_is_left_out_with_a_warning(tmp_path, caplog):
    path = tmp_path / "lexicon.txt"
    path.write_text("\ufeff今天 j in1 t ian1\n天 t ian1\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="cat.text.lexicon"):
        lexicon = read_lexicon(path)
    assert list(lexicon) == ["今天", "天"]
    assert "lexicon.txt: starts with a UTF-8 byte-order mark (BOM); it is ignored" in caplog.text


def test_alternative_pronunciations_spell_decoding_graphs_not_training_targets(
        lexicon_file, tmp_path, caplog):
    with open(lexicon_file, "a", encoding="utf-8") as f:
        f.write("好 h ao3\n")  # a repeated entry adds nothing
    assert read_pronunciations(lexicon_file)["好"] == [["h", "ao3"], ["h", "ao4"]]
    with caplog.at_level(logging.INFO, logger="cat.text.lexicon"):
        tokenizer = lexicon_tokenizer(lexicon_file)
    assert ("lexicon.txt: 1 words have alternative pronunciations (e.g. 好): the first spells "
            "the training transcripts, all are in decoding graphs") in caplog.text
    units = tokenizer.units
    assert [units[i] for i in tokenizer.encode("很好")] == ["h", "en3", "h", "ao3"]
    assert tokenizer.pronunciations("好") == [["h", "ao3"], ["h", "ao4"]]
    assert tokenizer.pronunciations("今天很") == [["j", "in1", "t", "ian1", "h", "en3"]]
    assert "ao4" in units  # a phone of an alternative only is a unit too
    save(tokenizer, tmp_path / "t.tknz")
    assert load(tmp_path / "t.tknz").pronunciations("好") == [["h", "ao3"], ["h", "ao4"]]


@pytest.mark.parametrize(("phone", "why"), [
    ("<unk>", "unknown text"), ("<blk>", "the CTC blank"), ("<s>", "sentence start"),
    ("</s>", "sentence end"), ("<eps>", "the graphs' epsilon"),
    ("#0", "a disambiguation symbol of the decoding graphs"),
], ids=["unk", "blk", "bos", "eos", "eps", "hash0"])
def test_a_reserved_symbol_as_a_phone_is_named(tmp_path, phone, why):
    path = tmp_path / "lexicon.txt"
    path.write_text(f"今天 j in1 t ian1\n嗯 {phone}\n", encoding="utf-8")
    with pytest.raises(LexiconError, match=rf"lexicon\.txt:2: word '嗯': phone '{phone}' is a "
                                           rf"reserved symbol \({why}\); rename the phone"):
        read_lexicon(path)
    with pytest.raises(ValueError, match=rf"lexicon word '嗯': phone '{phone}' is a reserved"):
        LexiconTokenizer.from_lexicon({"嗯": [phone]})


def test_tokenizer_units_name_a_phone_given_twice_or_reserved():
    with pytest.raises(ValueError, match=r"lexicon units hold 'a' twice \(ids 2 and 3\)"):
        LexiconTokenizer(["<blk>", "<unk>", "a", "a"], {"x": ["a"]})
    with pytest.raises(ValueError, match=r"lexicon unit '<s>' \(id 3\) is a reserved symbol"):
        LexiconTokenizer(["<blk>", "<unk>", "a", "<s>"], {"x": ["a"]})
    with pytest.raises(ValueError, match=r"lexicon word 'x': phone '<unk>' is a reserved"):
        LexiconTokenizer(["<blk>", "<unk>", "a"], {"x": ["<unk>"]})
