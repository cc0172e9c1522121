"""Decoding results as data: one `Result` per utterance, written as text, JSON lines, Kaldi
CTM or SRT subtitles (`--format` of `python -m cat.decode`).

* `text`: `<key> <text>` lines (an empty hypothesis is the key alone), what `hyp` holds;
* `json`: a JSON object per line: `key`, `text`, `tokens` (the tokenizer's pieces), with
  times `timestamps` (`[start, end]` seconds per token) and `words` (`word`, `start`,
  `end`, `confidence`), for a long recording cut into voice-activity segments
  `segments` (`start`, `end`: where its speech starts and ends; `text`), and with a beam
  search `nbest` (`text`, `score`: the search's log score, best first);
* `ctm`: Kaldi's CTM, a line per word: `<key> 1 <start> <duration> <word> <confidence>`
  (seconds from the utterance's start, channel 1: a long recording's words at their
  times in the recording, whatever segment they were decoded in);
* `srt`: SubRip subtitles of an utterance (`srt_document`): a cue per segment with text
  for a recording cut into segments, else cues of consecutive words, a new cue after a
  pause of `CUE_PAUSE` seconds or when a cue would last more than `CUE_SECONDS` or hold
  more than `CUE_CHARACTERS` characters; cues numbered from 1,
  `HH:MM:SS,mmm --> HH:MM:SS,mmm`.

Words are those of `cat.decoding.timestamps.group_words` (a CJK character is a word);
confidence is the probability of a word's least certain token on its best frame. The
stretches of a long recording decoded alone are joined by `join_parts`.

A format is an entry of `WRITERS` (name -> `Writer`): the function that writes a result
(its lines, or its document) and the file the format writes besides `hyp`; a new format is
one entry and its function.

Usage:
    for line in format_lines(results, "ctm"): print(line)
    write_results("exp/x/decode/test", results, "json")  # hyp and hyp.jsonl
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cat.core.io import PathLike, atomic_write
from cat.decoding.timestamps import TimedUnit, group_words

CUE_PAUSE = 0.8
CUE_SECONDS = 7.0
CUE_CHARACTERS = 32


class ResultFormatError(ValueError):
    """A format that does not exist, or results that cannot be written in it."""


def check_format(name: str) -> str:
    """`name` if it is one of `FORMATS`, else a ResultFormatError naming them."""
    if name not in WRITERS:
        raise ResultFormatError(f"unknown output format {name!r}; allowed: "
                                f"{', '.join(WRITERS)}")
    return name


def needs_times(name: str) -> bool:
    """Whether results in format `name` are decoded with times, pieces and N-best."""
    return WRITERS[check_format(name)].timed


@dataclasses.dataclass(frozen=True)
class Result:
    """One utterance's hypothesis: `text`, its `pieces`, the pieces' times (None when not
    computed) and the search's N-best list ((text, score) pairs; None for greedy)."""

    key: str
    text: str
    pieces: tuple[str, ...] = ()
    times: tuple[TimedUnit, ...] | None = None
    nbest: tuple[tuple[str, float], ...] | None = None
    ids: tuple[int, ...] = ()  # the pieces' token ids (not written)
    segments: tuple[Segment, ...] | None = None  # of a long recording cut at pauses

    def words(self) -> list[TimedUnit]:
        """The timed words (`group_words`); a ResultFormatError without times."""
        if self.times is None:
            raise ResultFormatError(f"utterance {self.key}: no times were computed")
        return group_words(self.times)

    def shifted(self, seconds: float) -> Result:
        """The same result with its times `seconds` later."""
        if self.times is None:
            return self
        return dataclasses.replace(self, times=tuple(
            dataclasses.replace(unit, start=round(unit.start + seconds, 3),
                                end=round(unit.end + seconds, 3)) for unit in self.times))


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of a long recording decoded alone (`cat.decoding.segments`): where its
    speech starts and ends (seconds from the recording's start) and the text found in it."""

    start: float
    end: float
    text: str


@dataclasses.dataclass(frozen=True)
class Part:
    """The timed result of a stretch of an utterance: `start` (seconds in the utterance),
    `overlap` (seconds it shares with the part before: 0 where a pause separates them),
    and the segment it belongs to (`segment`, its speech span `speech`; None when the
    parts are windows of `--vad none`)."""

    start: float
    overlap: float
    result: Result
    segment: int | None = None
    speech: tuple[float, float] | None = None


#: A token only one of two overlapping windows has is kept unless it lies this close to
#: that window's edge (seconds; a quarter of the overlap at most), where a window hears
#: part of a word.
EDGE_SECONDS = 0.2

#: A token: its times, its id and the number of the segment it was decoded in.
Token = tuple[TimedUnit, int, int | None]


def merge_overlap(left: Sequence[Token], right: Sequence[Token], start: float, end: float
                  ) -> list[Token]:
    """The tokens of two windows overlapping from `start` to `end` seconds, each given
    the tokens it has there (`left`: the earlier window's, `right`: the later one's), as
    one sequence: aligned by token (`difflib`), a token both have is taken from the window
    that hears more around it (the earlier one before the middle of the overlap, the later
    one after); where they differ, the earlier window's tokens before the middle and the
    later one's after it; a token only one window has is kept (a window near its edge
    drops a word more often than it makes one up) unless it lies within `EDGE_SECONDS`
    of that window's own edge."""
    middle = (start + end) / 2
    edge = min(EDGE_SECONDS, (end - start) / 4)
    matcher = difflib.SequenceMatcher(None, [token for _, token, _ in left],
                                      [token for _, token, _ in right], autojunk=False)
    merged: list[Token] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        ours, theirs = left[i1:i2], right[j1:j2]
        if tag == "equal":
            merged += [a if (a[0].start + b[0].start) / 2 < middle else b
                       for a, b in zip(ours, theirs, strict=True)]
        elif ours and theirs:
            merged += [token for token in ours if token[0].start < middle]
            merged += [token for token in theirs if token[0].start >= middle]
        else:
            merged += [token for token in ours if end - token[0].start >= edge]
            merged += [token for token in theirs if token[0].start - start >= edge]
    return merged


def join_parts(key: str, parts: Sequence[Part], decode: Callable[[list[int]], str]) -> Result:
    """One result of the timed results of an utterance's parts, in order: where parts
    overlap, their tokens are merged (`merge_overlap`), each token taken from one of
    them, so that no token is repeated or lost; parts separated by a pause follow each
    other. A token before a
    seam ends where the next one starts; the text is `decode` of the joined token ids, and
    `segments` the text of each segment (when the parts have them). N-best lists are
    not joined."""
    tokens: list[Token] = []
    for index, part in enumerate(parts):
        if part.result.times is None:
            raise ResultFormatError(f"utterance {key}: part {index} has no times to join by")
        timed: list[Token] = [(unit, token, part.segment) for unit, token in zip(
            part.result.shifted(part.start).times, part.result.ids, strict=True)]
        if index and part.overlap > 0:
            end = part.start + part.overlap
            before = [token for token in tokens if token[0].start < part.start]
            after = [token for token in timed if token[0].start >= end]
            timed = before + merge_overlap(
                [token for token in tokens if token[0].start >= part.start],
                [token for token in timed if token[0].start < end], part.start, end) + after
            tokens = []
        tokens += timed
    ids = [token_id for _, token_id, _ in tokens]
    units: list[TimedUnit] = []
    for unit, _, _ in tokens:  # times never decrease where windows placed a token apart
        start = max(unit.start, units[-1].start) if units else unit.start
        units.append(dataclasses.replace(unit, start=start, end=max(unit.end, start)))
    # A token before a seam ends where the next part's first token starts.
    units = [dataclasses.replace(unit, end=min(unit.end, following.start))
             for unit, following in itertools.pairwise(units)] + units[-1:]
    segments = None
    if parts and all(part.segment is not None for part in parts):
        # A recording without speech has one part without speech: no segment.
        spans = {part.segment: part.speech for part in parts if part.speech is not None}
        segments = tuple(Segment(round(spans[number][0], 3), round(spans[number][1], 3),
                                 decode([token for _, token, segment in tokens
                                         if segment == number]))
                         for number in sorted(spans))
    return Result(key, decode(ids), tuple(unit.text for unit in units), tuple(units), None,
                  tuple(ids), segments)


def join_windows(key: str, windows: Sequence[tuple[float, Result]], overlap: float,
                 decode: Callable[[list[int]], str]) -> Result:
    """`join_parts` of windows ((start in the utterance, result), in order) each
    overlapping the next by `overlap` seconds."""
    return join_parts(key, [Part(start, overlap if index else 0.0, result)
                            for index, (start, result) in enumerate(windows)], decode)


def text_lines(result: Result) -> Iterator[str]:
    """The `hyp` line of `result`: `<key> <text>`, the key alone for an empty text."""
    yield f"{result.key} {result.text}" if result.text else result.key


def json_lines(result: Result) -> Iterator[str]:
    """The JSON line of `result` (`json_record`)."""
    yield json.dumps(json_record(result), ensure_ascii=False)


def json_record(result: Result) -> dict[str, Any]:
    """The JSON object of `result` (see the module doc)."""
    record: dict[str, Any] = {"key": result.key, "text": result.text,
                              "tokens": list(result.pieces)}
    if result.times is not None:
        record["timestamps"] = [[unit.start, unit.end] for unit in result.times]
        record["words"] = [{"word": word.text, "start": word.start, "end": word.end,
                            "confidence": round(word.confidence, 4)}
                           for word in result.words()]
    if result.segments is not None:
        record["segments"] = [{"start": segment.start, "end": segment.end,
                               "text": segment.text} for segment in result.segments]
    if result.nbest is not None:
        record["nbest"] = [{"text": text, "score": round(score, 4)}
                           for text, score in result.nbest]
    return record


def ctm_lines(result: Result) -> Iterator[str]:
    """The CTM lines of `result`'s words."""
    for word in result.words():
        yield (f"{result.key} 1 {word.start:.3f} {max(word.end - word.start, 0.0):.3f} "
               f"{word.text} {word.confidence:.4f}")


def _clock(seconds: float) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d},{millis % 1000:03d}"


def _join(words: Sequence[TimedUnit]) -> str:
    text = ""
    for word in words:
        cjk_pair = text and (ord(text[-1]) > 0x2E80 and ord(word.text[0]) > 0x2E80)
        text += word.text if not text or cjk_pair else " " + word.text
    return text


def subtitle_cues(words: Sequence[TimedUnit]) -> list[tuple[float, float, str]]:
    """(start, end, text) of the subtitle cues of `words` (see the module doc)."""
    cues: list[list[TimedUnit]] = []
    for word in words:
        current = cues[-1] if cues else None
        if (current is None or word.start - current[-1].end > CUE_PAUSE
                or word.end - current[0].start > CUE_SECONDS
                or len(_join([*current, word])) > CUE_CHARACTERS):
            cues.append([word])
        else:
            current.append(word)
    return [(cue[0].start, max(cue[-1].end, cue[0].start + 0.001), _join(cue))
            for cue in cues]


def srt_document(result: Result) -> str:
    """The SubRip subtitles of one utterance (empty without words): a cue per segment
    with text when it was cut into segments, else `subtitle_cues` of its words."""
    if result.segments is not None:
        cues = [(segment.start, max(segment.end, segment.start + 0.001), segment.text)
                for segment in result.segments if segment.text]
    else:
        cues = subtitle_cues(result.words())
    blocks = [f"{number}\n{_clock(start)} --> {_clock(end)}\n{text}\n"
              for number, (start, end, text) in enumerate(cues, 1)]
    return "\n".join(blocks)


@dataclasses.dataclass(frozen=True)
class Writer:
    """How results are written in one format: `lines` (a result's lines, all results' in
    one file) or `document` (a result's document, a file per utterance in a folder); `file`,
    the file or folder besides `hyp` in an output directory (None: `hyp` holds the format);
    `timed`, whether the results need times, pieces and N-best; `help`, what it holds (for
    `--format`'s help)."""

    file: str | None
    lines: Callable[[Result], Iterable[str]] | None = None
    document: Callable[[Result], str] | None = None
    timed: bool = True
    help: str = ""


#: The output formats, by name (`--format`); srt's folder holds `<key>.srt` files, the key
#: percent-encoded (`document_path`).
WRITERS: dict[str, Writer] = {
    "text": Writer(None, lines=text_lines, timed=False, help="text lines"),
    "json": Writer("hyp.jsonl", lines=json_lines, help="JSON lines with tokens, times and N-best"),
    "ctm": Writer("hyp.ctm", lines=ctm_lines, help="Kaldi CTM"),
    "srt": Writer("srt", document=srt_document, help="SRT subtitles"),
}
FORMATS = tuple(WRITERS)


def format_lines(results: Iterable[Result], name: str) -> Iterator[str]:
    """The lines of `results` in format `name` (one whose writer writes lines; srt is a
    document per utterance: `srt_document`)."""
    writer = WRITERS[check_format(name)]
    if writer.lines is None:
        raise ResultFormatError(f"{name} is a document per utterance, not lines")
    for result in results:
        yield from writer.lines(result)


def document_path(out_dir: PathLike, name: str, key: str) -> Path:
    """Where `write_results` puts the document of utterance `key` in format `name` (one
    whose writer writes a document per utterance, into its folder)."""
    folder = WRITERS[check_format(name)].file
    if folder is None:
        raise ResultFormatError(f"{name} writes no file besides hyp")
    return Path(out_dir) / folder / f"{urllib.parse.quote(key, safe='')}.{name}"


def formats_help() -> str:
    """What each format holds and, with an output directory, where it goes (`--format`)."""
    return "; ".join(
        f"{name}: {writer.help}"
        + ("" if writer.file is None else
           f" ({writer.file}{'/<key>.' + name if writer.document else ''} besides hyp)")
        for name, writer in WRITERS.items())


def write_results(out_dir: PathLike, results: Sequence[Result], name: str) -> list[Path]:
    """Into `out_dir`, `results` (sorted by key) in format `name` besides the `hyp` the
    caller writes: `hyp.jsonl`, `hyp.ctm` or `srt/<key>.srt` (nothing for text); returns the
    paths written."""
    writer = WRITERS[check_format(name)]
    ordered = sorted(results, key=lambda result: result.key)
    if writer.file is None:
        return []
    if writer.document is not None:
        paths = []
        for result in ordered:
            path = document_path(out_dir, name, result.key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path) as f:
                f.write(writer.document(result))
            paths.append(path)
        return paths
    path = Path(out_dir) / writer.file
    with atomic_write(path) as f:
        for line in format_lines(ordered, name):
            f.write(line + "\n")
    return [path]
