"""Map-style packs: join by id, frame counts, filter, drop accounting, lazy reader."""

from __future__ import annotations

import pickle
import zipfile

import kaldiio
import numpy as np
import pytest

from cat.core.io import TableError, write_table
from cat.formats import mappack, tables
from cat.testing.features import utterance_ids, write_feature_corpus
from cat.text import tokenizer as tk


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    return write_feature_corpus(directory, keys=utterance_ids(12, speed_perturb=True),
                                spaces=True, num_arks=3, dim=8, frame_range=(3, 40))


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "char.tknz"
    tk.save(tk.train_sentencepiece([corpus.text], "char", 0), path)
    return path


def test_frame_range_parsing_and_names():
    assert tables.FrameRange.parse("10:1000") == tables.FrameRange(10, 1000)
    assert tables.FrameRange.parse(":1000") == tables.FrameRange(0, 1000)
    assert tables.FrameRange.parse("1000:") == tables.FrameRange(1000, None)
    assert [tables.FrameRange.parse(s).name for s in ("10:1000", ":1000", "1000:")] == \
        ["10_1000", "0_1000", "1000_"]
    half_open = tables.FrameRange.parse("10:20")
    assert (9 in half_open, 10 in half_open, 19 in half_open, 20 in half_open) == \
        (False, True, True, False)
    assert half_open.mask(np.array([9, 10, 19, 20])).tolist() == [False, True, True, False]
    for bad in ("10", "a:b", "20:10", "10:10", "-1:5", "1:2:3"):
        with pytest.raises(ValueError, match="invalid frame range"):
            tables.FrameRange.parse(bad)


def test_frame_groups_are_sorted_and_must_not_overlap():
    ranges = tables.parse_frame_ranges(["1000:", "10:500", "500:1000"])
    assert [str(r) for r in ranges] == ["10:500", "500:1000", "1000:"]
    with pytest.raises(ValueError, match="'10:500' and '400:1000' overlap"):
        tables.parse_frame_ranges(["10:500", "400:1000"])
    with pytest.raises(ValueError, match="overlap"):
        tables.parse_frame_ranges(["100:", "200:300"])


def test_map_pack_round_trip(corpus, tokenizer_file, tmp_path):
    out = tmp_path / "pack" / "train.npz"
    counts = mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file, out)
    tokenizer = tk.load(tokenizer_file)
    source = kaldiio.load_scp(str(corpus.feats_scp))
    keys = corpus.keys
    assert counts["num_utts"] == counts["input"] == len(keys)

    with np.load(out, allow_pickle=False) as data:
        assert set(data.files) == {"meta", "keys", "num_frames", "ark_paths", "ark_index",
                                   "ark_offsets", "labels", "label_offsets"}
        assert data["labels"].dtype == np.int32 and data["num_frames"].dtype == np.int32
    reader = mappack.MapPack(out)
    assert len(reader) == len(keys)
    assert reader.meta["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    assert [reader.key(i) for i in range(len(reader))] == keys
    assert reader.num_frames.tolist() == [len(corpus.features[k]) for k in keys]
    assert len(reader.ark_paths) == 3
    for index, key in enumerate(keys):
        assert reader.label(index).tolist() == tokenizer.encode(corpus.transcripts[key])
        features = reader.features(index)
        assert features.dtype == np.float32
        assert np.array_equal(features, source[key])
        assert np.array_equal(features, corpus.features[key])
        assert reader.find(key) == index
        item = reader[index]
        assert item.key == key and np.array_equal(item.features, features)
    assert reader.label_lengths.tolist() == [len(reader.label(i)) for i in range(len(reader))]
    assert reader.metadata_bytes() / len(reader) <= 64
    with pytest.raises(KeyError, match="nope"):
        reader.find("nope")
    with pytest.raises(IndexError):
        reader[len(reader)]
    reader.close()
    assert mappack.dropped_log_path(out).read_text(encoding="utf-8") == ""


def test_repacking_gives_identical_bytes(corpus, tokenizer_file, tmp_path):
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file, first)
    mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file, second)
    assert first.read_bytes() == second.read_bytes()


def test_filter_and_drop_reasons_are_counted_and_listed(corpus, tokenizer_file, tmp_path):
    keys = corpus.keys
    short = [k for k in keys if len(corpus.features[k]) < 10]
    long = [k for k in keys if len(corpus.features[k]) >= 30]
    assert short and long
    texts = dict(corpus.transcripts)
    no_label = next(k for k in keys if k not in short + long)
    del texts[no_label]
    empty = next(k for k in keys if k not in short + long + [no_label])
    texts[empty] = ""
    all_unk = next(k for k in keys if k not in short + long + [no_label, empty])
    texts[all_unk] = "鑫 鑫"
    texts["orphan-utt"] = "的一"
    # Two text files, split by key parity: joined by id, not by line.
    items = sorted(texts.items())
    write_table(tmp_path / "text.a", items[::2])
    write_table(tmp_path / "text.b", items[1::2])
    out = tmp_path / "train.npz"
    counts = mappack.write_map_pack([corpus.feats_scp], [tmp_path / "text.b", tmp_path / "text.a"],
                                 tokenizer_file, out, "10:30")
    expected_drops = {"no_label": 1, "empty_label": 1, "no_features": 1, "all_unk": 1,
                      "out_of_range": len(short) + len(long)}
    assert {k: v for k, v in counts.items() if k.startswith("dropped_")} == \
        {f"dropped_{k}": v for k, v in expected_drops.items()}
    assert counts["input"] == len(keys) + 1
    assert counts["input"] == counts["num_utts"] + sum(expected_drops.values())
    log = dict(line.split(" ", 1) for line in
               mappack.dropped_log_path(out).read_text(encoding="utf-8").splitlines())
    assert log[no_label] == "no_label" and log[empty] == "empty_label"
    # SentencePiece merges a run of unknown characters into one <unk>.
    assert log["orphan-utt"] == "no_features" and log[all_unk] == "all_unk tokens=1"
    assert all(log[k].startswith("out_of_range num_frames=") for k in short + long)
    kept = [k for k in keys if k not in log]
    assert [mappack.MapPack(out).key(i) for i in range(counts["num_utts"])] == kept


def test_frames_from_matrix_headers_without_utt2num_frames(tmp_path):
    for compression in (None, 2):
        corpus = write_feature_corpus(tmp_path / f"c{compression}", num_utts=6, dim=5,
                                      write_utt2num_frames=False, compression_method=compression)
        table = tables.read_feature_index(corpus.feats_scp)
        assert table.keys == corpus.keys
        assert table.num_frames.tolist() == [len(corpus.features[k]) for k in corpus.keys]
    text_ark = tmp_path / "text.ark"
    kaldiio.save_ark(str(text_ark), {"u1": np.ones((7, 3), np.float32)}, text=True)
    with open(text_ark, "rb") as f:
        assert tables.read_matrix_shape(f, 3) == (7, 3)


def test_utt2num_frames_is_used_when_present(tmp_path):
    corpus = write_feature_corpus(tmp_path, num_utts=4, dim=3)
    # A deliberately wrong count proves the table, not the ark, was read.
    write_table(corpus.utt2num_frames, [(k, 999) for k in corpus.keys])
    assert tables.read_feature_index(corpus.feats_scp).num_frames.tolist() == [999] * 4


def test_bad_scp_entries_are_errors_naming_the_file(tmp_path):
    corpus = write_feature_corpus(tmp_path / "c", num_utts=3, dim=3)
    piped = tmp_path / "piped.scp"
    write_table(piped, [("u1", "copy-feats ark:a.ark ark:- |")])
    with pytest.raises(TableError, match=r"piped\.scp:1: utterance 'u1'"):
        tables.read_feature_index(piped)
    with pytest.raises(TableError, match="duplicate utterance"):
        tables.read_feature_index([corpus.feats_scp, corpus.feats_scp])
    with pytest.raises(TableError, match="duplicate utterance"):
        tables.read_labels([corpus.text, corpus.text])
    broken = tmp_path / "broken.scp"
    write_table(broken, [(corpus.keys[0], f"{tmp_path / 'c' / 'text'}:0")])
    with pytest.raises(ValueError, match="cannot read the matrix header"):
        tables.read_feature_index(broken)


def test_nothing_left_is_an_error_after_writing_the_drop_list(corpus, tokenizer_file, tmp_path):
    out = tmp_path / "train.npz"
    with pytest.raises(ValueError, match="no utterances left"):
        mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file, out, "1000:")
    assert not out.exists()
    assert len(mappack.dropped_log_path(out).read_text(encoding="utf-8").splitlines()) == \
        len(corpus.keys)


def test_reader_pickles_light_and_reopens_arks_per_process(corpus, tokenizer_file, tmp_path,
                                                           monkeypatch):
    out = tmp_path / "train.npz"
    mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file, out)
    reader = mappack.MapPack(out)
    first = reader.features(0)
    assert len(pickle.dumps(reader)) < 1000
    copy = pickle.loads(pickle.dumps(reader))
    assert np.array_equal(copy.features(0), first)
    assert np.array_equal(copy.labels, reader.labels)
    handles = reader._handles
    assert handles
    # As in a forked DataLoader worker: a new process id means fresh file handles.
    monkeypatch.setattr(mappack.os, "getpid", lambda: -1)
    assert np.array_equal(reader.features(1), corpus.features[corpus.keys[1]])
    assert reader._handles is not handles
    assert all(not h.closed for h in handles.values())


def test_reader_rejects_other_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent"):
        mappack.MapPack(tmp_path / "absent.npz")
    not_npz = tmp_path / "text.npz"
    not_npz.write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match=r"text\.npz: not a map pack"):
        mappack.MapPack(not_npz)
    other = tmp_path / "other.npz"
    with zipfile.ZipFile(other, "w"):
        pass
    with pytest.raises(ValueError, match="missing member 'meta'"):
        mappack.MapPack(other)


def test_cli(corpus, tokenizer_file, tmp_path):
    out = tmp_path / "pack" / "train.npz"
    mappack.main(["--tokenizer", str(tokenizer_file), "--scp", str(corpus.feats_scp),
               "--text", str(corpus.text), "--filter", "10:", "--out", str(out)])
    reader = mappack.MapPack(out)
    assert reader.meta["frame_range"] == "10:"
    assert len(reader) == sum(len(f) >= 10 for f in corpus.features.values())
