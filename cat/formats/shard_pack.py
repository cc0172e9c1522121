"""What the feature and the audio shard packers share: folders, re-runs, jobs, the index.

Both packers (`cat.formats.prep_wds.pack_data` for features, `cat.formats.audio_pack
.pack_audio` for audio) decide every shard's contents up front as a list of `ShardJob`-
like jobs (a `path` and a `fingerprint` of its inputs), one list per output folder
(`Folder`: the whole output, or one length group). This module then

* splits a table of utterances into length groups (`split_folders`; out-of-range
  utterances are dropped and counted);
* prepares each folder for a re-run (`prepare_folder`): removes temporaries of a killed
  run, refuses shards this packing would not write, and collects the records of shards
  finished earlier, from the folder's index or from `.parts/` (records of shards that
  an interrupted run completed);
* keeps the shards whose fingerprint and size match (`reuse_finished`), writes the
  others here and in as many worker processes as the work and the idle CPUs pay for
  (`plan_workers`, `run_jobs`, `write_pending`), and
* writes the folder's `index.jsonl` last (`write_index`).

Usage:
    previous = [prepare_folder(folder, name_regex) for folder in folders]
    pending, records = reuse_finished(folders, previous)
    write_pending(pending, num_jobs, records, write_shard, record_of)
    for folder in folders:
        write_index(folder, records, {"fmt": fmt, "content": "features", ...}, ...)
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from cat.core.io import atomic_write
from cat.core.launch import Launcher, map_calls
from cat.core.process import process_pool
from cat.formats.shard_format import (
    INDEX_FORMAT,
    INDEX_NAME,
    INDEX_VERSION,
    read_index,
    temporary_regex,
)
from cat.formats.tables import FRAME_SHIFT_SECONDS, DropLog, FrameRange, parse_frame_ranges

logger = logging.getLogger(__name__)

#: Utterances per tar shard (an upper bound: shards of a folder differ by at most one).
UTTS_PER_FILE = 2000
DEFAULT_FMT = "data-%05d.tar"
#: Seconds a spawned packing worker takes to start (Python, numpy, kaldiio: about 1 s on
#: an idle machine, several on a loaded one), and how many times that in work it must get.
WORKER_START_SECONDS = 2.0
WORKER_PAYS_FACTOR = 4
#: Set to 1, every job of `--nj` gets its worker whatever the work and the load (the
#: process drills need the workers; a user who knows the machine better may want them).
START_WORKERS_VARIABLE = "CAT_PACK_START_WORKERS"
# Records of shards finished by an interrupted run, so a re-run can keep them.
PARTS_DIR = ".parts"
# Fields of a shard's index line before its long lists (see cat.formats.shard_format).
_RECORD_FIELDS = ("shard", "num_utts", "num_frames", "num_bytes", "crc32", "fingerprint")


class Table(Protocol):
    """What `split_folders` needs of an utterance table."""

    keys: list[str]
    num_frames: np.ndarray

    def __len__(self) -> int: ...

    def select(self, indices: Sequence[int] | np.ndarray) -> Table: ...


class Job(Protocol):
    """What the re-run logic needs of a shard job."""

    path: str
    fingerprint: str


@dataclasses.dataclass
class Folder:
    """One output folder: the utterances it gets and the shards planned for them."""

    path: Path
    frame_range: FrameRange | None
    table: Any
    jobs: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PackSummary:
    """What a packing did: counts per output folder (name relative to d_out)."""

    num_input: int
    num_utts: dict[str, int]
    num_shards: dict[str, int]
    dropped: dict[str, int]
    shards_written: int
    shards_kept: int
    num_frames: dict[str, int] = dataclasses.field(default_factory=dict)


def check_options(filter_group: Sequence[str] | str | None, utts_per_file: int,
                  num_jobs: int) -> list[FrameRange] | None:
    """Checked shard size and job count; the parsed length groups (None: no groups)."""
    if utts_per_file < 1 or num_jobs < 1:
        raise ValueError(f"utts_per_file ({utts_per_file}) and num_jobs ({num_jobs}) "
                         "must be >= 1")
    if isinstance(filter_group, str):
        filter_group = [filter_group]
    return parse_frame_ranges(filter_group) if filter_group else None


def split_folders(table: Table, d_out: Path, ranges: list[FrameRange] | None,
                  drops: DropLog) -> list[Folder]:
    """One folder per length group (or `d_out` itself); the rest dropped as `out_of_range`."""
    if ranges is None:
        return [Folder(d_out, None, table)]
    lows = np.array([r.low for r in ranges], np.int64)
    highs = np.array([np.iinfo(np.int64).max if r.high is None else r.high for r in ranges],
                     np.int64)
    group = np.searchsorted(lows, table.num_frames, side="right") - 1
    inside = group >= 0
    inside[inside] = table.num_frames[inside] < highs[group[inside]]
    spec = " ".join(str(r) for r in ranges)
    for index in np.flatnonzero(~inside):
        drops.add(table.keys[index], "out_of_range",
                  f"num_frames={table.num_frames[index]} groups={spec}")
    return [Folder(d_out / r.name, r, table.select(np.flatnonzero(inside & (group == i))))
            for i, r in enumerate(ranges)]


# --------------------------------------------------------------------------- re-runs


def prepare_folder(folder: Folder, name_regex: re.Pattern) -> dict[str, dict[str, Any]]:
    """Remove leftover temporaries, refuse foreign shards, return reusable shard records."""
    folder.path.mkdir(parents=True, exist_ok=True)
    planned = {Path(job.path).name for job in folder.jobs}
    temporary = temporary_regex(name_regex)
    stray, removed = [], 0
    for entry in sorted(os.listdir(folder.path)):
        if temporary.fullmatch(entry):
            # Left by a killed run (one packer per folder): never a complete file.
            (folder.path / entry).unlink()
            removed += 1
        elif name_regex.fullmatch(entry) and entry not in planned:
            stray.append(entry)
    if removed:
        logger.info("%s: removed %d temporary files of an interrupted run", folder.path, removed)
    if stray:
        raise FileExistsError(f"{folder.path} holds shards that this packing would not write "
                              f"({', '.join(stray[:5])}{', ...' if len(stray) > 5 else ''}); "
                              "remove them or pack into a new folder")
    records: dict[str, dict[str, Any]] = {}
    index_path = folder.path / INDEX_NAME
    if index_path.is_file():
        try:
            index = read_index(folder.path)
            for record in index.shards:
                records[record["shard"]] = {**record, "feat_dim": index.header["feat_dim"]}
        except (ValueError, KeyError):
            logger.warning("%s is unreadable; its shards will be rewritten", index_path)
    parts = folder.path / PARTS_DIR
    if parts.is_dir():
        for part in sorted(parts.glob("*.json")):
            try:
                record = json.loads(part.read_text(encoding="utf-8"))
                records[record["shard"]] = record
            except (ValueError, KeyError):
                logger.warning("ignoring unreadable record %s", part)
    return records


def save_part(folder: Path, record: dict[str, Any]) -> None:
    """Keep the record of a finished shard until the folder's index is written."""
    with atomic_write(folder / PARTS_DIR / f"{record['shard']}.json") as f:
        json.dump(record, f, ensure_ascii=False)


def is_reusable(job: Job, record: dict[str, Any] | None) -> bool:
    """Whether the shard on disk is what `job` would write (same inputs, complete)."""
    path = Path(job.path)
    return (record is not None and record.get("fingerprint") == job.fingerprint
            and path.is_file() and path.stat().st_size == record.get("num_bytes"))


def reuse_finished(folders: list[Folder], previous: list[dict[str, dict[str, Any]]]
                   ) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Split the plan into shards to write and records of shards kept as they are."""
    pending: list[Any] = []
    records: dict[str, dict[str, Any]] = {}
    for folder, old in zip(folders, previous, strict=True):
        todo = []
        for job in folder.jobs:
            record = old.get(Path(job.path).name)
            if is_reusable(job, record):
                records[job.path] = record
            else:
                todo.append(job)
        if todo:
            # The old index would describe shards about to change; keep what it vouches for.
            for job in folder.jobs:
                if job.path in records:
                    save_part(folder.path, records[job.path])
            (folder.path / INDEX_NAME).unlink(missing_ok=True)
        pending += todo
    return pending, records


# --------------------------------------------------------------------------- writing


def usable_cpus() -> int:
    """CPUs this process may run on that other work leaves idle (1-minute load average;
    this process, busy already, counts as one of the loaded)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    try:
        idle = cpus - os.getloadavg()[0] + 1
    except OSError:  # no load average on this platform
        idle = cpus
    return max(1, min(cpus, math.floor(idle)))


def plan_workers(num_jobs: int, num_tasks: int,
                 work_seconds: float | Callable[[], float | None] | None) -> int:
    """Worker processes to start beside this one (which writes shards too): at most
    `num_jobs - 1`, one fewer than the usable CPUs, one fewer than the shards, and, when
    the work is known (`work_seconds` of one core), only as many as it pays for: a worker
    takes about WORKER_START_SECONDS to start (spawn, imports), so each must get several
    times that in work. `CAT_PACK_START_WORKERS=1` starts them all regardless."""
    if os.environ.get(START_WORKERS_VARIABLE) == "1":
        return max(0, min(num_jobs, num_tasks) - 1)
    extra = min(num_jobs, num_tasks, usable_cpus()) - 1
    if extra <= 0:
        return 0
    if callable(work_seconds):  # estimated only when workers are possible
        work_seconds = work_seconds()
    if work_seconds is not None:
        extra = min(extra, math.floor(work_seconds / (WORKER_PAYS_FACTOR
                                                      * WORKER_START_SECONDS)) - 1)
    return max(0, extra)


def run_jobs(jobs: list[Any], num_jobs: int, write: Callable[[Any], dict[str, Any]],
             work_seconds: float | Callable[[], float | None] | None = None
             ) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Yield `(job, write(job))` as shards complete.

    This process writes shards from the front of the list; the workers that
    `plan_workers` starts take them from the back, two in flight each, so a worker's
    start-up delays nothing and no job waits for a busy worker at the end.
    """
    workers = plan_workers(num_jobs, len(jobs), work_seconds)
    if workers == 0:
        for job in jobs:
            yield job, write(job)
        return
    queue = collections.deque(jobs)
    running: dict[concurrent.futures.Future, Any] = {}
    with process_pool(workers) as pool:
        try:
            while queue or running:
                while queue and len(running) < 2 * workers:
                    job = queue.pop()
                    running[pool.submit(write, job)] = job
                for future in [f for f in running if f.done()]:
                    yield running.pop(future), future.result()
                if queue:
                    job = queue.popleft()
                    yield job, write(job)
                elif running:
                    concurrent.futures.wait(running,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
        except BrokenProcessPool:
            raise RuntimeError("a packing process died (killed?); completed shards are kept, "
                               "re-run to finish") from None
        finally:
            for future in running:
                future.cancel()


def _finish(job: Any, result: dict[str, Any],
            record_of: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """The record of a written shard, saved in its folder's `.parts/`."""
    path = Path(job.path)
    record = {"shard": path.name, **record_of(job, result), "fingerprint": job.fingerprint}
    save_part(path.parent, record)
    return record


def write_share(jobs: list[Any], write: Callable[[Any], dict[str, Any]],
                record_of: Callable[[Any, dict[str, Any]], dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """Write `jobs` one after the other (a task of a cluster array); their records."""
    return [_finish(job, write(job), record_of) for job in jobs]


def write_pending(pending: list[Any], num_jobs: int, records: dict[str, dict[str, Any]],
                  write: Callable[[Any], dict[str, Any]],
                  record_of: Callable[[Any, dict[str, Any]], dict[str, Any]],
                  work_seconds: float | Callable[[], float | None] | None = None,
                  launcher: Launcher | None = None, log_dir: Path | None = None) -> None:
    """Write the pending shards; each one's record (`record_of(job, result)`) is saved
    in `.parts/` as soon as it is complete, and added to `records`. `work_seconds`: the
    estimated single-core seconds of the whole work (None: unknown; or a function giving
    them, called only when workers are possible), which decides how many worker
    processes pay (`plan_workers`). With a `launcher` the shards are dealt to `num_jobs`
    tasks of one array job instead (`cat.core.launch.map_calls`,
    logs `log_dir/pack.<task>.log`); the shards of a failed task are written again by
    the next run, the others are kept."""
    if launcher is not None and pending:
        tasks = min(num_jobs, len(pending))
        shares = [(pending[i::tasks], write, record_of) for i in range(tasks)]
        if log_dir is None:
            raise ValueError("packing through a cluster backend needs a log_dir")
        results = map_calls(launcher, "pack", write_share, shares, log_dir, tasks)
        for (jobs, _, _), share in zip(shares, results, strict=True):
            for job, record in zip(jobs, share, strict=True):
                records[job.path] = record
        return
    with tqdm(total=len(pending), unit="shard", desc="packing", disable=None) as progress:
        for job, result in run_jobs(pending, num_jobs, write, work_seconds):
            records[job.path] = _finish(job, result, record_of)
            progress.update()


def write_index(folder: Folder, records: dict[str, dict[str, Any]],
                content_fields: dict[str, Any], utts_per_file: int | None,
                seed: int | None) -> None:
    """Write `folder/index.jsonl` (atomically, last) and drop the folder's `.parts/`.

    `content_fields` (`fmt`, `content` and what it implies) follow the format and
    version in the header.
    """
    shards = [records[job.path] for job in folder.jobs]
    header = {
        "format": INDEX_FORMAT, "version": INDEX_VERSION, **content_fields,
        "utts_per_file": utts_per_file, "seed": seed,
        "frame_range": None if folder.frame_range is None else str(folder.frame_range),
        "num_shards": len(shards), "num_utts": sum(r["num_utts"] for r in shards),
        "num_frames": sum(r["num_frames"] for r in shards),
    }
    write_index_lines(folder.path, header, shards)
    shutil.rmtree(folder.path / PARTS_DIR, ignore_errors=True)


def write_index_lines(directory: Path, header: dict[str, Any],
                      shards: Sequence[dict[str, Any]]) -> None:
    """`index.jsonl`: the header, then a line per shard (counts first, then the lists)."""
    with atomic_write(directory / INDEX_NAME) as f:
        f.write(json.dumps(header, ensure_ascii=False) + "\n")
        for record in shards:
            line = {k: record[k] for k in _RECORD_FIELDS}
            line.update(longest=max(record["frames"], default=0), keys=record["keys"],
                        frames=record["frames"])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- reporting


def folder_name(folder: Folder, d_out: Path) -> str:
    """A folder's name in a `PackSummary`: `.` for `d_out` itself."""
    return "." if folder.path == d_out else folder.path.name


def log_summary(summary: PackSummary, folders: list[Folder], drops: DropLog,
                d_out: Path, dropped_name: str) -> None:
    """Log what each folder got and what was dropped."""
    for folder in folders:
        name = folder_name(folder, d_out)
        logger.info("%s: %d utterances (%.2f h) in %d shards", folder.path,
                    summary.num_utts[name], hours(summary.num_frames.get(name, 0)),
                    summary.num_shards[name])
        if not summary.num_utts[name]:
            logger.warning("%s: no utterance falls in this group", folder.path)
    logger.info("%d of %d utterances packed (%d shards written, %d kept); %s, listed in %s",
                sum(summary.num_utts.values()), summary.num_input, summary.shards_written,
                summary.shards_kept, drops.summary(), d_out / dropped_name)


def hours(num_frames: int) -> float:
    """Hours of audio in `num_frames` 10 ms frames."""
    return num_frames * FRAME_SHIFT_SECONDS / 3600
