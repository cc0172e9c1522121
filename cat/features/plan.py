"""Job planning of stage 1: which recordings each feature job extracts, and what is done.

Recordings are dealt to `nj` jobs balanced by their audio's size (or, for `segments`,
by the segments' total duration; by count when a `wav.scp` line is a command); each job
gets its own `wav.scp` (and `segments`) under `split<nj>/<job>/`. A re-run over the same
recordings keeps the deal of the run before (`previous_assignment`), whatever their
lines now hold. A job's inputs and options are hashed into its completion
marker, so a re-run redoes exactly the jobs whose inputs or options changed; outputs of
jobs that no longer exist are removed.

Usage:
    plan = plan_jobs(Path("data/train"), Path("data/fbank/train"), nj=4, speed_factors=())
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cat.core.io import (
    TableError,
    atomic_write,
    iter_table,
    read_table,
    write_table,
)
from cat.features.fbank import FbankOptions

logger = logging.getLogger(__name__)

# Bump when the features written for the same inputs and options change, so that
# finished jobs of an older version are redone. 2: resampling and speed perturbation
# with libsoxr (`cat.audio`), as sox does them.
FORMAT_VERSION = 2
# Segments may end this much past the end of their recording; the end is then clipped.
DEFAULT_MAX_OVERSHOOT = 0.05
# kaldiio's kAutomaticMethod: what Kaldi's `--compress=true` uses.
KALDI_AUTOMATIC_COMPRESSION = 1
JOB_OUTPUT = re.compile(r"^(?:feats|utt2num_frames|skipped|done|extract)\.(\d+)(?:\.\w+)*$")


# ----------------------------------------------------------------------------------------------
# Planning: validate the data dir, split recordings over jobs


@dataclass(frozen=True)
class JobFiles:
    """Where one job keeps its outputs."""

    ark: Path
    scp: Path
    num_frames: Path
    skipped: Path
    marker: Path
    log: Path

    @classmethod
    def of(cls, feat_dir: Path, index: int) -> JobFiles:
        arks = feat_dir / "arks"
        return cls(ark=arks / f"feats.{index}.ark", scp=arks / f"feats.{index}.scp",
                   num_frames=arks / f"utt2num_frames.{index}",
                   skipped=arks / f"skipped.{index}", marker=arks / f"done.{index}",
                   log=feat_dir / "log" / f"extract.{index}.log")


@dataclass(frozen=True)
class Job:
    """Everything a worker process needs (it is pickled to the worker)."""

    index: int
    num_jobs: int
    feat_dir: str
    input_dir: str
    has_segments: bool
    options: FbankOptions
    speed_factors: tuple[float, ...]
    compress: bool
    max_overshoot: float
    digest: str
    progress: bool

    def to_json(self) -> str:
        """The job as JSON (the spec a cluster task reads, `from_json`)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Job:
        fields = json.loads(text)
        return cls(**{**fields, "options": FbankOptions(**fields["options"]),
                      "speed_factors": tuple(fields["speed_factors"])})


@dataclass
class Plan:
    num_jobs: int
    split_dir: Path
    has_segments: bool
    utterances: set[str]


def check_speed_factors(factors: Iterable[float]) -> tuple[float, ...]:
    checked: list[float] = []
    for factor in factors:
        if not (math.isfinite(factor) and factor > 0) or factor == 1.0:
            raise ValueError(f"speed factor must be positive and not 1, got {factor}")
        if speed_prefix(factor) in {speed_prefix(f) for f in checked}:
            raise ValueError(f"speed factor {factor} given twice")
        checked.append(factor)
    return tuple(checked)


def speed_prefix(factor: float) -> str:
    """Kaldi's id prefix of a speed-perturbed copy: `sp0.9-` for factor 0.9."""
    return f"sp{factor:g}-"


def read_segments(path: Path, wav_scp: Container[str]) -> Iterator[tuple[str, str, float, float]]:
    """Yield `(utterance, recording, start, end)` of each line of a Kaldi `segments` file.

    Errors name the line: a line that is not `<utterance> <recording> <start> <end>`,
    times that are not finite numbers, a recording not in `wav_scp`, a repeated utterance.
    """
    utterances: set[str] = set()
    for lineno, (utt, value) in enumerate(iter_table(path), 1):
        fields = value.split()
        if len(fields) != 3:
            raise TableError(f"{path}:{lineno}: expected '<utterance> <recording> <start> "
                             f"<end>', got {utt} {value!r}")
        recording = fields[0]
        try:
            start, end = float(fields[1]), float(fields[2])
        except ValueError:
            raise TableError(f"{path}:{lineno}: segment {utt!r}: start/end are not numbers: "
                             f"{value!r}") from None
        if not (math.isfinite(start) and math.isfinite(end)):
            raise TableError(f"{path}:{lineno}: segment {utt!r}: start/end must be finite")
        if recording not in wav_scp:
            raise TableError(f"{path}:{lineno}: segment {utt!r} refers to recording "
                             f"{recording!r}, which is not in wav.scp")
        if utt in utterances:
            raise TableError(f"{path}:{lineno}: duplicate utterance {utt!r}")
        utterances.add(utt)
        yield utt, recording, start, end


def scan_segments(path: Path, wav_scp: dict[str, str]) -> tuple[dict[str, float], set[str]]:
    """Validate `segments`; return (total segment seconds per recording, utterance ids)."""
    durations: dict[str, float] = {}
    utterances: set[str] = set()
    for utt, recording, start, end in read_segments(path, wav_scp):
        utterances.add(utt)
        # An end of -1 means "to the end of the recording" (Kaldi): length unknown here.
        durations[recording] = durations.get(recording, 0.0) + max(end - start, 0.0)
    return durations, utterances


def file_sizes(wav_scp: dict[str, str]) -> dict[str, float] | None:
    """Audio bytes per recording, or None when some sizes are unknown (pipes)."""
    sizes: dict[str, float] = {}
    for recording, spec in wav_scp.items():
        if spec.rstrip().endswith("|"):
            return None
        try:
            sizes[recording] = float(os.path.getsize(spec))
        except OSError:
            sizes[recording] = 0.0  # unreadable: it is skipped quickly
    return sizes


def balance_jobs(recordings: Sequence[str], weights: dict[str, float] | None,
             num_jobs: int) -> list[list[str]]:
    """Assign recordings to jobs, largest first to the least loaded job; each job sorted."""
    def weight(recording: str) -> float:
        return weights[recording] if weights is not None else 1.0

    order = sorted(recordings, key=lambda r: (-weight(r), r))
    # (load, recordings so far, job): the count breaks ties so zero weights still spread.
    heap = [(0.0, 0, job) for job in range(num_jobs)]
    jobs: list[list[str]] = [[] for _ in range(num_jobs)]
    for recording in order:
        load, count, job = heapq.heappop(heap)
        jobs[job].append(recording)
        heapq.heappush(heap, (load + weight(recording), count + 1, job))
    return [sorted(job) for job in jobs]


def previous_assignment(split_dir: Path, num_jobs: int, recordings: Sequence[str]
                        ) -> list[list[str]] | None:
    """The recordings of each job as an earlier run dealt them into `split_dir`, when it
    dealt exactly `recordings` to `num_jobs` jobs; else None.

    A re-run keeps them there whatever changed in `wav.scp` (a fixed line, a command
    become a file, a file of another size), so that only the jobs whose lines changed
    are redone: a new deal, by sizes that changed, would move other recordings and redo
    (and, on a cluster, resubmit) their jobs too."""
    jobs: list[list[str]] = []
    for index in range(1, num_jobs + 1):
        try:
            jobs.append(sorted(key for key, _ in iter_table(split_dir / str(index) / "wav.scp")))
        except (OSError, TableError, UnicodeError):
            return None
    dealt = [recording for job in jobs for recording in job]
    if len(dealt) != len(recordings) or set(dealt) != set(recordings):
        return None
    return jobs


def plan_jobs(data_dir: Path, feat_dir: Path, nj: int,
          speed_factors: tuple[float, ...]) -> Plan:
    """Validate the inputs and write each job's input lists under `feat_dir/split<nj>`."""
    wav_scp_path, segments_path = data_dir / "wav.scp", data_dir / "segments"
    wav_scp = read_table(wav_scp_path)
    if not wav_scp:
        raise TableError(f"{wav_scp_path}: no recordings")
    has_segments = segments_path.is_file()
    if has_segments:
        durations, utterances = scan_segments(segments_path, wav_scp)
        if not utterances:
            raise TableError(f"{segments_path}: no segments")
        unused = len(wav_scp) - len(durations)
        if unused:
            logger.info("%d recording(s) of %s have no segments; they are not used",
                        unused, wav_scp_path)
        recordings = sorted(durations)
        weights: dict[str, float] | None = durations
    else:
        utterances = set(wav_scp)
        recordings = sorted(wav_scp)
        weights = file_sizes(wav_scp)
    check_no_id_clash(utterances, speed_factors)

    num_jobs = min(nj, len(recordings))
    split_dir = feat_dir / f"split{num_jobs}"
    assignment = previous_assignment(split_dir, num_jobs, recordings)
    if assignment is None:
        assignment = balance_jobs(recordings, weights, num_jobs)
    else:
        logger.info("%s: the %d recording(s) stay in the jobs of the previous run (%s)",
                    feat_dir, len(recordings), split_dir)
    job_of = {}
    for index, job_recordings in enumerate(assignment, 1):
        write_table(split_dir / str(index) / "wav.scp", ((r, wav_scp[r]) for r in job_recordings))
        job_of.update(dict.fromkeys(job_recordings, index))
    if has_segments:
        split_segments(segments_path, split_dir, job_of, num_jobs)
    return Plan(num_jobs, split_dir, has_segments, utterances)


def check_no_id_clash(utterances: set[str], speed_factors: tuple[float, ...]) -> None:
    for factor in speed_factors:
        prefix = speed_prefix(factor)
        for utt in utterances:
            if prefix + utt in utterances:
                raise ValueError(f"speed-perturbed id {prefix + utt!r} is already an utterance "
                                 f"of the data dir")


def split_segments(path: Path, split_dir: Path, job_of: dict[str, int], num_jobs: int) -> None:
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(atomic_write(split_dir / str(index) / "segments"))
                   for index in range(1, num_jobs + 1)]
        for utt, value in iter_table(path):
            outputs[job_of[value.split(maxsplit=1)[0]] - 1].write(f"{utt} {value}\n")


def job_digest(job_fields: dict, input_dir: Path) -> str:
    digest = hashlib.sha256(json.dumps(job_fields, sort_keys=True).encode())
    for name in ("wav.scp", "segments"):
        path = input_dir / name
        if path.is_file():
            digest.update(f"\n{name}\n".encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def finished_job(files: JobFiles, digest: str) -> dict | None:
    """The marker of a finished job with this digest whose outputs are intact, else None."""
    try:
        marker = json.loads(files.marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    intact = (marker.get("digest") == digest
              and files.ark.is_file() and files.ark.stat().st_size == marker.get("ark_bytes")
              and files.scp.is_file() and files.num_frames.is_file() and files.skipped.is_file())
    return marker if intact else None


def remove_stale_outputs(feat_dir: Path, num_jobs: int, split_dir: Path) -> None:
    """Delete outputs of jobs beyond `num_jobs` and older split dirs from earlier runs."""
    for folder in (feat_dir / "arks", feat_dir / "log"):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = JOB_OUTPUT.match(path.name)
            if match and int(match.group(1)) > num_jobs:
                path.unlink()
    for path in feat_dir.glob("split*"):
        if path.is_dir() and re.fullmatch(r"split\d+", path.name) and path != split_dir:
            shutil.rmtree(path)
