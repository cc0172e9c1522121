"""Kaldi data directories: write them whole, derive spk2utt, and validate them.

A data directory holds `wav.scp`, `text`, `utt2spk`, `spk2utt` and optionally
`segments`, `feats.scp` and `utt2num_frames`, each sorted in byte order with
unique keys. The validator streams every table (sorted tables are compared by
merging, never loaded whole), so it also runs on directories with millions of
utterances, and it reports every problem it finds (up to a cap) at once.

Usage:
    python -m cat.data.datadir validate data/train
    python -m cat.data.datadir validate --no-text --require-feats data/test
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from cat.core.io import PathLike, atomic_write, iter_table, setup_logging, write_table

logger = logging.getLogger(__name__)

DEFAULT_REQUIRED = ("wav.scp", "text", "utt2spk", "spk2utt")
# Tables keyed by utterance id; every one present must cover exactly the utterances of utt2spk.
UTTERANCE_TABLES = ("utt2spk", "text", "segments", "feats.scp", "utt2num_frames")
DEFAULT_MAX_PROBLEMS = 30
# How many utterance ids an inconsistent spk2utt line lists in its message.
_MAX_LISTED_IDS = 5


class DataDirError(ValueError):
    """A data directory is invalid; `problems` holds one message per problem found."""

    def __init__(self, path: PathLike, problems: Sequence[str], total: int | None = None):
        self.path = str(path)
        self.problems = list(problems)
        self.total = len(self.problems) if total is None else total
        lines = [f"{self.path}: {self.total} problem(s) in data directory:"]
        lines += [f"  {problem}" for problem in self.problems]
        if self.total > len(self.problems):
            lines.append(f"  ... and {self.total - len(self.problems)} more")
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# Writing


def derive_spk2utt(utt2spk: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Group `(utterance, speaker)` pairs into speaker -> utterances, keeping the input order.

    With a byte-order sorted `utt2spk` each list is sorted too, as Kaldi expects.
    """
    spk2utt: dict[str, list[str]] = {}
    for utt, spk in utt2spk:
        spk2utt.setdefault(spk, []).append(utt)
    return spk2utt


def write_spk2utt(data_dir: PathLike) -> int:
    """Write `data_dir/spk2utt` derived from `data_dir/utt2spk`; returns the speaker count."""
    data_dir = Path(data_dir)
    spk2utt = derive_spk2utt(iter_table(data_dir / "utt2spk"))
    rows = ((spk, " ".join(utts)) for spk, utts in spk2utt.items())
    return write_table(data_dir / "spk2utt", rows)


def _format_segment(value: object) -> str:
    if isinstance(value, str):
        return value
    recording, start, end = value  # type: ignore[misc]
    return f"{recording} {start} {end}"


def write_data_dir(
    path: PathLike,
    wav_scp: Iterable[tuple[str, str]],
    text: Iterable[tuple[str, str]],
    utt2spk: Iterable[tuple[str, str]],
    segments: Iterable[tuple[str, object]] | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write a complete, validated data directory at `path`, replacing any previous one.

    Tables are given as `(key, value)` pairs in any order; they are written sorted in
    byte order, and `spk2utt` is derived from `utt2spk`. A `segments` value is either the
    string `"<recording> <start> <end>"` or a `(recording, start, end)` tuple.
    `extra_files` maps file names to text (e.g. a preparation log) written alongside.

    Everything is built in a temporary sibling directory and validated there; only a
    valid directory is moved to `path`, so a failed run never leaves a partial or
    invalid directory under the final name. Raises `DataDirError` listing the problems.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    build = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    if build.exists():
        shutil.rmtree(build)
    build.mkdir()
    try:
        write_table(build / "wav.scp", wav_scp)
        write_table(build / "text", text)
        write_table(build / "utt2spk", utt2spk)
        write_spk2utt(build)
        if segments is not None:
            write_table(build / "segments", ((k, _format_segment(v)) for k, v in segments))
        for name, content in (extra_files or {}).items():
            with atomic_write(build / name) as f:
                f.write(content)
        validate_data_dir(build, display_path=path)
        _replace_dir(build, path)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return path


def _replace_dir(new: Path, final: Path) -> None:
    """Move directory `new` to `final`, removing the previous `final` only once `new` is in."""
    if not final.exists():
        os.replace(new, final)
        return
    old = final.with_name(f".{final.name}.old.{os.getpid()}")
    os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old)


@dataclass
class SkipReport:
    """Counts what a preparation kept and skipped for one output set, with reasons.

    Skips are recorded as `(reason, item, detail)`; `log_text()` renders a summary
    header followed by one line per skipped item, for a `prep.log` file.
    """

    name: str
    kept: int = 0
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def skip(self, reason: str, item: str, detail: str = "") -> None:
        """Record that `item` was skipped for `reason` (a short code such as `no_transcript`)."""
        self.skipped.append((reason, item, detail))

    def counts(self) -> dict[str, int]:
        """Skip counts per reason, in first-seen order."""
        counts: dict[str, int] = {}
        for reason, _, _ in self.skipped:
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def summary(self) -> str:
        """One line: the set name, kept count and skip counts per reason."""
        parts = [f"{reason}={count}" for reason, count in self.counts().items()]
        skipped = f"skipped {len(self.skipped)} ({', '.join(parts)})" if parts else "skipped 0"
        return f"{self.name}: kept {self.kept}, {skipped}"

    def log_text(self) -> str:
        """The summary as `#` comment lines, then `<reason> <item> <detail>` per skipped item."""
        lines = [f"# set: {self.name}", f"# kept: {self.kept}"]
        lines += [f"# skipped {reason}: {count}" for reason, count in self.counts().items()]
        lines += [" ".join(x for x in entry if x) for entry in self.skipped]
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Validation


class _Problems:
    """Collects problem messages, keeping the first `limit` and counting the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.messages: list[str] = []
        self.total = 0

    def add(self, message: str) -> None:
        self.total += 1
        if len(self.messages) < self.limit:
            self.messages.append(message)


@dataclass
class _Table:
    """One table of the directory: where it is, how to name it, and what the scan found."""

    name: str
    path: Path
    label: str
    is_sorted: bool = True


def _lines(table: _Table, problems: _Problems | None) -> Iterator[tuple[int, str, str]]:
    """Yield `(line_number, key, value)` for each well-formed line of a table.

    Malformed lines (bad UTF-8, blank, leading whitespace, missing value) are reported
    to `problems` when given, and skipped in any case.
    """
    with open(table.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                if problems is not None:
                    problems.add(f"{table.label}:{lineno}: not valid UTF-8 ({error.reason})")
                continue
            parts = line.split(maxsplit=1)
            if len(parts) == 2 and not line[0].isspace():
                yield lineno, parts[0], parts[1].rstrip()
            elif problems is not None:
                problems.add(f"{table.label}:{lineno}: {_line_problem(line, parts)}")


def _line_problem(line: str, parts: list[str]) -> str:
    if not parts:
        return "empty line"
    if line[0].isspace():
        return f"line starts with whitespace: {line!r}"
    return f"key {parts[0]!r} has no value"


def _value_problem(table: str, key: str, value: str) -> str | None:
    """What is wrong with the value of one line of `table`, or None."""
    if table == "utt2spk" and len(value.split()) != 1:
        return f"utterance {key!r}: speaker must be one token, got {value!r}"
    if table == "utt2num_frames" and not (value.isdigit() and int(value) > 0):
        return f"utterance {key!r}: frame count must be a positive integer, got {value!r}"
    if table == "segments":
        return _segment_problem(key, value)
    return None


def _segment_problem(key: str, value: str) -> str | None:
    fields = value.split()
    if len(fields) != 3:
        return f"segment {key!r}: expected '<recording> <start> <end>', got {value!r}"
    try:
        start, end = Decimal(fields[1]), Decimal(fields[2])
    except InvalidOperation:
        return f"segment {key!r}: start/end are not numbers: {value!r}"
    if not (start.is_finite() and end.is_finite() and 0 <= start < end):
        return f"segment {key!r}: need 0 <= start < end, got start={fields[1]} end={fields[2]}"
    return None


def _scan_table(table: _Table, problems: _Problems,
                on_line: Callable[[int, str, str], None] | None = None) -> None:
    """Check line format, value format, byte order and key uniqueness of one table.

    `on_line(lineno, key, value)` is called for every well-formed line.
    """
    previous: str | None = None
    previous_line = 0
    check_value = table.name in ("utt2spk", "utt2num_frames", "segments")
    for lineno, key, value in _lines(table, problems):
        # Python compares str by code point, which is the byte order of their UTF-8 encoding.
        if previous is not None and key <= previous:
            where = f"{table.label}:{lineno}"
            if key == previous:
                problems.add(f"{where}: duplicate key {key!r} (also on line {previous_line})")
            else:
                if table.is_sorted:
                    problems.add(f"{where}: not sorted in byte order: key {key!r} comes after "
                                 f"{previous!r} (line {previous_line}); sort with LC_ALL=C sort")
                table.is_sorted = False
        if check_value:
            problem = _value_problem(table.name, key, value)
            if problem:
                problems.add(f"{table.label}:{lineno}: {problem}")
        if on_line is not None:
            on_line(lineno, key, value)
        previous, previous_line = key, lineno


def _sorted_keys(table: _Table, problems: _Problems) -> Iterator[tuple[str, int]]:
    """Yield `(key, line_number)` in byte order, each key once.

    A sorted table is streamed; an unsorted one (already reported) is loaded and sorted,
    and its non-adjacent duplicate keys are reported here.
    """
    rows: Iterable[tuple[str, int]] = ((key, lineno) for lineno, key, _ in _lines(table, None))
    if not table.is_sorted:
        rows = sorted(rows)
    previous: tuple[str, int] | None = None
    for key, lineno in rows:
        if previous is not None and key == previous[0]:
            if not table.is_sorted:
                problems.add(f"{table.label}:{lineno}: duplicate key {key!r} "
                             f"(also on line {previous[1]})")
            continue
        previous = (key, lineno)
        yield key, lineno


def _tagged(stream: Iterator[tuple[str, int]], name: str) -> Iterator[tuple[str, str, int]]:
    for key, lineno in stream:
        yield key, name, lineno


def _compare_utterances(tables: dict[str, _Table], problems: _Problems) -> None:
    """Report utterances present in some utterance-keyed tables but not in all of them."""
    names = list(tables)
    merged = heapq.merge(*(_tagged(_sorted_keys(tables[n], problems), n) for n in names))
    for key, group in itertools.groupby(merged, key=lambda item: item[0]):
        present = {name: lineno for _, name, lineno in group}
        if len(present) == len(names):
            continue
        anchor = next(name for name in names if name in present)
        missing = [name for name in names if name not in present]
        problems.add(f"{tables[anchor].label}:{present[anchor]}: utterance {key!r} is missing "
                     f"from {', '.join(missing)}")


def _check_speakers(utt2spk: _Table, spk2utt: _Table, problems: _Problems) -> None:
    """Check spk2utt against utt2spk in memory proportional to the number of speakers.

    Each speaker's utterance set is summarised by (count, XOR of hashes) from both
    files; only speakers whose summaries differ are re-read to name the utterances.
    """
    from_utt2spk: dict[str, list[int]] = {}
    for _, utt, value in _lines(utt2spk, None):
        stats = from_utt2spk.setdefault(value.split()[0], [0, 0])
        stats[0] += 1
        stats[1] ^= hash(utt)
    seen: set[str] = set()
    mismatched: dict[str, int] = {}

    def on_line(lineno: int, spk: str, value: str) -> None:
        utts = value.split()
        if len(set(utts)) != len(utts):
            duplicates = sorted({u for u in utts if utts.count(u) > 1})[:_MAX_LISTED_IDS]
            problems.add(f"{spk2utt.label}:{lineno}: speaker {spk!r} lists utterances more "
                         f"than once: {duplicates}")
        seen.add(spk)
        if spk not in from_utt2spk:
            problems.add(f"{spk2utt.label}:{lineno}: speaker {spk!r} is not in utt2spk")
            return
        digest = 0
        for utt in set(utts):
            digest ^= hash(utt)
        if [len(set(utts)), digest] != from_utt2spk[spk]:
            mismatched[spk] = lineno

    _scan_table(spk2utt, problems, on_line)
    for spk in from_utt2spk:
        if spk not in seen:
            problems.add(f"{spk2utt.label}: speaker {spk!r} of utt2spk has no line")
    if mismatched:
        _explain_speakers(utt2spk, spk2utt, mismatched, problems)


def _explain_speakers(utt2spk: _Table, spk2utt: _Table, mismatched: dict[str, int],
                      problems: _Problems) -> None:
    wanted = dict(itertools.islice(mismatched.items(), problems.limit))
    expected: dict[str, set[str]] = {spk: set() for spk in wanted}
    for _, utt, value in _lines(utt2spk, None):
        spk = value.split()[0]
        if spk in expected:
            expected[spk].add(utt)
    for lineno, spk, value in _lines(spk2utt, None):
        if wanted.get(spk) != lineno:
            continue
        listed = set(value.split())
        missing = sorted(expected[spk] - listed)[:_MAX_LISTED_IDS]
        extra = sorted(listed - expected[spk])[:_MAX_LISTED_IDS]
        problems.add(f"{spk2utt.label}:{lineno}: speaker {spk!r} disagrees with utt2spk: "
                     f"missing {missing}, not mapped to this speaker in utt2spk {extra}")
    for spk, lineno in itertools.islice(mismatched.items(), len(wanted), None):
        problems.add(f"{spk2utt.label}:{lineno}: speaker {spk!r} disagrees with utt2spk")


def find_problems(
    path: PathLike,
    require: Sequence[str] = DEFAULT_REQUIRED,
    max_problems: int = DEFAULT_MAX_PROBLEMS,
    display_path: PathLike | None = None,
) -> tuple[list[str], int]:
    """Validate a data directory; returns `(messages, total)`, at most `max_problems` messages.

    Messages name the file (under `display_path`, default `path`), line and key.
    """
    path = Path(path)
    label_root = Path(display_path) if display_path is not None else path
    problems = _Problems(max_problems)
    if not path.is_dir():
        return [f"{label_root}: not a directory"], 1
    names = ("wav.scp", "segments", "spk2utt", *UTTERANCE_TABLES)
    tables = {
        name: _Table(name, path / name, str(label_root / name))
        for name in dict.fromkeys(names)
        if (path / name).is_file()
    }
    for name in require:
        if name not in tables:
            problems.add(f"{label_root / name}: required file is missing")
    if "segments" in tables and "wav.scp" not in tables and "wav.scp" not in require:
        problems.add(f"{label_root / 'wav.scp'}: missing, but segments refers to recordings")

    recordings: set[str] = set()
    if "wav.scp" in tables:
        keep_keys = "segments" in tables
        _scan_table(tables["wav.scp"], problems,
                    (lambda _, key, __: recordings.add(key)) if keep_keys else None)
    if "segments" in tables and "wav.scp" in tables:
        segments = tables["segments"]

        def check_recording(lineno: int, key: str, value: str) -> None:
            recording = value.split()[0]
            if recording not in recordings:
                problems.add(f"{segments.label}:{lineno}: segment {key!r} refers to recording "
                             f"{recording!r}, which is not in wav.scp")

        _scan_table(segments, problems, check_recording)
    elif "segments" in tables:
        _scan_table(tables["segments"], problems)
    for name in ("utt2spk", "text", "feats.scp", "utt2num_frames"):
        if name in tables:
            _scan_table(tables[name], problems)
    if "utt2spk" in tables and "spk2utt" in tables:
        _check_speakers(tables["utt2spk"], tables["spk2utt"], problems)
    elif "spk2utt" in tables:
        _scan_table(tables["spk2utt"], problems)

    # Utterances are defined by utt2spk; wav.scp is keyed by utterance only without segments.
    utterance_tables = {n: tables[n] for n in UTTERANCE_TABLES if n in tables}
    if "segments" not in tables and "wav.scp" in tables:
        utterance_tables["wav.scp"] = tables["wav.scp"]
    if "utt2spk" in utterance_tables and len(utterance_tables) > 1:
        _compare_utterances(utterance_tables, problems)
    return problems.messages, problems.total


def validate_data_dir(
    path: PathLike,
    require: Sequence[str] = DEFAULT_REQUIRED,
    max_problems: int = DEFAULT_MAX_PROBLEMS,
    display_path: PathLike | None = None,
) -> None:
    """Raise `DataDirError` listing the problems of a Kaldi data directory, if any.

    Checks: required files exist; every table is byte-order sorted with unique keys
    and well-formed lines; every utterance of utt2spk is in text and in wav.scp
    (directly, or through segments whose recordings are in wav.scp); spk2utt agrees
    with utt2spk; segments have 0 <= start < end; feats.scp and utt2num_frames, when
    present, cover the same utterances.
    """
    messages, total = find_problems(path, require, max_problems, display_path)
    if total:
        raise DataDirError(display_path if display_path is not None else path, messages, total)


# ----------------------------------------------------------------------------------------------
# Command line


def _required_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    required = ["utt2spk", "spk2utt"]
    if not args.no_text:
        required.append("text")
    if not args.no_wav:
        required.append("wav.scp")
    if args.require_feats:
        required.append("feats.scp")
    return tuple(required)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m cat.data.datadir", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a Kaldi data directory")
    validate.add_argument("data_dir", help="the directory to check")
    validate.add_argument("--no-text", action="store_true", help="text is optional")
    validate.add_argument("--no-wav", action="store_true", help="wav.scp is optional")
    validate.add_argument("--require-feats", action="store_true", help="feats.scp is required")
    validate.add_argument("--max-problems", type=int, default=DEFAULT_MAX_PROBLEMS,
                          help="report at most this many problems (default %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        validate_data_dir(args.data_dir, _required_from_args(args), args.max_problems)
    except DataDirError as error:
        logger.error("%s", error)
        return 1
    logger.info("%s: data directory is valid", args.data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
