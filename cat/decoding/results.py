"""Decoding results as data: one `Result` per utterance, written as text, JSON lines, Kaldi
CTM or SRT subtitles (`--format` of `python -m cat.decode`).

* `text`: `<key> <text>` lines (an empty hypothesis is the key alone), what `hyp` holds;
* `json`: a JSON object per line: `key`, `text`, `tokens` (the tokenizer's pieces), with
  times `timestamps` (`[start, end]` seconds per token) and `words` (`word`, `start`,
  `end`, `confidence`), and with a beam search `nbest` (`text`, `score`: the search's log
  score, best first);
* `ctm`: Kaldi's CTM, a line per word: `<key> 1 <start> <duration> <word> <confidence>`
  (seconds from the utterance's start, channel 1);
* `srt`: SubRip subtitles of an utterance (`srt_document`): cues of consecutive words,
  a new cue after a pause of `CUE_PAUSE` seconds or when a cue would last more than
  `CUE_SECONDS` or hold more than `CUE_CHARACTERS` characters; cues numbered from 1,
  `HH:MM:SS,mmm --> HH:MM:SS,mmm`.

Words are those of `cat.decoding.timestamps.group_words` (a CJK character is a word);
confidence is the probability of a word's least certain token on its best frame.

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

FORMATS = ("text", "json", "ctm", "srt")
#: The file each format writes into an output directory besides `hyp` (srt: a folder of
#: `<key>.srt` files, the key percent-encoded).
FORMAT_FILES = {"json": "hyp.jsonl", "ctm": "hyp.ctm", "srt": "srt"}
CUE_PAUSE = 0.8
CUE_SECONDS = 7.0
CUE_CHARACTERS = 32


class ResultFormatError(ValueError):
    """A format that does not exist, or results that cannot be written in it."""


def check_format(name: str) -> str:
    """`name` if it is one of `FORMATS`, else a ResultFormatError naming them."""
    if name not in FORMATS:
        raise ResultFormatError(f"unknown output format {name!r}; allowed: "
                                f"{', '.join(FORMATS)}")
    return name


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


#: Tokens of two overlapping windows are the same token when they start this close (s).
SAME_TOKEN_SECONDS = 0.25


def _seam(left: list[tuple[TimedUnit, int]], right: list[tuple[TimedUnit, int]],
          start: float, end: float) -> list[tuple[TimedUnit, int]]:
    """`left` (the tokens so far) up to the seam, and `right` (the next window's) from it:
    of the tokens both have in the overlap `start`..`end` (equal ids starting within
    `SAME_TOKEN_SECONDS`, matched in order by `difflib`), the pair nearest the middle of
    the overlap, taken from `right`; without such a pair, the middle itself."""
    middle = (start + end) / 2
    ours = [index for index, (unit, _) in enumerate(left) if unit.start >= start]
    theirs = [index for index, (unit, _) in enumerate(right) if unit.start < end]
    matcher = difflib.SequenceMatcher(None, [left[i][1] for i in ours],
                                      [right[j][1] for j in theirs], autojunk=False)
    best: tuple[float, int, int] | None = None
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            i, j = ours[block.a + offset], theirs[block.b + offset]
            a, b = left[i][0].start, right[j][0].start
            if abs(a - b) <= SAME_TOKEN_SECONDS and (
                    best is None or abs((a + b) / 2 - middle) < best[0]):
                best = (abs((a + b) / 2 - middle), i, j)
    if best is not None:
        return left[:best[1]] + right[best[2]:]
    return ([token for token in left if token[0].start < middle]
            + [token for token in right if token[0].start >= middle])


def join_windows(key: str, windows: Sequence[tuple[float, Result]], overlap: float,
                 decode: Callable[[list[int]], str]) -> Result:
    """One result of the timed results of an utterance's windows ((start in the utterance,
    result), in order, each overlapping the next by `overlap` seconds): each seam is cut
    at a token both windows hold near the middle of their overlap (`_seam`), so that no
    word is repeated or lost, and a token before a seam ends where the next one starts;
    its text is `decode` of the joined token ids. N-best lists are not joined."""
    tokens: list[tuple[TimedUnit, int]] = []
    for index, (start, result) in enumerate(windows):
        if result.times is None:
            raise ResultFormatError(f"utterance {key}: window {index} has no times to join by")
        timed = list(zip(result.shifted(start).times, result.ids, strict=True))
        tokens = _seam(tokens, timed, start, start + overlap) if index else timed
    ids = [token_id for _, token_id in tokens]
    units = [unit for unit, _ in tokens]
    # A token before a seam ends where the next window's first token starts.
    units = [dataclasses.replace(unit, end=min(unit.end, following.start))
             for unit, following in itertools.pairwise(units)] + units[-1:]
    return Result(key, decode(ids), tuple(unit.text for unit in units), tuple(units), None,
                  tuple(ids))


def json_record(result: Result) -> dict[str, Any]:
    """The JSON object of `result` (see the module doc)."""
    record: dict[str, Any] = {"key": result.key, "text": result.text,
                              "tokens": list(result.pieces)}
    if result.times is not None:
        record["timestamps"] = [[unit.start, unit.end] for unit in result.times]
        record["words"] = [{"word": word.text, "start": word.start, "end": word.end,
                            "confidence": round(word.confidence, 4)}
                           for word in result.words()]
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
    """The SubRip subtitles of one utterance (empty without words)."""
    blocks = [f"{number}\n{_clock(start)} --> {_clock(end)}\n{text}\n"
              for number, (start, end, text) in enumerate(subtitle_cues(result.words()), 1)]
    return "\n".join(blocks)


def format_lines(results: Iterable[Result], name: str) -> Iterator[str]:
    """The lines of `results` in format `name` (text, json or ctm; srt is a document per
    utterance: `srt_document`)."""
    check_format(name)
    if name == "srt":
        raise ResultFormatError("srt is a document per utterance, not lines")
    for result in results:
        if name == "text":
            yield f"{result.key} {result.text}" if result.text else result.key
        elif name == "json":
            yield json.dumps(json_record(result), ensure_ascii=False)
        else:
            yield from ctm_lines(result)


def srt_path(out_dir: PathLike, key: str) -> Path:
    """Where `write_results` puts the subtitles of utterance `key`."""
    return Path(out_dir) / FORMAT_FILES["srt"] / f"{urllib.parse.quote(key, safe='')}.srt"


def write_results(out_dir: PathLike, results: Sequence[Result], name: str) -> list[Path]:
    """Into `out_dir`, `results` (sorted by key) in format `name` besides the `hyp` the
    caller writes: `hyp.jsonl`, `hyp.ctm` or `srt/<key>.srt` (nothing for text); returns the
    paths written."""
    check_format(name)
    ordered = sorted(results, key=lambda result: result.key)
    if name == "text":
        return []
    if name == "srt":
        paths = []
        for result in ordered:
            path = srt_path(out_dir, result.key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path) as f:
                f.write(srt_document(result))
            paths.append(path)
        return paths
    path = Path(out_dir) / FORMAT_FILES[name]
    with atomic_write(path) as f:
        for line in format_lines(ordered, name):
            f.write(line + "\n")
    return [path]
