"""Tokenizers: special ids, round trips, whitespace handling, files that execute nothing."""

from __future__ import annotations

import base64
import json
import os
import pickle

import pytest

from cat.core.io import write_table
from cat.testing.features import write_transcripts
from cat.text import tokenizer as tk


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Kaldi text with spaces between words, and its transcripts."""
    path = tmp_path_factory.mktemp("text") / "text"
    return path, write_transcripts(path, num_utts=60, spaces=True, seed=1)


@pytest.fixture(scope="module")
def char_model(corpus):
    return tk.train_sentencepiece([corpus[0]], "char", 0)


def test_normalize_whitespace_modes():
    text = " 今天  天气 hello  world 好 "
    assert tk.normalize_whitespace(text, "cjk") == "今天天气hello world好"
    assert tk.normalize_whitespace(text, "remove") == "今天天气helloworld好"
    assert tk.normalize_whitespace(text, "keep") == "今天 天气 hello world 好"
    with pytest.raises(ValueError, match="unknown whitespace mode"):
        tk.normalize_whitespace(text, "strip")


def test_char_model_covers_every_character_with_fixed_special_ids(corpus, char_model):
    _, transcripts = corpus
    characters = set("".join(transcripts.values())) - {" "}
    assert char_model.vocab_size == len(characters) + 2
    assert char_model.id_to_piece(tk.BLANK_ID) == "<blk>"
    assert char_model.id_to_piece(tk.UNK_ID) == "<unk>"
    assert {char_model.id_to_piece(i) for i in range(2, char_model.vocab_size)} == characters
    for text in transcripts.values():
        ids = char_model.encode(text)
        assert len(ids) == len(text.replace(" ", ""))
        assert tk.BLANK_ID not in ids and tk.UNK_ID not in ids
        assert char_model.decode(ids) == text.replace(" ", "")


def test_spaces_do_not_become_unk(char_model):
    assert char_model.encode("的 一  是") == char_model.encode("的一是")
    assert tk.UNK_ID not in char_model.encode(" 的\t一 是 ")
    assert char_model.encode("的鑫") == [char_model.encode("的")[0], tk.UNK_ID]


def test_keeping_spaces_reproduces_the_unk_pitfall(corpus):
    tokenizer = tk.train_sentencepiece([corpus[0]], "char", 0, whitespace="remove")
    tokenizer.whitespace = "keep"  # as if the spaces had not been removed before encoding
    assert tk.UNK_ID in tokenizer.encode("的 一")


def test_decode_skips_blanks_and_rejects_unknown_ids(char_model):
    ids = char_model.encode("的一是")
    assert char_model.decode([0, ids[0], 0, 0, ids[1], ids[2], 0]) == "的一是"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        char_model.decode([char_model.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        char_model.decode([-1])


def test_char_model_with_a_vocabulary_limit_maps_rare_characters_to_unk(corpus):
    tokenizer = tk.train_sentencepiece([corpus[0]], "char", 10)
    assert tokenizer.vocab_size == 10
    all_ids = [i for text in corpus[1].values() for i in tokenizer.encode(text)]
    assert tk.UNK_ID in all_ids
    assert set(all_ids) <= set(range(1, 10))


@pytest.mark.parametrize(("model_type", "vocab_size"), [("bpe", 80), ("unigram", 70)])
def test_subword_models_round_trip_and_keep_user_symbols(corpus, model_type, vocab_size):
    path, transcripts = corpus
    tokenizer = tk.train_sentencepiece([path], model_type, vocab_size, user_symbols=["<noise>"])
    assert tokenizer.vocab_size <= vocab_size
    assert [tokenizer.id_to_piece(i) for i in range(3)] == ["<blk>", "<unk>", "<noise>"]
    for text in transcripts.values():
        ids = tokenizer.encode(text)
        assert tk.UNK_ID not in ids and tk.BLANK_ID not in ids
        assert tokenizer.decode(ids) == text.replace(" ", "")
    ids = tokenizer.encode("的<noise>一")
    assert 2 in ids
    assert tokenizer.decode(ids) == "的<noise>一"


def test_sentencepiece_rejects_bad_options(corpus):
    with pytest.raises(ValueError, match="only valid for char models"):
        tk.train_sentencepiece([corpus[0]], "bpe", 0)
    with pytest.raises(ValueError, match="unknown SentencePiece model type"):
        tk.train_sentencepiece([corpus[0]], "word", 100)
    with pytest.raises(ValueError, match="invalid user symbol"):
        tk.train_sentencepiece([corpus[0]], "char", 0, user_symbols=["<unk>"])
    with pytest.raises(ValueError, match="SentencePiece training failed"):
        tk.train_sentencepiece([corpus[0]], "bpe", 5)


@pytest.fixture(scope="module")
def jieba_inputs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("jieba")
    write_table(directory / "text", [("u1", "我们 去 公园散步"), ("u2", "我们喜欢公园"), ("u3", ""),
                                     ("u4", "我们<noise>去公园 hello world")])
    (directory / "user.dict").write_text("公园散步 100000\n", encoding="utf-8")
    return directory / "text", directory / "user.dict"


@pytest.fixture(scope="module")
def jieba_model(jieba_inputs):
    text, user_dict = jieba_inputs
    return tk.train_jieba([text], user_dict=user_dict, user_symbols=["<noise>"])


def test_jieba_vocabulary_comes_from_segmented_training_text(jieba_model):
    # Counts: 我们 3; 公园, 去 2; the rest 1. Most frequent first, ties in byte order;
    # 公园散步 is one word only thanks to the user dictionary.
    assert jieba_model.vocab == ["<blk>", "<unk>", "<noise>", "我们", "公园", "去",
                                 "hello", "world", "公园散步", "喜欢"]
    ids = jieba_model.encode("我们 去公园散步")
    assert [jieba_model.id_to_piece(i) for i in ids] == ["我们", "去", "公园散步"]
    assert jieba_model.encode("我们去公园散步") == ids
    assert jieba_model.decode([0, *ids, 0]) == "我们去公园散步"
    assert jieba_model.encode("他们去学校") == [tk.UNK_ID, 5, tk.UNK_ID]
    assert jieba_model.encode("<noise>我们") == [2, 3]
    assert jieba_model.decode(jieba_model.encode("去公园 hello world")) == "去公园hello world"


def test_jieba_min_count_and_vocab_size(jieba_inputs):
    text, user_dict = jieba_inputs
    tokenizer = tk.train_jieba([text], vocab_size=5, min_count=2, user_dict=user_dict,
                               user_symbols=["<noise>"])
    assert tokenizer.vocab == ["<blk>", "<unk>", "<noise>", "我们", "公园"]
    with pytest.raises(ValueError, match="no room"):
        tk.train_jieba([text], vocab_size=3, user_symbols=["<noise>"])
    with pytest.raises(ValueError, match="min count"):
        tk.train_jieba([text], min_count=0)


def test_save_load_and_pickle_round_trips(tmp_path, corpus, char_model, jieba_model):
    unigram = tk.train_sentencepiece([corpus[0]], "unigram", 70)
    sample = "的一是 在不了 公园散步 鑫"
    for model in (char_model, unigram, jieba_model):
        path = tmp_path / f"{model.type_name}.tknz"
        tk.save(model, path)
        loaded = tk.load(path)
        assert type(loaded) is type(model)
        assert loaded == model
        assert loaded.vocab_size == model.vocab_size
        assert [loaded.id_to_piece(i) for i in range(loaded.vocab_size)] == \
            [model.id_to_piece(i) for i in range(model.vocab_size)]
        assert loaded.encode(sample) == model.encode(sample)
        copied = pickle.loads(pickle.dumps(model))
        assert copied == model
        assert copied.encode(sample) == model.encode(sample)
        assert json.loads(path.read_text(encoding="utf-8"))["type"] == model.type_name
    # The user dictionary travels inside the file.
    assert tk.load(tmp_path / "jieba.tknz").encode("公园散步") == [8]


class _Exploit:
    """Unpickling this would create the file named by `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_or_malformed_files_are_rejected_without_running_code(tmp_path, char_model):
    marker = tmp_path / "pwned"
    pickled = tmp_path / "pickled.tknz"
    pickled.write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(tk.TokenizerFileError, match=r"pickled\.tknz"):
        tk.load(pickled)
    assert not marker.exists()

    valid = {"format": "cat-tokenizer", "version": 1, "type": "sentencepiece",
             "config": char_model.to_config()}
    cases = {
        "type": {**valid, "type": "os.system"},
        "builtin": {**valid, "type": "__import__"},
        "version": {**valid, "version": 99},
        "format": {**valid, "format": "pickle"},
        "key": {**valid, "config": {**valid["config"], "exec": "print(1)"}},
        "missing": {**valid, "config": {"whitespace": "cjk"}},
        "base64": {**valid, "config": {**valid["config"], "model": "@@@"}},
        "model": {**valid, "config": {**valid["config"],
                                      "model": base64.b64encode(b"garbage").decode()}},
        "jieba": {**valid, "type": "jieba", "config": {"vocab": ["a"], "user_dict": None,
                                                       "user_symbols": [], "whitespace": "cjk"}},
    }
    messages = {"type": "unknown tokenizer type", "builtin": "unknown tokenizer type",
                "version": "unsupported version", "format": "not a tokenizer file",
                "key": "unknown config key 'exec'", "missing": "missing config key 'model'",
                "base64": "not base64", "model": "not a SentencePiece model",
                "jieba": "must start with"}
    for name, document in cases.items():
        path = tmp_path / f"{name}.tknz"
        path.write_text(json.dumps(document), encoding="utf-8")
        with pytest.raises(tk.TokenizerFileError, match=messages[name]) as error:
            tk.load(path)
        assert str(path) in str(error.value)

    truncated = tmp_path / "truncated.tknz"
    truncated.write_text(json.dumps(valid)[:100], encoding="utf-8")
    with pytest.raises(tk.TokenizerFileError, match="not UTF-8 JSON"):
        tk.load(truncated)
    with pytest.raises(FileNotFoundError, match=r"absent\.tknz"):
        tk.load(tmp_path / "absent.tknz")


def test_cli_train_encode_decode_vocab(tmp_path, corpus, capsys):
    out = tmp_path / "exp" / "tokenizer.tknz"
    tk.main(["train", "--type", "sentencepiece", "--model-type", "char", "--vocab-size", "0",
             "--text", str(corpus[0]), "--user-symbols", "<noise>,<spk>", "--out", str(out)])
    tokenizer = tk.load(out)
    assert [tokenizer.id_to_piece(i) for i in range(4)] == ["<blk>", "<unk>", "<noise>", "<spk>"]
    capsys.readouterr()
    tk.main(["encode", "-t", str(out), "的 一是"])
    ids = capsys.readouterr().out.split()
    assert [int(i) for i in ids] == tokenizer.encode("的一是")
    tk.main(["decode", "-t", str(out), "--table", f"utt1 {' '.join(ids)}"])
    assert capsys.readouterr().out == "utt1 的一是\n"
    tk.main(["vocab", "-t", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == tokenizer.vocab_size
    assert lines[:2] == ["0 <blk>", "1 <unk>"]
