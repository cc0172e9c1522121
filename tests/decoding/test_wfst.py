"""WFST (TLG) decoding for a char CTC model and a phone (CTC-CRF) model's tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cat.core.io import write_table
from cat.decoding import searcher as searcher_module
from cat.decoding import wfst
from cat.decoding.searcher import DecodeOptions, Searcher, searcher_for
from cat.decoding.wfst import decode_all, decoding_graph, pronouncer
from cat.lm.ngram import estimate, write_arpa
from cat.text.lexicon import LexiconTokenizer
from cat.text.tokenizer import train_sentencepiece

WORDS = [["今天", "天气"], ["天气", "很好"], ["今天", "很好"], ["银行"]]


def _arpa(tmp_path):
    write_arpa(estimate(WORDS, 2, discount_fallback=(0.5, 1.0, 1.5)), tmp_path / "lm.arpa")
    return tmp_path / "lm.arpa"


def _frames(ids, vocab):
    """Log-posteriors spelling `ids` with a blank after each."""
    out = np.full((2 * len(ids), vocab), -9.0, np.float32)
    for i, k in enumerate(ids):
        out[2 * i, k] = 0.0
        out[2 * i + 1, 0] = 0.0
    return out


def test_char_ctc_decodes_words_through_tlg(tmp_path):
    write_table(tmp_path / "text", [(f"u{i}", "".join(w)) for i, w in enumerate(WORDS)])
    tokenizer = train_sentencepiece([tmp_path / "text"])
    graph = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph")
    assert (tmp_path / "graph" / "TLG.fst").is_file()
    ids = tokenizer.encode("今天天气")
    hyps = decode_all(graph, {"u": _frames(ids, tokenizer.vocab_size)}, 1.0, 1.0, 16.0)
    assert hyps == {"u": "今天天气"}
    # cached: the second call reads the files
    again = decoding_graph(tokenizer, tmp_path / "missing.arpa", tmp_path / "graph")
    assert again.words == graph.words


def test_phone_model_decodes_words_and_leaves_out_unpronounceable_ones(tmp_path):
    lexicon = {"今天": ["j", "in1", "t", "ian1"], "天气": ["t", "ian1", "q", "i4"],
               "很好": ["h", "en3", "h", "ao3"]}
    tokenizer = LexiconTokenizer.from_lexicon(lexicon)
    assert pronouncer(tokenizer)("银行") is None  # no entry covers it
    graph = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph")
    assert graph.info["unpronounced"] == 2  # 银行 and <unk>
    ids = tokenizer.encode("天气很好")
    hyps = decode_all(graph, {"u": _frames(ids, tokenizer.vocab_size)}, 1.0, 1.0, 16.0)
    assert hyps == {"u": "天气很好"}


def test_phone_model_decodes_a_words_alternative_pronunciation(tmp_path):
    lexicon = {"今天": ["j", "in1", "t", "ian1"], "天气": ["t", "ian1", "q", "i4"],
               "很好": ["h", "en3", "h", "ao3"]}
    tokenizer = LexiconTokenizer.from_lexicon(lexicon, alternatives={
        "很好": [["h", "en3", "h", "ao4"]]})
    spellings = pronouncer(tokenizer)("很好")
    assert [[tokenizer.units[i] for i in ids] for ids in spellings] == [
        ["h", "en3", "h", "ao3"], ["h", "en3", "h", "ao4"]]
    graph = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph")
    ids = [tokenizer.unit_to_id[p] for p in ["t", "ian1", "q", "i4", "h", "en3", "h", "ao4"]]
    hyps = decode_all(graph, {"u": _frames(ids, tokenizer.vocab_size)}, 1.0, 1.0, 16.0)
    assert hyps == {"u": "天气很好"}
    assert tokenizer.encode("很好") == [tokenizer.unit_to_id[p] for p in lexicon["很好"]]


def test_hotwords_file_biases_the_graph_and_a_new_list_rebuilds_the_cache(tmp_path, caplog):
    """A hotwords file (the beam searches' format) for TLG: each phrase a word whose bonus
    is its score per token times its tokens; a phrase the tokenizer cannot spell is named
    and left out; the cached graph is rebuilt when the boosts change."""
    from cat.decoding.wfst import hotword_boosts

    write_table(tmp_path / "text", [(f"u{i}", "".join(w)) for i, w in enumerate(WORDS)])
    tokenizer = train_sentencepiece([tmp_path / "text"])
    hotwords = tmp_path / "hotwords.txt"
    hotwords.write_text("天气很好\n今天 :2.5\n火星\n", encoding="utf-8")
    boosts = hotword_boosts(hotwords, tokenizer, 1.5)
    assert boosts == {"天气很好": 6.0, "今天": 5.0}
    assert "line 3 '火星'" in caplog.text  # the tokenizer has no 火 or 星
    # The phrase decodes as one word of the biased graph, two of the plain one.
    ids = tokenizer.encode("天气很好")
    frames = _frames(ids, tokenizer.vocab_size)
    plain = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph")
    assert "天气很好" not in plain.words
    assert decode_all(plain, {"u": frames}, 1.0, 1.0, 16.0) == {"u": "天气很好"}
    biased = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph", boosts)
    assert "天气很好" in biased.words and biased.info["hotwords"] == {"boosted": 1, "added": 1}
    assert decode_all(biased, {"u": frames}, 1.0, 1.0, 16.0) == {"u": "天气很好"}
    assert decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph").words == plain.words


def test_a_graph_dir_is_checked_file_by_file(tmp_path, caplog):
    """words.json that is not JSON or not a word list, a TLG.fst truncated, of another
    build or not OpenFST's: each an error naming the file (before: a traceback naming no
    file, or a TypeError after OpenFST's log line); stage 5's cache is built again."""
    import json
    import logging

    from cat.decoding.wfst import GraphError, read_graph

    write_table(tmp_path / "text", [(f"u{i}", "".join(w)) for i, w in enumerate(WORDS)])
    tokenizer = train_sentencepiece([tmp_path / "text"])
    graph_dir = tmp_path / "graph"
    graph = decoding_graph(tokenizer, _arpa(tmp_path), graph_dir)
    fst_path, words_path = graph_dir / "TLG.fst", graph_dir / "words.json"
    fst, words = fst_path.read_bytes(), words_path.read_text(encoding="utf-8")
    size = len(fst)

    cases = [
        (words_path, '{"words": ["今天",', rf"{words_path}: not a TLG words file: invalid "
                                           r"JSON at line 1 column \d+: Expecting value"),
        (words_path, "\udcff", rf"{words_path}: not a TLG words file: not UTF-8"),
        (words_path, json.dumps(["今天"]), rf"{words_path}: not a TLG words file: expected an "
                                           r"object with 'words' \(a list of strings\)"),
        (fst_path, fst[:size // 2], rf"{fst_path}: {size // 2} bytes, but {words_path} records "
                                    rf"{size}: damaged, or written by another build"),
        (fst_path, b"\0garbage" * (size // 8) + b"\0" * (size % 8),
         rf"{fst_path}: not a readable OpenFST graph \(damaged or truncated\)"),
    ]
    for path, content, message in cases:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(GraphError, match=message):
            read_graph(graph_dir)
        with caplog.at_level(logging.WARNING):  # stage 5's cache: built again
            assert decoding_graph(tokenizer, _arpa(tmp_path), graph_dir).words == graph.words
        assert "building it again" in caplog.text
        assert fst_path.read_bytes() == fst and words_path.read_text(encoding="utf-8") == words
        caplog.clear()


def test_the_best_path_gives_its_units_and_each_word_their_span(tmp_path):
    """`decode_path`: the words and the units the path reads (CTC labels collapsed, a
    repeated unit kept when a blank parts it); `word_spans` places each word's spelling
    on them, alternative pronunciations included."""
    from cat.decoding.wfst import word_spans
    from cat.graph.tlg import decode_path

    lexicon = {"今天": ["j", "in1", "t", "ian1"], "天气": ["t", "ian1", "q", "i4"],
               "很好": ["h", "en3", "h", "ao3"]}
    tokenizer = LexiconTokenizer.from_lexicon(lexicon, alternatives={
        "很好": [["h", "en3", "h", "ao4"]]})
    graph = decoding_graph(tokenizer, _arpa(tmp_path), tmp_path / "graph")
    ids = [tokenizer.unit_to_id[p] for p in ["t", "ian1", "q", "i4", "h", "en3", "h", "ao4"]]
    frames = np.repeat(_frames(ids, tokenizer.vocab_size), 2, axis=0)  # 2 frames a label
    words, units = decode_path(graph, frames)
    assert (words, units) == (["天气", "很好"], ids)
    assert word_spans(words, units, pronouncer(tokenizer)) == [(0, 3), (4, 7)]
    with pytest.raises(ValueError, match="do not spell the words"):
        word_spans(["很好"], units, pronouncer(tokenizer))


@pytest.fixture(scope="module")
def tlg_experiment(tmp_path_factory):
    """A tiny trained CTC experiment over synthetic audio (blank bias lowered: WFST paths
    with words) and a TLG of its training text in words of two characters."""
    from cat.core.io import read_table
    from cat.testing.audio_experiment import train_audio_experiment
    from cat.text.tokenizer import load

    experiment, _ = train_audio_experiment(tmp_path_factory.mktemp("tlg"), epochs=2)
    root = experiment.root
    texts = read_table(root / "data/fbank/train/text").values()
    write_arpa(estimate([[text[i:i + 2] for i in range(0, len(text), 2)] for text in texts],
                        2, discount_fallback=(0.5, 1.0, 1.5)), root / "lm.arpa")
    decoding_graph(load(root / "exp/tiny/tokenizer.tknz"), root / "lm.arpa", root / "graph")
    return experiment


@pytest.mark.slow
def test_decoding_with_tlg_times_its_words(tlg_experiment, monkeypatch, caplog):
    """`python -m cat.decode --tlg`: the words of WFST decoding of each utterance's
    posteriors, each word timed by its units' spikes: in order, inside the utterance."""
    import json

    import kaldiio
    import torch

    from cat.core.io import read_table
    from cat.decoding.inference import main
    from cat.decoding.searcher import load_model
    from cat.decoding.wfst import read_graph
    from cat.graph.tlg import decode
    from cat.loading.batch import Utterance, collate

    root = tlg_experiment.root
    monkeypatch.chdir(root)
    out = root / "decode-tlg"
    checkpoint = root / "exp/tiny/lowered-blank.pt"
    assert main("cat.decode", ["exp/tiny", "--data", "data/fbank/test", "--tlg", "graph",
                               "--lm-weight", "0.5", "--format", "json", "--out", str(out),
                               "--checkpoint", str(checkpoint)]) == 0
    records = [json.loads(line) for line in (out / "hyp.jsonl").read_text().splitlines()]
    hyps = read_table(out / "hyp", allow_empty_value=True)
    graph = read_graph(root / "graph")
    model, _ = load_model("exp/tiny", checkpoint, torch.device("cpu"))

    features = kaldiio.load_scp("data/fbank/test/feats.scp")
    words = 0
    for record in records:
        batch = collate([Utterance(record["key"], features[record["key"]],
                                   np.zeros(0, np.int32))])
        with torch.no_grad():
            log_probs, _ = model.log_probs(batch.feats, batch.feat_lens)
        expected = decode(graph, log_probs[0].numpy(), lm_weight=0.5)
        assert record["text"] == hyps[record["key"]] == "".join(expected)
        timed = record["words"]
        assert [w["word"] for w in timed] == expected
        duration = len(features[record["key"]]) * 0.01
        ends = [0.0] + [edge for w in timed for edge in (w["start"], w["end"])]
        assert ends == sorted(ends) and ends[-1] <= duration + 1e-6
        words += len(expected)
    assert words >= 5
    # No N-best from the graph, no shallow fusion beside it, hotwords go into the graph.
    assert main("cat.decode", ["exp/tiny", "--data", "data/fbank/test", "--tlg", "graph",
                               "--hotwords", "x.txt", "--out", str(root / "x")]) == 1
    # A damaged graph dir: an error naming its file, exit status 1, nothing written.
    import shutil

    shutil.copytree(root / "graph", root / "damaged")
    (root / "damaged/words.json").write_text("not json", encoding="utf-8")
    caplog.clear()
    assert main("cat.decode", ["exp/tiny", "--data", "data/fbank/test", "--tlg", "damaged",
                               "--out", str(root / "y"), "--checkpoint", str(checkpoint)]) == 1
    assert "damaged/words.json: not a TLG words file: invalid JSON at line 1 column 1" \
        in caplog.text
    assert not (root / "y/hyp").exists()


def test_decoding_without_a_graph_does_not_import_the_wfst_code():
    """The searcher factory lives with `Searcher`: decoding and transcribing import
    `cat.decoding.wfst` only when `searcher_for` is given a graph."""
    code = ("import sys, cat.decoding.inference, cat.decoding.transcribe, cat.decoding.searcher;"
            "print('cat.decoding.wfst' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "False"


def test_the_factory_gives_the_tlg_searcher_with_a_graph(monkeypatch):
    built = []
    monkeypatch.setattr(wfst.TlgSearcher, "__init__",
                        lambda self, *args: built.append(("tlg", args)))
    monkeypatch.setattr(searcher_module.Searcher, "__init__",
                        lambda self, *args: built.append(("plain", args)))
    options = DecodeOptions(tlg="graph", device="cpu")
    assert type(searcher_for("exp/x", "ckpt.pt", options, "cpu")) is wfst.TlgSearcher
    plain = DecodeOptions(device="cpu")
    assert type(searcher_for("exp/x", "ckpt.pt", plain, "cpu", (None,))) is Searcher
    assert built == [("tlg", ("exp/x", "ckpt.pt", options, "cpu", [])),
                     ("plain", ("exp/x", "ckpt.pt", plain, "cpu", [None]))]
