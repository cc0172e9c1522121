"""The independent WeNet UIO writer: its shards and data.list files as other tools read them."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import soundfile
from webdataset import tariterators

from cat.testing.uio import (
    UioUtterance,
    check_key,
    make_uio_corpus,
    split_member_name,
    synth_wav,
    write_uio_shard,
)

TEXTS = {
    "A/B/utt.1": "今天 天气 很好",
    "BAC009S0002W0122": "而对楼市成交抑制作用最大的限购",
    "sp0.9-BAC009S0002W0123": "也成为地方政府的眼中钉",
    "C/utt.2.3": "自六月底",
    "X0000000000_S00001": "好",
}


def _members(shard) -> list[tuple[str, bytes]]:
    with tarfile.open(shard) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def test_shards_hold_text_then_audio_under_the_keys(tmp_path):
    corpus = make_uio_corpus(tmp_path, TEXTS, utts_per_shard=2)
    assert [p.name for p in corpus.shards] == [
        "shards_000000000.tar", "shards_000000001.tar", "shards_000000002.tar"]
    names = [name for shard in corpus.shards for name, _ in _members(shard)]
    assert names == [f"{key}.{ext}" for key in TEXTS for ext in ("txt", "wav")]
    for shard in corpus.shards:
        members = _members(shard)
        for (text_name, text), (audio_name, audio) in zip(members[::2], members[1::2],
                                                          strict=True):
            key, extension = split_member_name(text_name)
            assert extension == "txt" and split_member_name(audio_name) == (key, "wav")
            assert text.decode("utf-8") == TEXTS[key]
            waveform, rate = soundfile.read(io.BytesIO(audio), dtype="int16")
            assert rate == 16000 and waveform.ndim == 1 and waveform.size >= 8000


def test_webdataset_reads_the_members_and_groups_them_by_the_last_dot(tmp_path):
    corpus = make_uio_corpus(tmp_path, TEXTS, utts_per_shard=5)
    streams = tariterators.url_opener([{"url": str(corpus.shards[0])}])
    files = list(tariterators.tar_file_expander(streams, eof_value=None))
    assert [f["fname"] for f in files] == [f"{key}.{ext}" for key in TEXTS
                                           for ext in ("txt", "wav")]
    samples = list(tariterators.group_by_keys(iter(files), keys=split_member_name))
    assert [s["__key__"] for s in samples] == list(TEXTS)
    assert all(set(s) >= {"txt", "wav"} for s in samples)
    assert [s["txt"].decode() for s in samples] == list(TEXTS.values())
    # webdataset's own rule splits at the first dot of the file name: keys with dots break.
    default = list(tariterators.group_by_keys(iter(files)))
    assert "A/B/utt" in [s["__key__"] for s in default]


def test_data_lists_in_shard_and_raw_mode(tmp_path):
    corpus = make_uio_corpus(tmp_path, TEXTS, utts_per_shard=2)
    lines = corpus.shard_list.read_text().splitlines()
    assert lines == [str(p) for p in corpus.shards]
    raw = corpus.raw_list.read_text(encoding="utf-8")
    assert "今天 天气 很好" in raw  # not \u-escaped
    records = [json.loads(line) for line in raw.splitlines()]
    assert [r["key"] for r in records] == list(TEXTS)
    assert [r["txt"] for r in records] == list(TEXTS.values())
    for record in records:
        assert record["wav"].endswith(f"{record['key']}.wav")
        assert soundfile.info(record["wav"]).samplerate == 16000


def test_gzip_shards_and_audio_first_order(tmp_path):
    corpus = make_uio_corpus(tmp_path, TEXTS, utts_per_shard=5, gzip=True)
    assert corpus.shards[0].name.endswith(".tar.gz")
    with tarfile.open(corpus.shards[0], "r:gz") as tar:
        assert tar.getnames()[0] == "A/B/utt.1.txt"
    shard = write_uio_shard(tmp_path / "audio_first.tar",
                            [UioUtterance("k.1", synth_wav(0.2), "x", "flac")],
                            text_first=False)
    assert [name for name, _ in _members(shard)] == ["k.1.flac", "k.1.txt"]


@pytest.mark.parametrize("key", ["", "/abs/utt", "A//utt", "A/../utt", "utt 1", "A/./b"])
def test_unusable_keys_are_refused(key):
    with pytest.raises(ValueError, match="unusable UIO key"):
        check_key(key)


def test_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="duplicate"):
        make_uio_corpus(tmp_path, [("a", "x"), ("a", "y")])
