"""WeNet data.list reading: modes, resolved locations, pieces, offsets, errors by line."""

from __future__ import annotations

import json

import pytest

from cat.formats.data_list import (
    DataListError,
    RawEntry,
    ShardLine,
    read_data_list,
    read_raw_entries,
)


def _write(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_shard_mode_resolves_paths_against_the_list_and_keeps_urls(tmp_path):
    (tmp_path / "lists").mkdir()
    listing = read_data_list(_write(tmp_path / "lists/data.list", [
        "shards/a.tar", "", "/abs/b.tar", "s3://bucket/c.tar", "https://host/d.tar",
        "pipe:ssh host cat /data/e.tar"]))
    assert not listing.raw and listing.shards == [
        ShardLine(str(tmp_path / "lists/shards/a.tar"), f"{tmp_path}/lists/data.list:1"),
        ShardLine("/abs/b.tar", f"{tmp_path}/lists/data.list:3"),
        ShardLine("s3://bucket/c.tar", f"{tmp_path}/lists/data.list:4"),
        ShardLine("https://host/d.tar", f"{tmp_path}/lists/data.list:5"),
        ShardLine("pipe:ssh host cat /data/e.tar", f"{tmp_path}/lists/data.list:6")]


def test_raw_mode_entries_with_pieces_and_offsets_read_again(tmp_path):
    lines = [json.dumps({"key": "A/B/utt.1", "wav": "wav/a.wav", "txt": "今天"},
                        ensure_ascii=False),
             "",
             json.dumps({"key": "b", "wav": "/data/b.flac", "start": 1.5, "end": 3}),
             json.dumps({"key": "c", "wav": "c.opus", "txt": "好", "end": -1})]
    path = _write(tmp_path / "raw.list", lines)
    listing = read_data_list(path)
    assert listing.raw and listing.entries == [
        RawEntry("A/B/utt.1", str(tmp_path / "wav/a.wav"), "今天", 0.0, -1.0,
                 f"{path}:1", 0),
        RawEntry("b", "/data/b.flac", None, 1.5, 3.0, f"{path}:3",
                 len(lines[0].encode()) + 2),
        RawEntry("c", str(tmp_path / "c.opus"), "好", 0.0, -1.0, f"{path}:4",
                 sum(len(line.encode()) + 1 for line in lines[:3]))]
    again = read_raw_entries(path, listing.entries[1].offset, 2)
    assert [(e.key, e.wav, e.start, e.end) for e in again] == [
        (e.key, e.wav, e.start, e.end) for e in listing.entries[1:]]
    with pytest.raises(DataListError, match=r"raw.list ends before its entry 3 of 3"):
        read_raw_entries(path, listing.entries[1].offset, 3)


@pytest.mark.parametrize(("content", "message"), [
    (b'{"key": "a", "wav": "a.wav"\n', r"x.list:1: not JSON"),
    (b'{"wav": "a.wav"}\n', r"x.list:1: 'key' is missing"),
    (b'{"key": 3, "wav": "a.wav"}\n', r"x.list:1: key 3 is empty, not a string"),
    (b'{"key": "a", "wav": ""}\n', r"x.list:1: 'wav' is missing or not a string"),
    (b'{"key": "a", "wav": "a.wav", "txt": 5}\n', r"x.list:1: 'txt' is not a string"),
    (b'{"key": "a", "wav": "a.wav", "end": NaN}\n', r"x.list:1: 'end' is not a number"),
    (b'{"key": "a", "wav": "a.wav"}\n{"key": "a", "wav": "b.wav"}\n',
     r"x.list:2: key 'a' again \(first at .*x.list:1\)"),
    (b'a.tar\n{"key": "a", "wav": "a.wav"}\n', r"x.list:2: the list mixes shard paths and "
                                              r"raw JSON entries \(line 1 is shard-mode\)"),
    ("/数据/a.tar\n".encode("gbk"), r"x.list:1: not UTF-8"),
    (b"\n  \n", r"x.list: an empty data.list"),
])
def test_malformed_lists_are_errors_naming_file_and_line(tmp_path, content, message):
    (tmp_path / "x.list").write_bytes(content)
    with pytest.raises(DataListError, match=message):
        read_data_list(tmp_path / "x.list")
