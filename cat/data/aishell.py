"""AISHELL-1 (OpenSLR 33): download and extract the release, prepare Kaldi data directories.

The extracted release holds `data_aishell/wav/{train,dev,test}/<speaker>/<utt>.wav` and
`data_aishell/transcript/aishell_transcript_v0.8.txt` (`<utt> <word-segmented text>`).
`prepare` writes `{train,dev,test}/{wav.scp,text,utt2spk,spk2utt,prep.log}` under the
output directory, with transcript spaces removed, plus a summary in `prep.log` there.
Audio without transcript, transcript lines without audio and empty transcripts are
skipped, counted and listed in the `prep.log` files.

Usage:
    python -m cat.data.aishell download /data/aishell
    python -m cat.data.aishell prepare /data/aishell data
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cat.core.io import PathLike, atomic_write, setup_logging
from cat.data.datadir import DataDirError, SkipReport, write_data_dir
from cat.data.download import DownloadError, download

logger = logging.getLogger(__name__)

SETS = ("train", "dev", "test")
TRANSCRIPT = Path("transcript") / "aishell_transcript_v0.8.txt"
OPENSLR_URL = "https://www.openslr.org/resources/33"
# md5 sums of the OpenSLR 33 archives, as used by PaddleSpeech's AISHELL recipe.
ARCHIVE_MD5: Mapping[str, str] = {
    "data_aishell.tgz": "2f494334227864a8a8fec932999db9d8",
    "resource_aishell.tgz": "957d480a0fcac85fc18e550756f624e5",
}
_UTTERANCE_ID = re.compile(r"[A-Za-z0-9_-]+")
# Release ids look like BAC009S0002W0122: the speaker is characters 7 to 11.
_SPEAKER_IN_ID = slice(6, 11)


class AishellError(ValueError):
    """The AISHELL-1 release is malformed or incomplete; the message names the file."""


@dataclass(frozen=True)
class TranscriptLine:
    """One transcript line: the text with spaces removed and where it came from."""

    text: str
    line: int


@dataclass(frozen=True)
class AudioFile:
    """One audio file of the release."""

    utterance: str
    speaker: str
    path: str


def find_release(root: PathLike) -> Path:
    """The `data_aishell` directory, given it or the directory containing it."""
    root = Path(os.path.abspath(root))
    for candidate in (root / "data_aishell", root):
        if (candidate / "wav").is_dir() and (candidate / TRANSCRIPT).is_file():
            return candidate
    raise AishellError(
        f"{root}: no AISHELL-1 release here: expected {root / 'data_aishell' / TRANSCRIPT} "
        f"or {root / TRANSCRIPT} next to a wav/ directory"
    )


def read_transcript(path: PathLike) -> tuple[dict[str, TranscriptLine], int]:
    """Read `aishell_transcript_v0.8.txt`; returns `(utterance -> line, blank line count)`.

    Whitespace inside the text is removed: a character-level tokenizer would otherwise
    see the word-segmentation spaces. Malformed lines raise `AishellError` naming
    `file:line`; empty transcripts are kept (as "") for the caller to count.
    """
    transcripts: dict[str, TranscriptLine] = {}
    blank = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff").rstrip()
            except UnicodeDecodeError as error:
                raise AishellError(f"{where}: not valid UTF-8 ({error.reason})") from error
            if not line:
                blank += 1
                continue
            if line[0].isspace():
                raise AishellError(f"{where}: line starts with whitespace: {line!r}")
            fields = line.split(maxsplit=1)
            utt, text = fields[0], fields[1] if len(fields) > 1 else ""
            if not _UTTERANCE_ID.fullmatch(utt):
                raise AishellError(f"{where}: expected '<utterance-id> <words>', got {line!r}")
            if utt in transcripts:
                raise AishellError(f"{where}: duplicate utterance {utt!r} "
                                   f"(first on line {transcripts[utt].line})")
            transcripts[utt] = TranscriptLine("".join(text.split()), lineno)
    return transcripts, blank


def scan_audio(release: PathLike) -> tuple[dict[str, list[AudioFile]], dict[str, list[str]]]:
    """List the `.wav` files of each set; returns `(set -> audio files, set -> ignored paths)`.

    Walks only `wav/<set>/<speaker>/` with os.scandir (the train set has 120k files).
    An utterance id found twice raises `AishellError` naming both files.
    """
    wav_dir = Path(release) / "wav"
    audio: dict[str, list[AudioFile]] = {}
    ignored: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for subset in SETS:
        set_dir = wav_dir / subset
        if not set_dir.is_dir():
            hint = ("; extract the per-speaker archives wav/*.tar.gz first"
                    if any(wav_dir.glob("*.tar.gz")) else "")
            raise AishellError(f"{set_dir}: missing set directory{hint}")
        audio[subset], ignored[subset] = [], []
        with os.scandir(set_dir) as speakers:
            for speaker in speakers:
                if not speaker.is_dir():
                    ignored[subset].append(speaker.path)
                    continue
                with os.scandir(speaker.path) as files:
                    for entry in files:
                        if not (entry.name.endswith(".wav") and entry.is_file()):
                            ignored[subset].append(entry.path)
                            continue
                        utt = entry.name[: -len(".wav")]
                        if utt in seen:
                            raise AishellError(f"{entry.path}: utterance {utt!r} also in "
                                               f"{seen[utt]}")
                        seen[utt] = entry.path
                        audio[subset].append(AudioFile(utt, speaker.name, entry.path))
    return audio, ignored


def prepare(aishell_root: PathLike, out_dir: PathLike) -> dict[str, SkipReport]:
    """Write `out_dir/{train,dev,test}` Kaldi data directories from an AISHELL-1 release.

    `aishell_root` is the directory holding `data_aishell/`, or `data_aishell/` itself.
    Each set directory gets sorted `wav.scp` (absolute paths), `text` (spaces removed),
    `utt2spk` (speaker = the audio's directory), `spk2utt` and a `prep.log` listing
    what was skipped: `no_transcript` (audio without a transcript line),
    `empty_transcript`, `no_audio` (a transcript line whose speaker belongs to this set
    but whose audio is missing) and `ignored_file` (non-wav entries). Transcript lines
    without audio whose speaker has no audio at all go to the `unassigned` report.
    `out_dir/prep.log` holds the summary. Returns the report of each set and of
    `unassigned`.
    """
    release = find_release(aishell_root)
    transcript_path = release / TRANSCRIPT
    transcripts, blank_lines = read_transcript(transcript_path)
    audio, ignored = scan_audio(release)
    reports = {name: SkipReport(name) for name in (*SETS, "unassigned")}
    speaker_set = {a.speaker: subset for subset in SETS for a in audio[subset]}
    rows: dict[str, list[AudioFile]] = {}
    for subset in SETS:
        report, rows[subset] = reports[subset], []
        for path in ignored[subset]:
            report.skip("ignored_file", path)
        for item in audio[subset]:
            entry = transcripts.get(item.utterance)
            if entry is None:
                report.skip("no_transcript", item.utterance, item.path)
            elif not entry.text:
                report.skip("empty_transcript", item.utterance, f"{transcript_path}:{entry.line}")
            else:
                rows[subset].append(item)
        report.kept = len(rows[subset])
    with_audio = {a.utterance for items in audio.values() for a in items}
    for utt, entry in sorted(transcripts.items()):
        if utt not in with_audio:
            subset = speaker_set.get(utt[_SPEAKER_IN_ID], "unassigned")
            reports[subset].skip("no_audio", utt, f"{transcript_path}:{entry.line}")

    empty = [subset for subset in SETS if not rows[subset]]
    if empty:
        details = "; ".join(reports[subset].summary() for subset in SETS)
        raise AishellError(f"{release}: no usable utterances in {empty} ({details})")
    out_dir = Path(out_dir)
    for subset in SETS:
        write_data_dir(
            out_dir / subset,
            wav_scp=((a.utterance, a.path) for a in rows[subset]),
            text=((a.utterance, transcripts[a.utterance].text) for a in rows[subset]),
            utt2spk=((a.utterance, a.speaker) for a in rows[subset]),
            extra_files={"prep.log": reports[subset].log_text()},
        )
    _write_summary(out_dir / "prep.log", release, reports, blank_lines)
    return reports


def _write_summary(path: Path, release: Path, reports: Mapping[str, SkipReport],
                   blank_lines: int) -> None:
    lines = [f"# AISHELL-1 preparation from {release}",
             f"# blank transcript lines ignored: {blank_lines}"]
    unassigned = reports["unassigned"]
    summaries = [report.summary() for name, report in reports.items() if name != "unassigned"]
    summaries.append(f"transcript lines without audio whose speaker has no audio: "
                     f"{len(unassigned.skipped)}")
    for summary, report in zip(summaries, reports.values(), strict=True):
        lines.append(f"# {summary}")
        logger.log(logging.WARNING if report.skipped else logging.INFO, "%s", summary)
    lines += [" ".join(x for x in entry if x) for entry in unassigned.skipped]
    with atomic_write(path) as f:
        f.write("\n".join(lines) + "\n")
    logger.info("skipped items are listed in %s and in each set's prep.log", path)


def _extract(archive: Path, dest: Path) -> None:
    """Extract a tar archive into `dest`, rejecting members that would escape it."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as error:
        raise AishellError(f"{archive}: unsafe archive member: {error}") from error
    except (tarfile.TarError, EOFError) as error:
        raise AishellError(f"{archive}: cannot extract: {error}") from error


def _extract_speaker_archives(wav_dir: Path) -> None:
    """Extract each `wav/<speaker>.tar.gz` in place and delete it, as Kaldi's recipe does.

    An archive is deleted only after it was fully extracted, so an interrupted run
    resumes with the archives that remain.
    """
    archives = sorted(wav_dir.glob("*.tar.gz"))
    logger.info("%s: extracting %d speaker archives", wav_dir, len(archives))
    for archive in archives:
        _extract(archive, wav_dir)
        archive.unlink()


def download_and_extract(
    dest: PathLike,
    base_url: str = OPENSLR_URL,
    md5s: Mapping[str, str | None] = ARCHIVE_MD5,
    retries: int = 5,
    progress: bool = True,
) -> Path:
    """Download, verify and extract `data_aishell.tgz` and `resource_aishell.tgz` into `dest`.

    Produces `dest/data_aishell/{wav/<set>/<speaker>/*.wav,transcript/...}` and
    `dest/resource_aishell/`. Each finished step leaves a marker (`.extracted`, `.done`
    in the extracted directory), so a re-run skips finished work without any HTTP
    request. `md5s` maps archive names to expected md5 sums (None: not verified).
    Returns `dest/data_aishell`.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for archive in ("data_aishell.tgz", "resource_aishell.tgz"):
        target = dest / archive.removesuffix(".tgz")
        if (target / ".done").exists():
            logger.info("%s is complete; skipping", target)
            continue
        if not (target / ".extracted").exists():
            tgz = download(f"{base_url.rstrip('/')}/{archive}", dest / archive,
                           md5s.get(archive), retries=retries, progress=progress)
            logger.info("extracting %s", tgz)
            _extract(tgz, dest)
            if not target.is_dir():
                raise AishellError(f"{tgz}: archive holds no {target.name}/ directory")
            (target / ".extracted").touch()
        if archive == "data_aishell.tgz":
            _extract_speaker_archives(target / "wav")
        (target / ".done").touch()
    return dest / "data_aishell"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m cat.data.aishell", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("download", help="download, verify and extract the release")
    fetch.add_argument("dest", help="directory that receives the archives and data_aishell/")
    fetch.add_argument("--base-url", default=OPENSLR_URL,
                       help="URL of the directory holding the archives (default %(default)s)")
    prep = commands.add_parser("prepare", help="write Kaldi data directories")
    prep.add_argument("aishell_root", help="directory holding data_aishell/, or data_aishell/")
    prep.add_argument("out_dir", help="output directory for train/, dev/ and test/")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        if args.command == "download":
            download_and_extract(args.dest, args.base_url)
        else:
            prepare(args.aishell_root, args.out_dir)
    except (AishellError, DataDirError, DownloadError) as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
