"""Stage 1: Kaldi-compatible log-mel filterbank features for a Kaldi data directory.

Reads `wav.scp` (audio files readable by soundfile: WAV, FLAC, Ogg Opus ...; or Kaldi
pipe commands ending in `|` whose stdout is audio), the optional `segments`, and copies
`text` and `utt2spk` through. Features are 80-dim log-mel fbank computed with
`torchaudio.compliance.kaldi.fbank` (25 ms window, 10 ms shift, dither 0 unless asked,
other options at their Kaldi defaults) on audio scaled to the int16 range as Kaldi reads
it, after resampling to `--sample-rate` when a file's rate differs (libsoxr,
`cat.audio.codec.resample`).

Work is split by recording over `--nj` processes; each recording is decoded once per
job and all its segments are cut from the decoded waveform. With `--speed-perturb`,
each recording is also speed-changed as sox `speed` does (`cat.audio.speed`: tempo and
pitch together, `floor(n / factor + 0.5)` samples from `n`, nothing leaking into the
top mel bins) and the segments of the copy `sp<factor>-<utt>` are cut from the changed
recording at times / factor, like Kaldi's `perturb_data_dir_speed.sh`.

With `--front-end sherpa-onnx` the fbank is sherpa-onnx's (`cat.features.fbank.FRONT_ENDS`).

Output layout of <feat-dir> (tables sorted in byte order, written atomically):
    feats.scp, utt2num_frames       features of every utterance that got some
    fbank.json                      the fbank options they were computed with
    text, utt2spk, spk2utt          copied for exactly those utterances (when present)
    skipped.txt                     `<utt> <reason>` for every utterance without features
    arks/feats.<job>.{ark,scp}      the matrices, written by kaldiio (also the job's
                                    utt2num_frames.<job> and skipped.<job>)
    arks/done.<job>                 a job's completion marker (hash of options and inputs)
    split<nj>/<job>/                each job's wav.scp (and segments)
    log/extract.<job>.log           each job's log

A finished job is not redone on a re-run with the same options and inputs; an
unfinished one is redone from scratch. With `--cmd` (`cat.core.launch`, the recipe's
`$train_cmd`), the unfinished jobs run as the tasks of one array job (a Slurm array with
the slurm backend) instead of a process pool (`split<nj>/<job>/job.json` is each task's
spec, its log `log/extract.<job>.log`); a failed task stops the stage naming it and its
log, and a re-run submits only the jobs not done. Unreadable audio is skipped, listed and counted;
the run fails only if every utterance failed or an input table is malformed.

A `wav.scp` command gets `$CAT_WAV_SCP_TIMEOUT` seconds (default 600, 0 for no limit;
`cat.features.fbank.command_timeout`) to write its audio; one that takes longer is killed
with its process group and its utterances are skipped (`<utt> command '<command>' did not
finish within 600 s: killed ...` in skipped.txt). The variable reaches the job processes
and array tasks. A command the shell cannot run (status 126, 127) stops its job instead.

Usage:
    python -m cat.features.extract --nj 4 --speed-perturb 0.9,1.1 data/train data/train_sp_fbank
    python -m cat.features.extract --nj 40 --cmd "launch.sh --backend slurm --mem-per-job 2G" \
        data/train data/fbank/train
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import heapq
import json
import logging
import os
import sys
import traceback
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import kaldiio
import numpy as np
import torch
from tqdm import tqdm

from cat.audio.codec import conversion_notes, resample
from cat.audio.speed import speed_perturb
from cat.core.io import (
    PathLike,
    TableError,
    atomic_write,
    iter_table,
    read_table,
    remove_stale_temporaries,
    setup_logging,
    write_table,
)
from cat.core.launch import (
    JOB,
    ArrayJobError,
    Launcher,
    add_cmd_argument,
    run_array,
)
from cat.core.process import process_pool
from cat.core.threads import configure_threads
from cat.features.fbank import (
    FRONT_ENDS,
    AudioError,
    FbankOptions,
    compute_fbank,
    front_end,
    read_audio_with_channels,
    write_front_end,
)
from cat.features.plan import (
    DEFAULT_MAX_OVERSHOOT,
    FORMAT_VERSION,
    KALDI_AUTOMATIC_COMPRESSION,
    Job,
    JobFiles,
    Plan,
    check_speed_factors,
    finished_job,
    job_digest,
    plan_jobs,
    remove_stale_outputs,
    speed_prefix,
)

logger = logging.getLogger(__name__)

#: One utterance of a recording: (utterance id, start, end) in seconds; end -1: to the end.
Piece = tuple[str, float, float]


class FeatureExtractionError(RuntimeError):
    """The stage failed as a whole: a job crashed, or no utterance got features."""


@dataclass(frozen=True)
class ExtractSummary:
    """What `extract` produced: counts, and which jobs ran or were reused from a past run."""

    num_utterances: int
    num_skipped: int
    num_frames: int
    jobs_run: tuple[int, ...]
    jobs_reused: tuple[int, ...]
    #: recordings resampled or cut to channel 0, by kind ("resampled from 8000 Hz ...")
    conversions: dict[str, int] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# One job (runs in a worker process)


def _read_job_segments(path: Path) -> dict[str, list[Piece]]:
    segments: dict[str, list[Piece]] = {}
    for utt, value in iter_table(path):
        recording, start, end = value.split()
        segments.setdefault(recording, []).append((utt, float(start), float(end)))
    return segments


def segment_span(start: float, end: float, num_samples: int, sample_rate: int,
                 max_overshoot: float) -> tuple[int, int] | str:
    """Sample range of a segment, as Kaldi's extract-segments computes it, or why it is unusable.

    `end == -1` means the end of the recording; an end past it by up to `max_overshoot`
    seconds is clipped. The audio shard packer (`cat.formats.audio_pack`) cuts with it too.
    """
    begin = int(start * sample_rate)
    stop = num_samples if end == -1 else int(end * sample_rate)
    if num_samples == 0:
        return "empty audio"
    if start < 0:
        return f"segment starts before the recording ({start} s)"
    if begin >= num_samples:
        return (f"segment starts at {start} s, after the recording end "
                f"({num_samples / sample_rate} s)")
    if stop > num_samples:
        if stop - num_samples > int(max_overshoot * sample_rate):
            return (f"segment ends at {end} s, more than {max_overshoot} s after the recording "
                    f"end ({num_samples / sample_rate} s)")
        stop = num_samples
    if stop <= begin:
        return f"empty segment ({start} s to {end} s)"
    return begin, stop


def utterance_features(
    waveform: np.ndarray, rate: int, pieces: Sequence[Piece], options: FbankOptions,
    speed_factors: Sequence[float] = (), max_overshoot: float = DEFAULT_MAX_OVERSHOOT,
) -> Iterator[tuple[str, np.ndarray | str]]:
    """Yield `(utterance, features or skip reason)` for every piece of a decoded recording.

    `waveform` (at `rate`) is resampled to `options.sample_rate`, each piece
    `(utterance, start, end)` (seconds; end -1: the recording's end) is cut from it as
    Kaldi's extract-segments does, and each speed factor adds a copy `sp<factor>-<utterance>`
    cut from the changed recording at times / factor. What stage 1 computes; decoding
    from audio (`cat.decoding.audio`) computes the same.
    """
    sample_rate = options.sample_rate
    waveform = resample(waveform, rate, sample_rate)
    copies = [("", 1.0)] + [(speed_prefix(f), f) for f in speed_factors]
    spans = [(utt, segment_span(start, end, len(waveform), sample_rate, max_overshoot))
             for utt, start, end in pieces]
    for prefix, factor in copies:
        audio = waveform if factor == 1.0 else speed_perturb(waveform, sample_rate, factor)
        for utt, span in spans:
            key = prefix + utt
            if isinstance(span, str):
                yield key, span
                continue
            begin, stop = _perturbed_span(span, len(waveform), len(audio), factor)
            yield key, cut_features(audio[begin:stop], key, options)


def cut_features(samples: np.ndarray, key: str, options: FbankOptions) -> np.ndarray | str:
    """The fbank stage 1 gives the utterance `key` of `samples` (its audio at
    `options.sample_rate`, already cut; dither, if any, seeded by the key), or why it
    has none."""
    try:
        return compute_fbank(samples, options.sample_rate, options,
                             seed=zlib.crc32(key.encode()))
    except AudioError as error:
        return str(error)


def _recording_features(
    recording: str, spec: str, pieces: list[Piece] | None, job: Job,
    conversions: collections.Counter | None = None,
) -> Iterator[tuple[str, np.ndarray | str]]:
    """Yield `(utterance, features or skip reason)` for every utterance of one recording.

    `pieces` are the recording's segments, or None for a whole-recording utterance.
    The recording is decoded once; each speed factor changes it once. Recordings
    resampled or cut to their first channel are counted in `conversions`.
    """
    pieces = pieces if pieces is not None else [(recording, 0.0, -1.0)]
    try:
        waveform, rate, channels = read_audio_with_channels(spec)
    except AudioError as error:
        for prefix in [""] + [speed_prefix(f) for f in job.speed_factors]:
            for utt, _, _ in pieces:
                yield prefix + utt, str(error)
        return
    if conversions is not None:
        conversions.update(conversion_notes(rate, channels, job.options.sample_rate))
    yield from utterance_features(waveform, rate, pieces, job.options, job.speed_factors,
                                  job.max_overshoot)


def _perturbed_span(span: tuple[int, int], num_samples: int, num_perturbed: int,
                    factor: float) -> tuple[int, int]:
    """Where a segment's samples lie in the recording changed by `factor`: its times /
    factor; a segment reaching the recording's end reaches the changed recording's end
    (all of sox's `floor(n / factor + 0.5)` samples for a whole recording)."""
    if factor == 1.0:
        return span
    stop = num_perturbed if span[1] == num_samples else min(int(span[1] / factor),
                                                           num_perturbed)
    return int(span[0] / factor), stop


@contextlib.contextmanager
def _job_log(path: Path) -> Iterator[None]:
    """Send this module's log records to `path` while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s",
                                           "%Y-%m-%d %H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def _run_job(job: Job) -> dict:
    """Compute and write one job's features; returns the completion marker's content."""
    files = JobFiles.of(Path(job.feat_dir), job.index)
    # The marker goes first so that a crash from here on leaves the job unfinished.
    for path in (files.marker, files.ark, files.scp, files.num_frames, files.skipped):
        path.unlink(missing_ok=True)
    input_dir = Path(job.input_dir)
    recordings = read_table(input_dir / "wav.scp")
    segments = _read_job_segments(input_dir / "segments") if job.has_segments else None
    num_pieces = sum(map(len, segments.values())) if segments is not None else len(recordings)
    logger.info("job %d: %d recording(s), %d utterance(s) x %d speed(s); options %s",
                job.index, len(recordings), num_pieces, 1 + len(job.speed_factors),
                dataclasses.asdict(job.options))

    entries: list[tuple[str, int, int]] = []
    skipped: list[tuple[str, str]] = []
    conversions: collections.Counter = collections.Counter()
    compression = KALDI_AUTOMATIC_COMPRESSION if job.compress else None
    partial = files.ark.with_name(files.ark.name + ".tmp")
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "wb") as ark, tqdm(
            total=num_pieces * (1 + len(job.speed_factors)),
            desc=f"fbank {job.index}/{job.num_jobs}", unit="utt", position=job.index - 1,
            disable=not job.progress, mininterval=1.0, dynamic_ncols=True,
        ) as bar:
            for recording, spec in recordings.items():
                pieces = segments[recording] if segments is not None else None
                for key, result in _recording_features(recording, spec, pieces, job,
                                                       conversions):
                    if isinstance(result, str):
                        reason = " ".join(result.split())  # one line per entry in skipped.txt
                        skipped.append((key, reason))
                        logger.warning("%s: skipped: %s", key, reason)
                    else:
                        # kaldiio writes "<key> " and then the matrix, where the scp points.
                        offset = ark.tell() + len(key.encode("utf-8")) + 1
                        kaldiio.save_ark(ark, {key: result}, compression_method=compression)
                        entries.append((key, offset, result.shape[0]))
                    bar.update()
            ark.flush()
            os.fsync(ark.fileno())
        os.replace(partial, files.ark)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise

    write_table(files.scp, ((key, f"{files.ark}:{offset}") for key, offset, _ in entries))
    write_table(files.num_frames, ((key, frames) for key, _, frames in entries))
    write_table(files.skipped, skipped)
    marker = {"digest": job.digest, "ark_bytes": files.ark.stat().st_size,
              "num_utterances": len(entries), "num_skipped": len(skipped),
              "conversions": dict(conversions),
              "num_frames": sum(frames for _, _, frames in entries)}
    with atomic_write(files.marker) as f:
        json.dump(marker, f)
    logger.info("job %d: %d utterance(s) with features, %d skipped", job.index,
                len(entries), len(skipped))
    return marker


def _run_job_logged(job: Job) -> dict:
    """Run one job with one torch thread, logging to its log file; errors go in the result."""
    files = JobFiles.of(Path(job.feat_dir), job.index)
    threads = torch.get_num_threads()
    # Jobs are the unit of parallelism: one intra-op thread each avoids oversubscription.
    configure_threads(1)
    try:
        with _job_log(files.log):
            try:
                return _run_job(job)
            except Exception:
                logger.error("job %d failed:\n%s", job.index, traceback.format_exc())
                return {"error": traceback.format_exc(limit=1).strip().splitlines()[-1]}
    finally:
        torch.set_num_threads(threads)


def _run_job_task(spec: Path) -> int:
    """One job as the task of an array (`--run-job`): its log is this process's stderr."""
    job = Job.from_json(spec.read_text(encoding="utf-8"))
    configure_threads(1)
    _run_job(dataclasses.replace(job, progress=False))
    return 0


def _run_jobs_array(jobs: list[Job], launcher: Launcher, split_dir: Path) -> list[dict]:
    """Run jobs as the tasks of one array through `launcher`; results as `_run_jobs`'."""
    for job in jobs:
        with atomic_write(split_dir / str(job.index) / "job.json") as f:
            f.write(job.to_json())
    feat_dir = Path(jobs[0].feat_dir)
    failures: dict[int, tuple[str, Path]] = {}
    try:
        run_array(launcher, "extract", [job.index for job in jobs],
                  [sys.executable, "-m", "cat.features.extract", "--run-job",
                   str(split_dir.resolve() / JOB / "job.json")],
                  feat_dir / "log" / f"extract.{JOB}.log", parallel=len(jobs))
    except ArrayJobError as error:
        failures = error.failures
    results = []
    for job in jobs:
        if job.index in failures:
            results.append({"error": failures[job.index][0]})
        else:
            files = JobFiles.of(feat_dir, job.index)
            results.append(json.loads(files.marker.read_text(encoding="utf-8")))
    return results


def _run_jobs(jobs: list[Job], num_processes: int) -> list[dict]:
    """Run jobs in parallel processes (in this process when there is only one)."""
    if len(jobs) == 1:
        return [_run_job_logged(jobs[0])]
    # Spawned workers (forking a process that has used torch is unsafe) that end with
    # this process.
    with process_pool(min(num_processes, len(jobs))) as pool:
        futures = [pool.submit(_run_job_logged, job) for job in jobs]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except concurrent.futures.process.BrokenProcessPool as error:
                results.append({"error": f"worker process died: {error}"})
        return results


# ----------------------------------------------------------------------------------------------
# Merging


def _write_sorted(path: Path, rows: Iterable[tuple[str, str]]) -> int:
    """Write `(key, value)` rows that arrive in byte order, atomically; returns the count."""
    count, previous = 0, None
    with atomic_write(path) as f:
        for key, value in rows:
            if previous is not None and key <= previous:
                raise FeatureExtractionError(f"{path}: key {key!r} is repeated or out of order "
                                             f"(after {previous!r})")
            f.write(f"{key} {value}\n" if value else f"{key}\n")
            previous = key
            count += 1
    return count


def _merged(paths: Iterable[Path], allow_empty_value: bool = False) -> Iterator[tuple[str, str]]:
    """Rows of several sorted tables, merged in byte order."""
    tables = [iter_table(path, allow_empty_value) for path in paths]
    return heapq.merge(*tables, key=lambda row: row[0])


def _expanded(rows: dict[str, str], prefixes: Sequence[str], keep: Callable[[str, str], bool],
              prefix_value: bool) -> Iterator[tuple[str, str]]:
    """Rows of a base table for every speed prefix, in byte order, filtered by `keep`."""
    keys = sorted(rows)

    def copy(prefix: str) -> Iterator[tuple[str, str]]:
        for key in keys:
            if keep(prefix, key):
                yield prefix + key, (prefix + rows[key]) if prefix_value else rows[key]

    return heapq.merge(*(copy(prefix) for prefix in prefixes), key=lambda row: row[0])


def _copy_tables(data_dir: Path, feat_dir: Path, plan: Plan, prefixes: Sequence[str],
                 skipped: set[str]) -> None:
    """Write text, utt2spk and spk2utt for exactly the utterances that got features."""
    def keep(prefix: str, utt: str) -> bool:
        return utt in plan.utterances and prefix + utt not in skipped

    # Copies left by an earlier run from inputs that no longer exist would be stale.
    for name in ("text", "utt2spk", "spk2utt"):
        if not (data_dir / name).is_file():
            (feat_dir / name).unlink(missing_ok=True)
    if (data_dir / "text").is_file():
        text = read_table(data_dir / "text", allow_empty_value=True)
        _report_coverage(data_dir / "text", text, plan.utterances)
        _write_sorted(feat_dir / "text", _expanded(text, prefixes, keep, prefix_value=False))
    if (data_dir / "utt2spk").is_file():
        utt2spk = read_table(data_dir / "utt2spk")
        _report_coverage(data_dir / "utt2spk", utt2spk, plan.utterances)
        _write_sorted(feat_dir / "utt2spk", _expanded(utt2spk, prefixes, keep, prefix_value=True))
        speakers: dict[str, list[str]] = {}
        for utt in sorted(utt2spk):
            speakers.setdefault(utt2spk[utt], []).append(utt)

        def spk2utt(prefix: str) -> Iterator[tuple[str, str]]:
            for speaker in sorted(speakers):
                utts = [prefix + utt for utt in speakers[speaker] if keep(prefix, utt)]
                if utts:
                    yield prefix + speaker, " ".join(utts)

        _write_sorted(feat_dir / "spk2utt",
                      heapq.merge(*(spk2utt(p) for p in prefixes), key=lambda row: row[0]))


def _report_coverage(path: Path, table: dict[str, str], utterances: set[str]) -> None:
    without_audio = sum(1 for key in table if key not in utterances)
    missing = sum(1 for utt in utterances if utt not in table)
    if without_audio:
        logger.warning("%s: %d entr(ies) have no audio in wav.scp/segments; not copied",
                       path, without_audio)
    if missing:
        logger.warning("%s: %d utterance(s) with audio have no entry", path, missing)


def _merge(data_dir: Path, feat_dir: Path, plan: Plan, prefixes: Sequence[str]
           ) -> tuple[int, int, int]:
    """Write the merged tables; returns (utterances, skipped, frames)."""
    jobs = [JobFiles.of(feat_dir, index) for index in range(1, plan.num_jobs + 1)]
    num_utterances = _write_sorted(feat_dir / "feats.scp", _merged(job.scp for job in jobs))
    num_frames = 0

    def frames() -> Iterator[tuple[str, str]]:
        nonlocal num_frames
        for key, value in _merged(job.num_frames for job in jobs):
            num_frames += int(value)
            yield key, value

    _write_sorted(feat_dir / "utt2num_frames", frames())
    skipped = dict(_merged(job.skipped for job in jobs))
    write_table(feat_dir / "skipped.txt", skipped.items())
    expected = len(plan.utterances) * len(prefixes)
    if num_utterances + len(skipped) != expected:
        raise FeatureExtractionError(f"{feat_dir}: {num_utterances} utterance(s) with features "
                                     f"and {len(skipped)} skipped, expected {expected} in all")
    _copy_tables(data_dir, feat_dir, plan, prefixes, set(skipped))
    return num_utterances, len(skipped), num_frames


# ----------------------------------------------------------------------------------------------
# Entry points


def extract(
    data_dir: PathLike,
    feat_dir: PathLike,
    nj: int = 1,
    options: FbankOptions | None = None,
    speed_factors: Sequence[float] = (),
    compress: bool = False,
    max_overshoot: float = DEFAULT_MAX_OVERSHOOT,
    progress: bool = True,
    launcher: Launcher | None = None,
) -> ExtractSummary:
    """Compute fbank features for the data dir `data_dir` into `feat_dir` (see module doc).

    Jobs finished by an earlier run with the same inputs and options are reused; the
    others run here in `nj` processes, or as the tasks of an array through `launcher`
    (`cat.core.launch`).
    Raises `TableError` for malformed input tables and `FeatureExtractionError` when a
    job crashed or no utterance got features.
    """
    options = options or FbankOptions()
    factors = check_speed_factors(speed_factors)
    if nj < 1:
        raise ValueError(f"nj must be at least 1, got {nj}")
    if max_overshoot < 0:
        raise ValueError(f"max_overshoot must not be negative, got {max_overshoot}")
    data_dir, feat_dir = Path(data_dir), Path(feat_dir).resolve()
    if feat_dir == data_dir.resolve():
        raise ValueError(f"{feat_dir}: the feature dir must differ from the data dir")

    plan = plan_jobs(data_dir, feat_dir, nj, factors)
    remove_stale_outputs(feat_dir, plan.num_jobs, plan.split_dir)
    for directory in (feat_dir, feat_dir / "arks"):
        if directory.is_dir():
            remove_stale_temporaries(directory)  # of jobs killed by an earlier run
    jobs, reused = _pending_jobs(feat_dir, plan, options, factors, compress, max_overshoot,
                                 progress)
    if reused:
        logger.info("reusing %d finished job(s): %s", len(reused), _job_list(reused))
    if not jobs:
        results = []
    elif launcher is None:
        results = _run_jobs(jobs, nj)
    else:
        results = _run_jobs_array(jobs, launcher, plan.split_dir)
    failed = []
    for job, result in zip(jobs, results, strict=True):
        if "error" in result:
            failed.append(job.index)
            logger.error("job %d failed (%s); see %s", job.index, result["error"],
                         JobFiles.of(feat_dir, job.index).log)
    if failed:
        raise FeatureExtractionError(f"{len(failed)} feature job(s) failed: {_job_list(failed)}")

    prefixes = [""] + [speed_prefix(f) for f in factors]
    # Before feats.scp (the last file written): a dir with features says how they came.
    write_front_end(feat_dir, options)
    num_utterances, num_skipped, frames = _merge(data_dir, feat_dir, plan, prefixes)
    summary = ExtractSummary(num_utterances, num_skipped, frames,
                             tuple(job.index for job in jobs), tuple(reused),
                             _conversions(feat_dir, plan.num_jobs))
    _log_summary(feat_dir, summary, options)
    if num_utterances == 0:
        raise FeatureExtractionError(f"no utterance got features; reasons in "
                                     f"{feat_dir / 'skipped.txt'}")
    return summary


def _pending_jobs(feat_dir: Path, plan: Plan, options: FbankOptions, factors: tuple[float, ...],
                  compress: bool, max_overshoot: float, progress: bool,
                  ) -> tuple[list[Job], list[int]]:
    """The jobs to run, and the indices of finished jobs to reuse."""
    jobs, reused = [], []
    for index in range(1, plan.num_jobs + 1):
        files = JobFiles.of(feat_dir, index)
        input_dir = plan.split_dir / str(index)
        fields = {"version": FORMAT_VERSION, "options": dataclasses.asdict(options),
                  "speed_factors": list(factors), "compress": compress,
                  "max_overshoot": max_overshoot, "ark": str(files.ark)}
        digest = job_digest(fields, input_dir)
        if finished_job(files, digest) is not None:
            reused.append(index)
            continue
        jobs.append(Job(index, plan.num_jobs, str(feat_dir), str(input_dir), plan.has_segments,
                         options, factors, compress, max_overshoot, digest, progress))
    return jobs, reused


def _conversions(feat_dir: Path, num_jobs: int) -> dict[str, int]:
    """Recordings resampled or cut to one channel, summed over the jobs' markers."""
    total: collections.Counter = collections.Counter()
    for index in range(1, num_jobs + 1):
        marker = json.loads(JobFiles.of(feat_dir, index).marker.read_text(encoding="utf-8"))
        total.update(marker.get("conversions", {}))
    return dict(sorted(total.items()))


def _job_list(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices))


def _log_summary(feat_dir: Path, summary: ExtractSummary, options: FbankOptions) -> None:
    hours = summary.num_frames * options.frame_shift_ms / 1000 / 3600
    logger.info("%s: features for %d utterance(s) (%.2f h); jobs run: %d, reused: %d",
                feat_dir, summary.num_utterances, hours, len(summary.jobs_run),
                len(summary.jobs_reused))
    if summary.num_skipped:
        logger.warning("%d utterance(s) skipped; reasons in %s", summary.num_skipped,
                       feat_dir / "skipped.txt")
    for kind, count in summary.conversions.items():
        logger.warning("%d recording(s): %s", count, kind)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_factors(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cat.features.extract", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", help="Kaldi data dir with wav.scp (+ segments, text, utt2spk)")
    parser.add_argument("feat_dir", help="output dir (feats.scp, utt2num_frames, arks/, ...)")
    parser.add_argument("--nj", type=int, default=1, help="parallel jobs (default %(default)s)")
    parser.add_argument("--num-mel-bins", type=int, default=80, help="default %(default)s")
    parser.add_argument("--sample-rate", type=int, default=16000,
                        help="audio is resampled to this rate (default %(default)s)")
    parser.add_argument("--dither", type=float, default=0.0,
                        help="Kaldi dithering; 0 keeps features reproducible (default 0)")
    parser.add_argument("--front-end", choices=sorted(FRONT_ENDS), default="kaldi",
                        help="the fbank front end (cat.features.fbank.FRONT_ENDS; recorded "
                             "in the feature dir's fbank.json; default %(default)s)")
    parser.add_argument("--speed-perturb", type=_parse_factors, default=(), metavar="F1,F2",
                        help="also write sp<F>-<utt> copies at these speeds, e.g. 0.9,1.1")
    parser.add_argument("--compress", type=_parse_bool, default=False, metavar="true|false",
                        help="write Kaldi-compressed matrices (default false)")
    parser.add_argument("--max-overshoot", type=float, default=DEFAULT_MAX_OVERSHOOT,
                        help="seconds a segment may end past its recording (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_cmd_argument(parser)
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status. `--run-job SPEC` (internal) runs
    one job as the task of an array."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--run-job":
        setup_logging()
        return _run_job_task(Path(argv[1]))
    args = _parse_args(argv)
    setup_logging(args.verbose)
    options = dataclasses.replace(front_end(args.front_end), num_mel_bins=args.num_mel_bins,
                                  sample_rate=args.sample_rate, dither=args.dither)
    try:
        extract(args.data_dir, args.feat_dir, nj=args.nj, options=options,
                speed_factors=args.speed_perturb, compress=args.compress,
                max_overshoot=args.max_overshoot, progress=not args.no_progress,
                launcher=Launcher.from_cmd(args.cmd))
    except (TableError, FeatureExtractionError, ValueError, FileNotFoundError) as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
