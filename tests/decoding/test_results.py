"""Results as data: each format read back with a standard reader (the json module, CTM's
columns, SRT's cue grammar)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest

from cat.decoding.results import (
    WRITERS,
    Part,
    Result,
    ResultFormatError,
    Segment,
    Writer,
    check_format,
    document_path,
    format_lines,
    join_parts,
    join_windows,
    json_record,
    needs_times,
    srt_document,
    write_results,
)
from cat.decoding.timestamps import TimedUnit

#: One SubRip cue: number, times, one or more lines of text.
SRT_CUE = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})\n"
                     r"((?:.+\n)+)")


def timed(key: str, pieces: list[str], starts: list[float], length: float = 0.08) -> Result:
    times = tuple(TimedUnit(piece, start, round(start + length, 3), 0.9)
                  for piece, start in zip(pieces, starts, strict=True))
    text = "".join(pieces).replace("\u2581", " ").strip()
    return Result(key, text, tuple(pieces), times, ((text, -0.5), ("x", -3.0)))


RESULTS = [
    timed("utt-b", ["今", "天", "好"], [0.2, 0.5, 0.9]),
    timed("utt-a", ["\u2581hel", "lo", "\u2581wor", "ld"], [0.1, 0.3, 1.2, 1.4]),
    Result("utt-empty", "", (), (), None),
]


def parse_srt(text: str) -> list[tuple[int, float, float, str]]:
    """(number, start, end, text) of each cue; the whole document must be cues."""
    cues, position = [], 0
    for match in SRT_CUE.finditer(text):
        assert match.start() == position, text[position:match.start()]
        values = [int(group) for group in match.groups()[:9]]
        start = values[1] * 3600 + values[2] * 60 + values[3] + values[4] / 1000
        end = values[5] * 3600 + values[6] * 60 + values[7] + values[8] / 1000
        cues.append((values[0], start, end, match.group(10).strip()))
        position = match.end() + (1 if text[match.end():match.end() + 1] == "\n" else 0)
    assert position == len(text)
    return cues


def test_json_lines_parse_with_the_json_module():
    lines = list(format_lines(RESULTS, "json"))
    records = [json.loads(line) for line in lines]
    assert [record["key"] for record in records] == ["utt-b", "utt-a", "utt-empty"]
    first = records[0]
    assert first["text"] == "今天好" and first["tokens"] == ["今", "天", "好"]
    assert first["timestamps"] == [[0.2, 0.28], [0.5, 0.58], [0.9, 0.98]]
    assert [word["word"] for word in first["words"]] == ["今", "天", "好"]
    assert first["nbest"] == [{"text": "今天好", "score": -0.5}, {"text": "x", "score": -3.0}]
    # SentencePiece pieces join into their words, spanning them.
    assert [(w["word"], w["start"], w["end"]) for w in records[1]["words"]] == [
        ("hello", 0.1, 0.38), ("world", 1.2, 1.48)]
    assert records[2] == {"key": "utt-empty", "text": "", "tokens": [], "timestamps": [],
                          "words": []}
    # Without times or N-best (greedy text results), only what is known.
    assert json.loads(next(format_lines([Result("k", "t", ("t",))], "json"))) == {
        "key": "k", "text": "t", "tokens": ["t"]}


def test_ctm_has_kaldis_columns():
    lines = list(format_lines(RESULTS, "ctm"))
    assert len(lines) == 5  # 3 + 2 words, none for the empty hypothesis
    for line in lines:
        key, channel, start, duration, word, confidence = line.split(" ")
        assert key in ("utt-a", "utt-b") and channel == "1" and word
        assert float(start) >= 0 and float(duration) > 0 and 0 <= float(confidence) <= 1
    assert lines[3].split()[:5] == ["utt-a", "1", "0.100", "0.280", "hello"]


def test_srt_cues_parse_and_follow_each_other():
    words = [f"\u2581w{index}" for index in range(12)]
    starts = [0.2 * index for index in range(6)] + [5.0 + 0.3 * index for index in range(6)]
    result = timed("long", words, starts, length=0.15)
    cues = parse_srt(srt_document(result))
    # The pause of more than CUE_PAUSE seconds after w5 starts a new cue.
    assert [cue[0] for cue in cues] == [1, 2]
    assert cues[0][1:] == (0.0, 1.15, "w0 w1 w2 w3 w4 w5")
    assert cues[1][1:] == (5.0, 6.65, "w6 w7 w8 w9 w10 w11")
    assert all(start < end for _, start, end, _ in cues)
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(cues))
    # CJK characters are joined without spaces.
    assert parse_srt(srt_document(RESULTS[0]))[0][3] == "今天好"
    assert srt_document(RESULTS[2]) == ""


def test_written_files_and_their_readers(tmp_path):
    assert write_results(tmp_path, RESULTS, "text") == []
    (jsonl,) = write_results(tmp_path, RESULTS, "json")
    assert [json.loads(line)["key"] for line in jsonl.read_text().splitlines()] == [
        "utt-a", "utt-b", "utt-empty"]  # sorted by key, as hyp
    (ctm,) = write_results(tmp_path, RESULTS, "ctm")
    assert ctm.name == "hyp.ctm" and len(ctm.read_text().splitlines()) == 5
    paths = write_results(tmp_path, [*RESULTS, timed("A/B.1", ["x"], [0.0])], "srt")
    assert document_path(tmp_path, "srt", "A/B.1") == tmp_path / "srt" / "A%2FB.1.srt"
    assert document_path(tmp_path, "srt", "A/B.1") in paths
    assert parse_srt(document_path(tmp_path, "srt", "utt-b").read_text())[0][1:3] == (0.2, 0.98)


def test_a_new_format_is_one_entry_and_its_function(tmp_path, monkeypatch):
    """Lines or a document per utterance: the writer's entry is all the format needs."""
    monkeypatch.setitem(WRITERS, "tsv", Writer("hyp.tsv", lines=lambda result: [
        f"{result.key}\t{word.text}" for word in result.words()]))
    monkeypatch.setitem(WRITERS, "txt", Writer("txt", document=lambda result: result.text,
                                               timed=False))
    assert list(format_lines(RESULTS[:2], "tsv")) == [
        "utt-b\t今", "utt-b\t天", "utt-b\t好", "utt-a\thello", "utt-a\tworld"]
    (tsv,) = write_results(tmp_path, RESULTS, "tsv")
    assert tsv == tmp_path / "hyp.tsv" and tsv.read_text().splitlines()[0] == "utt-a\thello"
    assert write_results(tmp_path, RESULTS[:2], "txt") == [
        tmp_path / "txt" / "utt-a.txt", tmp_path / "txt" / "utt-b.txt"]
    assert (tmp_path / "txt" / "utt-b.txt").read_text() == "今天好"
    assert [needs_times(name) for name in ("text", "json", "ctm", "srt", "tsv", "txt")] == [
        False, True, True, True, True, False]
    with pytest.raises(ResultFormatError, match="txt is a document per utterance, not lines"):
        list(format_lines(RESULTS, "txt"))


def test_bad_formats_and_missing_times_are_named():
    with pytest.raises(ResultFormatError, match="unknown output format 'xml'; allowed: "
                                                "text, json, ctm, srt"):
        check_format("xml")
    with pytest.raises(ResultFormatError, match="utterance k: no times were computed"):
        list(format_lines([Result("k", "t", ("t",))], "ctm"))


def test_shifted_moves_times_only():
    result = RESULTS[0].shifted(10.0)
    assert [unit.start for unit in result.times] == [10.2, 10.5, 10.9]
    assert (result.key, result.text, result.nbest) == (RESULTS[0].key, RESULTS[0].text,
                                                       RESULTS[0].nbest)


def window_result(tokens: list[tuple[int, float]], vocab: str = "_abcdefghij") -> Result:
    """A window's result: (token id, start in the window) pairs, 0.2 s each at most."""
    times = []
    for index, (token, start) in enumerate(tokens):
        following = tokens[index + 1][1] if index + 1 < len(tokens) else start + 0.2
        times.append(TimedUnit(vocab[token], start, min(start + 0.2, following), 0.9))
    return Result("long", "", tuple(unit.text for unit in times), tuple(times), None,
                  tuple(token for token, _ in tokens))


def spoken(ids: list[int], starts: list[float], window: tuple[float, float],
           jitter: float = 0.0) -> Result:
    """What a window from window[0] to window[1] hears of tokens spoken at `starts`."""
    return window_result([(token, start - window[0] + jitter)
                          for token, start in zip(ids, starts, strict=True)
                          if window[0] <= start < window[1]])


def decode(ids: list[int]) -> str:
    return "".join("_abcdefghij"[token] for token in ids)


def test_windows_join_without_repeated_or_lost_tokens():
    ids = [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 1]
    starts = [round(0.4 * index, 1) for index in range(len(ids))]  # up to 4.4 s
    # Windows of 2 s overlapping by 0.8 s: 0-2, 1.2-3.2, 2.4-4.4, 3.6-5.6; tokens start
    # at the middle of each overlap (1.6, 2.8, 4.0 s), where a cut by time alone loses
    # or repeats them when the windows place them a little apart.
    windows = [(0.0, (0.0, 2.0)), (1.2, (1.2, 3.2)), (2.4, (2.4, 4.4)), (3.6, (3.6, 5.6))]
    for jitter in (0.0, 0.08, -0.08):  # the windows place the tokens a little apart
        parts = [(start, spoken(ids, starts, span, jitter if index % 2 else 0.0))
                 for index, (start, span) in enumerate(windows)]
        joined = join_windows("long", parts, 0.8, decode)
        assert list(joined.ids) == ids and joined.text == decode(ids), jitter
        assert [unit.start for unit in joined.times] == sorted(unit.start
                                                             for unit in joined.times)
    # Windows that disagree after a shared token: the right one's tokens from it on.
    left = window_result([(1, 0.2), (2, 1.5), (3, 1.9)])
    right = window_result([(2, 0.3), (4, 0.75)])  # b at 1.5 s, d at 1.95 s
    joined = join_windows("long", [(0.0, left), (1.2, right)], 0.8, decode)
    assert decode(list(joined.ids)) == "abd"  # cut at the shared token b (1.5 s)
    # Nothing shared in the overlap: cut at its middle (1.6 s).
    right = window_result([(5, 0.1), (6, 0.6)])  # 1.3 s and 1.8 s
    joined = join_windows("long", [(0.0, left), (1.2, right)], 0.8, decode)
    assert decode(list(joined.ids)) == "abf"
    with pytest.raises(ResultFormatError, match="utterance long: part 1 has no times"):
        join_windows("long", [(0.0, left), (1.2, Result("long", "x"))], 0.8, decode)


def test_a_token_one_window_drops_is_kept_and_one_made_up_at_an_edge_is_not():
    # Windows 0-6 s and 4-10 s: the earlier drops c (4.9 s), 1.1 s from its edge, as
    # a window that hears part of the next word does; the later makes up j at 4.1 s,
    # where it hears the end of a word. Their seam (the middle, 5 s) falls in a pause.
    left = window_result([(1, 3.5), (2, 4.3), (4, 5.0), (5, 5.9)])
    right = window_result([(9, 0.1), (2, 0.32), (3, 0.9), (4, 1.0), (5, 1.88), (6, 2.5)])
    joined = join_windows("long", [(0.0, left), (4.0, right)], 2.0, decode)
    assert decode(list(joined.ids)) == "abcdef"
    assert [unit.start for unit in joined.times] == [3.5, 4.3, 4.9, 5.0, 5.88, 6.5]


def test_segments_join_with_their_times_and_make_one_cue_each():
    """Segments cut in pauses follow each other; a segment decoded in two windows is one
    segment; the JSON lists them and the subtitles have a cue per segment with text."""
    parts = [Part(0.7, 0.0, window_result([(1, 0.3), (2, 0.6)]), 0, (1.0, 1.8)),
             Part(2.4, 0.0, window_result([]), 1, (2.6, 3.0)),  # music: no text
             Part(3.1, 0.0, window_result([(3, 0.2), (4, 1.5)]), 2, (3.3, 6.9)),
             Part(5.1, 0.5, window_result([(4, 0.0), (5, 1.0)]), 2, (3.3, 6.9))]
    joined = join_parts("long", parts, decode)
    assert joined.text == "abcde"
    assert [unit.start for unit in joined.times] == [1.0, 1.3, 3.3, 4.6, 6.1]
    assert joined.segments == (Segment(1.0, 1.8, "ab"), Segment(2.6, 3.0, ""),
                               Segment(3.3, 6.9, "cde"))
    record = json.loads(next(format_lines([joined], "json")))
    assert record["segments"] == [{"start": 1.0, "end": 1.8, "text": "ab"},
                                  {"start": 2.6, "end": 3.0, "text": ""},
                                  {"start": 3.3, "end": 6.9, "text": "cde"}]
    assert parse_srt(srt_document(joined)) == [(1, 1.0, 1.8, "ab"), (2, 3.3, 6.9, "cde")]
    # Windows without segments (--vad none): no segments, cues of words.
    windows = join_parts("long", [dataclasses.replace(part, segment=None, speech=None)
                                  for part in parts], decode)
    assert windows.segments is None and "segments" not in json_record(windows)
