"""`prep_wds index`: an index for WeNet UIO shards written by another tool."""

from __future__ import annotations

import io
import tarfile
import zlib

import pytest

from cat.features.fbank import num_frames
from cat.formats import audio_pack, prep_wds, shard_check, shard_format, shard_index
from cat.testing.audio import make_data_dir
from cat.testing.uio import UioUtterance, make_uio_corpus, synth_wav, write_uio_shard

# Keys with dots, path prefixes and a '%': kept exactly as the member names hold them.
TEXTS = {"A/B/utt.1": "今天 天气", "BAC009S0002W0122": "很 好", "sp0.9-x.y.z": "三",
         "a%41": "四", "C/utt": "五"}


def _expected_frames() -> dict[str, int]:
    # make_uio_corpus: utterance i lasts 0.5 + 0.1 * (i % 5) s at 16 kHz.
    return {key: num_frames(round((0.5 + 0.1 * (i % 5)) * 16000))
            for i, key in enumerate(TEXTS)}


@pytest.mark.slow
@pytest.mark.parametrize(("gzip", "num_jobs"), [(False, 2), (True, 1)])
def test_index_of_uio_shards_has_exact_counts(tmp_path, gzip, num_jobs):
    corpus = make_uio_corpus(tmp_path / "uio", TEXTS, utts_per_shard=2, gzip=gzip)
    folder = corpus.shards[0].parent
    index = shard_index.index_folder(folder, num_jobs=num_jobs)

    frames = _expected_frames()
    keys = list(TEXTS)
    assert [r["keys"] for r in index.shards] == [keys[0:2], keys[2:4], keys[4:]]
    assert [r["shard"] for r in index.shards] == [p.name for p in corpus.shards]
    for record, path in zip(index.shards, corpus.shards, strict=True):
        assert record["frames"] == [frames[k] for k in record["keys"]]
        assert record["num_bytes"] == path.stat().st_size
        assert record["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
    header = index.header
    assert header["content"] == "audio" and header["key_encoding"] == "none"
    assert (header["audio_format"], header["sample_rate"], header["feat_dim"]) == \
        ("wav", 16000, None)
    assert header["fmt"] == (None if gzip else "shards_%09d.tar")
    assert index.num_utts == len(TEXTS) and index.num_frames == sum(frames.values())
    counts = shard_format.read_index_counts(str(folder / shard_format.INDEX_NAME))
    assert counts.shards[corpus.shards[1].name][:2] == (2, frames[keys[2]] + frames[keys[3]])
    assert shard_check.validate(folder) == []


def test_validate_names_damaged_gzip_data_instead_of_crashing(tmp_path):
    corpus = make_uio_corpus(tmp_path / "uio", {f"u{i}": "好" for i in range(6)},
                             utts_per_shard=3, gzip=True)
    folder = corpus.shards[0].parent
    shard_index.index_folder(folder)
    data = bytearray(corpus.shards[1].read_bytes())
    for position in range(len(data) // 3, len(data) // 3 + 2000):
        data[position] ^= 0x5A  # deflate data that does not decode (zlib.error)
    corpus.shards[1].write_bytes(bytes(data))
    problems = shard_check.validate(folder)
    assert problems[0] == f"{corpus.shards[1]}: crc32 differs from the index"
    assert problems[1].startswith(f"{corpus.shards[1]}: unreadable tar after 1 members: "
                                  "Error -3 while decompressing data"), problems


def test_reindexing_keeps_an_up_to_date_index_and_redoes_a_changed_one(tmp_path, monkeypatch):
    corpus = make_uio_corpus(tmp_path / "uio", TEXTS, utts_per_shard=2)
    folder = corpus.shards[0].parent
    prep_wds.main(["index", str(folder)])
    before = (folder / shard_format.INDEX_NAME).read_bytes()

    def fail(path):
        raise AssertionError(f"{path} read again")

    with monkeypatch.context() as patch:
        patch.setattr(shard_index, "index_shard", fail)
        shard_index.index_folder(folder)
    assert (folder / shard_format.INDEX_NAME).read_bytes() == before
    write_uio_shard(corpus.shards[2], [UioUtterance("C/utt", synth_wav(1.5, seed=4), "五"),
                                       UioUtterance("D.1", synth_wav(0.7, seed=5), "六")])
    index = shard_index.index_folder(folder)
    assert index.shards[2]["keys"] == ["C/utt", "D.1"]
    assert index.shards[2]["frames"] == [num_frames(24000), num_frames(11200)]
    assert shard_check.validate(folder) == []


def test_validate_checks_uio_member_names_against_the_index(tmp_path):
    corpus = make_uio_corpus(tmp_path / "uio", TEXTS, utts_per_shard=5)
    folder = corpus.shards[0].parent
    shard_index.index_folder(folder)
    # Another order of the same utterances: same size, other names at each place.
    items = list(TEXTS.items())
    write_uio_shard(corpus.shards[0], [UioUtterance(k, synth_wav(0.5 + 0.1 * (i % 5), seed=i),
                                                    t) for i, (k, t) in enumerate(items)][::-1])
    problems = shard_check.validate(folder)
    assert f"{corpus.shards[0]}: crc32 differs from the index" in problems
    assert f"{corpus.shards[0]}: member 0 is 'C/utt.txt', expected A/B/utt.1.txt or " \
           "A/B/utt.1.wav" in problems


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_malformed_shards_are_errors_naming_shard_and_member(tmp_path):
    wav = synth_wav(0.5)
    cases = {
        "no-text": ([("a.b.wav", wav)], r"key 'a\.b' has only a \.wav member"),
        "not-utf8": ([("k.txt", "今天".encode("gbk")), ("k.wav", wav)],
                     r"member 'k\.txt': the transcript is not UTF-8"),
        "unknown": ([("k.txt", b"x"), ("k.mp4", b"x")], r"unknown extension 'mp4'"),
        "apart": ([("k.txt", b"x"), ("k.wav", wav), ("j.txt", b"y"), ("j.wav", wav),
                   ("k.flac", wav)], r"key 'k' also has members earlier"),
        "garbage": ([("k.txt", b"x"), ("k.wav", b"RIFF" + bytes(60))],
                    r"cannot decode audio .*data-00000.tar:k\.wav"),
    }
    for name, (members, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        _tar(folder / "data-00000.tar", members)
        with pytest.raises(ValueError, match=message):
            shard_index.index_folder(folder)
        assert not (folder / shard_format.INDEX_NAME).exists()


def test_a_folder_our_packer_wrote_is_refused(tmp_path):
    data = make_data_dir(tmp_path / "corpus", durations=(0.5, 0.6))
    audio_pack.pack_audio(data, tmp_path / "ours", "wav")
    with pytest.raises(FileExistsError, match="was written by the packer"):
        shard_index.index_folder(tmp_path / "ours")
    with pytest.raises(FileNotFoundError, match=r"no \*\.tar, .* shards"):
        shard_index.index_folder(tmp_path / "corpus")
