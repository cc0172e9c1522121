"""WenetSpeech: prepare Kaldi data directories from `WenetSpeech.json`, streaming.

The real `WenetSpeech.json` is tens of GB, so it is parsed with ijson one `audios`
entry at a time; each selected set's lines are streamed to temporary files and only
sorted per set at the end. Output, under the output directory:
`{train_<subset>,dev,test_net,test_meeting}/{wav.scp,segments,text,utt2spk,spk2utt,prep.log}`
where wav.scp maps audio ids to absolute Opus paths, segments maps segment ids to
`<aid> <begin> <end>`, utt2spk maps segment ids to their audio id (the corpus has no
speaker labels) and text holds the transcript with whitespace removed.

Segments are skipped, counted and listed in each set's `prep.log` when their audio
file is missing (`missing_audio`), their times are invalid (`bad_time`: begin < 0 or
end <= begin), they end past the audio (`beyond_duration`), their text is empty
(`empty_text`) or carries a tag such as `<SIL>` or `<MUSIC>` (`tagged_text`).

Usage:
    python -m cat.data.wenetspeech prepare /data/wenetspeech data --train-subset M
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import IO, BinaryIO

import ijson

from cat.core.io import PathLike, atomic_write, iter_table, setup_logging
from cat.data.datadir import DataDirError, SkipReport, write_data_dir

logger = logging.getLogger(__name__)

JSON_NAME = "WenetSpeech.json"
# S within M within L are the strongly labelled training subsets; W is the weakly labelled one.
TRAIN_SUBSETS = ("S", "M", "L", "W")
EVAL_SUBSETS = ("DEV", "TEST_NET", "TEST_MEETING")
KNOWN_SUBSETS = frozenset(TRAIN_SUBSETS + EVAL_SUBSETS)
_TAG = re.compile(r"<[A-Za-z_]+>")
_TABLES = ("wav.scp", "segments", "text")


class WenetSpeechError(ValueError):
    """WenetSpeech.json is malformed; the message names the file and the audio or segment."""


@dataclass(frozen=True)
class Segment:
    """One entry of an audio's `segments`, with its fields checked."""

    sid: str
    begin: Decimal | int
    end: Decimal | int
    text: str
    subsets: tuple[str, ...]


def set_name(subset: str) -> str:
    """Output directory name of a subset tag: `train_m` for M, `test_net` for TEST_NET."""
    return f"train_{subset.lower()}" if subset in TRAIN_SUBSETS else subset.lower()


def iter_audios(stream: BinaryIO) -> Iterator[dict]:
    """Yield the entries of the top-level `audios` array one at a time, never the whole file.

    Numbers come back as `int` or `decimal.Decimal`, keeping their exact JSON text.
    """
    yield from ijson.items(stream, "audios.item")


def _seconds(value: Decimal | int) -> str:
    return str(value) if isinstance(value, int) else format(value, "f")


def _field(entry: Mapping, key: str, kind: type | tuple[type, ...], where: str) -> object:
    if key not in entry:
        raise WenetSpeechError(f"{where}: missing key {key!r}")
    value = entry[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WenetSpeechError(f"{where}: key {key!r} has the wrong type: {value!r}")
    return value


def _segment(entry: object, where: str) -> Segment:
    if not isinstance(entry, Mapping):
        raise WenetSpeechError(f"{where}: segment is not an object: {entry!r}")
    sid = _field(entry, "sid", str, where)
    where = f"{where} (sid {sid})"
    number = (int, Decimal)
    subsets = _field(entry, "subsets", list, where)
    unknown = sorted({str(tag) for tag in subsets} - KNOWN_SUBSETS)
    if unknown:
        raise WenetSpeechError(f"{where}: unknown subset tag(s) {unknown}; known: "
                               f"{sorted(KNOWN_SUBSETS)}")
    return Segment(sid, _field(entry, "begin_time", number, where),
                   _field(entry, "end_time", number, where),
                   _field(entry, "text", str, where), tuple(subsets))


def _skip_reason(segment: Segment, duration: Decimal | int, audio_exists: bool,
                 audio_path: str, max_overshoot: Decimal) -> tuple[str, str] | None:
    """`(reason, detail)` when the segment must be skipped, else None."""
    if not audio_exists:
        return "missing_audio", audio_path
    times = f"begin={_seconds(segment.begin)} end={_seconds(segment.end)}"
    if segment.begin < 0 or segment.end <= segment.begin:
        return "bad_time", times
    if segment.end > duration + max_overshoot:
        return "beyond_duration", f"{times} duration={_seconds(duration)}"
    if not "".join(segment.text.split()):
        return "empty_text", ""
    if _TAG.search(segment.text):
        return "tagged_text", "".join(segment.text.split())
    return None


@dataclass
class _Totals:
    audios: int = 0
    segments: int = 0


@dataclass
class _Selection:
    """What to extract and where to put it: subset tag -> set name, staging files, reports."""

    root: Path
    wanted: Mapping[str, str]
    staging: Mapping[str, Mapping[str, IO[str]]]
    reports: Mapping[str, SkipReport]
    max_overshoot: Decimal


def _add_audio(audio: object, where: str, selection: _Selection) -> int:
    """Stage the selected segments of one `audios` entry; returns its segment count."""
    if not isinstance(audio, Mapping):
        raise WenetSpeechError(f"{where}: not an object")
    aid = _field(audio, "aid", str, where)
    where = f"{where} (aid {aid})"
    audio_path = os.path.normpath(selection.root / _field(audio, "path", str, where))
    duration = _field(audio, "duration", (int, Decimal), where)
    segments = _field(audio, "segments", list, where)
    audio_exists: bool | None = None
    used: set[str] = set()
    for number, entry in enumerate(segments):
        segment = _segment(entry, f"{where} segments[{number}]")
        targets = dict.fromkeys(selection.wanted[tag] for tag in segment.subsets
                                if tag in selection.wanted)
        if not targets:
            continue
        if audio_exists is None:
            audio_exists = os.path.isfile(audio_path)  # one stat per audio, only when needed
        skip = _skip_reason(segment, duration, audio_exists, audio_path, selection.max_overshoot)
        for name in targets:
            if skip is not None:
                selection.reports[name].skip(skip[0], segment.sid, skip[1])
                continue
            files = selection.staging[name]
            files["segments"].write(f"{segment.sid} {aid} {_seconds(segment.begin)} "
                                    f"{_seconds(segment.end)}\n")
            files["text"].write(f"{segment.sid} {''.join(segment.text.split())}\n")
            selection.reports[name].kept += 1
            used.add(name)
    for name in used:
        selection.staging[name]["wav.scp"].write(f"{aid} {audio_path}\n")
    return len(segments)


def _stream_sets(json_path: Path, selection: _Selection) -> _Totals:
    """Parse the JSON once, appending each selected segment's lines to its sets' staging files."""
    totals = _Totals()
    with open(json_path, "rb") as f:
        try:
            for index, audio in enumerate(iter_audios(f)):
                totals.audios += 1
                totals.segments += _add_audio(audio, f"{json_path}: audios[{index}]", selection)
        except ijson.JSONError as error:
            raise WenetSpeechError(f"{json_path}: invalid JSON: {error}") from error
    if totals.audios == 0:
        raise WenetSpeechError(f"{json_path}: no entries under 'audios'")
    return totals


def prepare(
    root: PathLike,
    out_dir: PathLike,
    train_subset: str = "M",
    eval_subsets: Sequence[str] = EVAL_SUBSETS,
    max_overshoot: float = 0.0,
    json_path: PathLike | None = None,
) -> dict[str, SkipReport]:
    """Write Kaldi data directories for one training subset and the evaluation subsets.

    `root` is the release root (audio `path`s in the JSON are relative to it);
    `json_path` defaults to `root/WenetSpeech.json`. A segment tagged with several
    selected subsets goes to each of their directories. Segments ending more than
    `max_overshoot` seconds past their audio's duration are skipped. An unknown subset
    tag raises `WenetSpeechError` naming the segment id. Returns the report per set;
    `out_dir/prep.log` holds the summary.
    """
    if train_subset not in TRAIN_SUBSETS:
        raise WenetSpeechError(f"unknown training subset {train_subset!r}; "
                               f"choose one of {TRAIN_SUBSETS}")
    bad = [s for s in eval_subsets if s not in EVAL_SUBSETS]
    if bad:
        raise WenetSpeechError(f"unknown evaluation subset(s) {bad}; choose from {EVAL_SUBSETS}")
    root = Path(os.path.abspath(root))
    json_path = Path(json_path) if json_path is not None else root / JSON_NAME
    if not json_path.is_file():
        raise WenetSpeechError(f"{json_path}: no such file")
    wanted = {tag: set_name(tag) for tag in (train_subset, *eval_subsets)}
    reports = {name: SkipReport(name) for name in wanted.values()}
    out_dir = Path(out_dir)
    staging_dir = out_dir / f".wenetspeech.staging.{os.getpid()}"
    try:
        with contextlib.ExitStack() as stack:
            staging = {}
            for name in reports:
                (staging_dir / name).mkdir(parents=True, exist_ok=True)
                staging[name] = {table: stack.enter_context(
                    open(staging_dir / name / table, "w", encoding="utf-8")) for table in _TABLES}
            selection = _Selection(root, wanted, staging, reports, Decimal(str(max_overshoot)))
            totals = _stream_sets(json_path, selection)
        empty = [name for name, report in reports.items() if report.kept == 0]
        if empty:
            details = "; ".join(report.summary() for report in reports.values())
            raise WenetSpeechError(f"{json_path}: no usable segments for {empty} ({details})")
        for name, report in reports.items():
            _write_set(out_dir / name, staging_dir / name, report)
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    _write_summary(out_dir / "prep.log", json_path, totals, reports)
    return reports


def _write_set(data_dir: Path, staged: Path, report: SkipReport) -> None:
    """Sort one set's staged lines into a data directory (one table in memory at a time)."""
    write_data_dir(
        data_dir,
        wav_scp=iter_table(staged / "wav.scp"),
        text=iter_table(staged / "text"),
        utt2spk=((sid, value.split()[0]) for sid, value in iter_table(staged / "segments")),
        segments=iter_table(staged / "segments"),
        extra_files={"prep.log": report.log_text()},
    )


def _write_summary(path: Path, json_path: Path, totals: _Totals,
                   reports: Mapping[str, SkipReport]) -> None:
    lines = [f"# WenetSpeech preparation from {json_path}",
             f"# audios: {totals.audios}, segments: {totals.segments}"]
    for report in reports.values():
        lines.append(f"# {report.summary()}")
        logger.log(logging.WARNING if report.skipped else logging.INFO, "%s", report.summary())
    with atomic_write(path) as f:
        f.write("\n".join(lines) + "\n")
    logger.info("skipped segments are listed in each set's prep.log under %s", path.parent)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m cat.data.wenetspeech", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write Kaldi data directories")
    prep.add_argument("root", help="release root holding WenetSpeech.json and audio/")
    prep.add_argument("out_dir", help="output directory for the set directories")
    prep.add_argument("--train-subset", default="M", choices=TRAIN_SUBSETS,
                      help="training subset (default %(default)s)")
    prep.add_argument("--eval-subsets", nargs="*", default=list(EVAL_SUBSETS),
                      choices=EVAL_SUBSETS, help="evaluation subsets (default: all)")
    prep.add_argument("--max-overshoot", type=float, default=0.0,
                      help="seconds a segment may end past its audio (default %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        prepare(args.root, args.out_dir, args.train_subset, args.eval_subsets,
                args.max_overshoot)
    except (WenetSpeechError, DataDirError) as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
