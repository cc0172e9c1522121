"""Stage 2 (large corpora): features + transcripts into webdataset tar shards with an index.

`pack_data` joins `feats.scp` and Kaldi `text` files by utterance id, optionally sends
each utterance to a length group, shuffles (seeded), and writes tar shards of at most
`utts_per_file` utterances that plain `webdataset.WebDataset` reads: `<key>.npy` (the
feature matrix, float32, or float16 with dtype="float16") and `<key>.txt` (the
transcript, UTF-8, verbatim: it is tokenized on the fly at training time), keys escaped
and the folder's `index.jsonl` written last as `cat.formats.shard_format` describes.

Length groups (`filter_group`): each `"lo:hi"` keeps `lo <= frames < hi` (half-open;
`":hi"` means lo = 0, `"lo:"` has no upper bound) and writes to the subfolder `lo_hi`
(`10_1000`, `0_1000`, `1000_`). Overlapping groups are an error; utterances that fall
in no group are dropped and counted. Without groups, shards go to `d_out` itself.
`d_out/dropped.txt` lists every utterance left out (`<utt> <reason> [detail]`; reasons
`no_label`, `no_features`, `empty_label`, `out_of_range`).

Shard contents are decided up front (sorted ids, seeded permutation per folder, split
into equal-sized shards), so `num_jobs` does not change the output. Each tar is
written under a temporary name and renamed when complete (`cat.formats.shard_writer`),
so re-running after an interruption gives byte-identical shards; shards already
complete with the same inputs are kept. `validate` checks a folder against its index
(`cat.formats.shard_check`).

`pack-exp` packs what an experiment streams: its `hyper-p.json`'s `data.train` as
`data.shards` says, the one place its length groups come from (`pack_experiment`).

Usage:
    python -m cat.formats.prep_wds pack-exp exp/synth-ctc --nj 4
    python -m cat.formats.prep_wds pack --scp data/train/feats.scp --text data/train/text \
        --out data/wds/train --filter-group 10:1000 1000:2000 --nj 4
    python -m cat.formats.prep_wds validate data/wds/train/10_1000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import zlib
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from cat.core.config import HYPER_NAME, as_list, load_hyper
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.core.process import process_pool
from cat.core.stages import is_done, mark_done, signature
from cat.formats.shard_check import validate
from cat.formats.shard_format import (
    DROPPED_NAME,
    INDEX_FORMAT,
    INDEX_NAME,
    INDEX_VERSION,
    read_index,
    shard_name_regex,
    temporary_regex,
)
from cat.formats.shard_writer import ShardJob, write_shard
from cat.formats.tables import (
    FRAME_SHIFT_SECONDS,
    DropLog,
    FrameRange,
    UtteranceTable,
    load_utterances,
    parse_frame_ranges,
)

logger = logging.getLogger(__name__)

#: Utterances per tar shard (an upper bound: shards of a folder differ by at most one).
UTTS_PER_FILE = 2000
DEFAULT_FMT = "data-%05d.tar"
DTYPES = ("float32", "float16")
# Records of shards finished by an interrupted run, so a re-run can keep them.
_PARTS_DIR = ".parts"


# --------------------------------------------------------------------------- planning


@dataclasses.dataclass
class _Folder:
    path: Path
    frame_range: FrameRange | None
    table: UtteranceTable
    jobs: list[ShardJob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PackSummary:
    """What `pack_data` did: counts per output folder (name relative to d_out)."""

    num_input: int
    num_utts: dict[str, int]
    num_shards: dict[str, int]
    dropped: dict[str, int]
    shards_written: int
    shards_kept: int


def _split_folders(table: UtteranceTable, d_out: Path, ranges: list[FrameRange] | None,
                   drops: DropLog) -> list[_Folder]:
    if ranges is None:
        return [_Folder(d_out, None, table)]
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
    return [_Folder(d_out / r.name, r, table.select(np.flatnonzero(inside & (group == i))))
            for i, r in enumerate(ranges)]


def _plan(folder: _Folder, fmt: str, utts_per_file: int, seed: int, dtype: str,
          ark_stats: dict[str, list[int]]) -> None:
    table = folder.table
    if not len(table):
        return
    # Seeded per group (not by output path) so adding a group does not reshuffle the others.
    group = "" if folder.frame_range is None else folder.frame_range.name
    rng = np.random.default_rng([seed, zlib.crc32(group.encode("utf-8"))])
    order = rng.permutation(len(table))
    num_shards = math.ceil(len(table) / utts_per_file)
    for shard_index, rows in enumerate(np.array_split(order, num_shards)):
        entries = [(table.keys[i], table.location(i), table.texts[i], int(table.num_frames[i]))
                   for i in rows]
        arks = sorted({table.ark_paths[table.ark_index[i]] for i in rows})
        digest = hashlib.sha256(json.dumps(
            {"version": INDEX_VERSION, "dtype": dtype, "arks": [[a, *ark_stats[a]] for a in arks]},
        ).encode("utf-8"))
        for entry in entries:
            digest.update(json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n")
        folder.jobs.append(ShardJob(str(folder.path / (fmt % shard_index)), entries, dtype,
                                    digest.hexdigest()))


def _prepare_folder(folder: _Folder, name_regex: re.Pattern) -> dict[str, dict[str, Any]]:
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
    parts = folder.path / _PARTS_DIR
    if parts.is_dir():
        for part in sorted(parts.glob("*.json")):
            try:
                record = json.loads(part.read_text(encoding="utf-8"))
                records[record["shard"]] = record
            except (ValueError, KeyError):
                logger.warning("ignoring unreadable record %s", part)
    return records


def _save_part(folder: Path, record: dict[str, Any]) -> None:
    with atomic_write(folder / _PARTS_DIR / f"{record['shard']}.json") as f:
        json.dump(record, f)


def _is_reusable(job: ShardJob, record: dict[str, Any] | None) -> bool:
    path = Path(job.path)
    return (record is not None and record.get("fingerprint") == job.fingerprint
            and path.is_file() and path.stat().st_size == record.get("num_bytes"))


def _reuse_finished(folders: list[_Folder], previous: list[dict[str, dict[str, Any]]]
                    ) -> tuple[list[ShardJob], dict[str, dict[str, Any]]]:
    """Split the plan into shards to write and records of shards kept as they are."""
    pending: list[ShardJob] = []
    records: dict[str, dict[str, Any]] = {}
    for folder, old in zip(folders, previous, strict=True):
        todo = []
        for job in folder.jobs:
            record = old.get(Path(job.path).name)
            if _is_reusable(job, record):
                records[job.path] = record
            else:
                todo.append(job)
        if todo:
            # The old index would describe shards about to change; keep what it vouches for.
            for job in folder.jobs:
                if job.path in records:
                    _save_part(folder.path, records[job.path])
            (folder.path / INDEX_NAME).unlink(missing_ok=True)
        pending += todo
    return pending, records


def _run_jobs(jobs: list[ShardJob], num_jobs: int):
    """Yield `(job, result)` as shards complete."""
    if num_jobs == 1 or len(jobs) <= 1:
        for job in jobs:
            yield job, write_shard(job)
        return
    with process_pool(num_jobs) as pool:
        futures = {pool.submit(write_shard, job): job for job in jobs}
        try:
            for future in concurrent.futures.as_completed(futures):
                yield futures[future], future.result()
        except BrokenProcessPool:
            raise RuntimeError("a packing process died (killed?); completed shards are kept, "
                               "re-run to finish") from None
        finally:
            for future in futures:
                future.cancel()


# --------------------------------------------------------------------------- pack_data


def pack_data(
    f_scps: PathLike | Sequence[PathLike],
    f_labels: PathLike | Sequence[PathLike],
    d_out: PathLike,
    fmt: str = DEFAULT_FMT,
    filter_group: Sequence[str] | None = None,
    *,
    utts_per_file: int = UTTS_PER_FILE,
    num_jobs: int = 1,
    dtype: str = "float32",
    seed: int = 0,
) -> PackSummary:
    """Pack utterances into webdataset tar shards under `d_out` (see the module doc).

    `f_scps`/`f_labels`: a `feats.scp`/`text` path or a list of them, joined by id.
    `fmt`: shard file names (one `%d`-style conversion). `filter_group`: `"lo:hi"`
    length groups in frames, one subfolder each; None writes everything to `d_out`.
    """
    name_regex = shard_name_regex(fmt)
    ranges = _check_options(filter_group, utts_per_file, num_jobs, dtype)
    d_out = Path(d_out)

    drops = DropLog()
    table = load_utterances(f_scps, f_labels, drops)
    num_input = len(table) + len(drops)
    folders = _split_folders(table, d_out, ranges, drops)
    ark_stats = {}
    for ark in table.ark_paths:
        stat = os.stat(ark)
        ark_stats[ark] = [stat.st_size, stat.st_mtime_ns]
    for folder in folders:
        _plan(folder, fmt, utts_per_file, seed, dtype, ark_stats)
    previous = [_prepare_folder(folder, name_regex) for folder in folders]
    drops.write(d_out / DROPPED_NAME)
    if not any(len(folder.table) for folder in folders):
        raise ValueError(f"no utterances left to pack into {d_out} ({drops.summary()}; "
                         f"see {d_out / DROPPED_NAME})")

    pending, records = _reuse_finished(folders, previous)
    _write_pending(pending, num_jobs, records)
    for folder in folders:
        _write_index(folder, records, fmt, utts_per_file, seed, dtype)

    summary = PackSummary(
        num_input=num_input,
        num_utts={_folder_name(f, d_out): len(f.table) for f in folders},
        num_shards={_folder_name(f, d_out): len(f.jobs) for f in folders},
        dropped=drops.counts(), shards_written=len(pending),
        shards_kept=sum(len(f.jobs) for f in folders) - len(pending))
    _log_summary(summary, folders, drops, d_out)
    return summary


def _check_options(filter_group: Sequence[str] | str | None, utts_per_file: int,
                   num_jobs: int, dtype: str) -> list[FrameRange] | None:
    if utts_per_file < 1 or num_jobs < 1:
        raise ValueError(f"utts_per_file ({utts_per_file}) and num_jobs ({num_jobs}) "
                         "must be >= 1")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if isinstance(filter_group, str):
        filter_group = [filter_group]
    return parse_frame_ranges(filter_group) if filter_group else None


def _log_summary(summary: PackSummary, folders: list[_Folder], drops: DropLog,
                 d_out: Path) -> None:
    for folder in folders:
        frames = int(folder.table.num_frames.sum(dtype=np.int64))
        logger.info("%s: %d utterances (%.2f h) in %d shards", folder.path, len(folder.table),
                    frames * FRAME_SHIFT_SECONDS / 3600, len(folder.jobs))
        if not len(folder.table):
            logger.warning("%s: no utterance falls in this group", folder.path)
    logger.info("%d of %d utterances packed (%d shards written, %d kept); %s, listed in %s",
                sum(summary.num_utts.values()), summary.num_input, summary.shards_written,
                summary.shards_kept, drops.summary(), d_out / DROPPED_NAME)


def _folder_name(folder: _Folder, d_out: Path) -> str:
    return "." if folder.path == d_out else folder.path.name


def _write_pending(pending: list[ShardJob], num_jobs: int,
                   records: dict[str, dict[str, Any]]) -> None:
    with tqdm(total=len(pending), unit="shard", desc="packing", disable=None) as progress:
        for job, result in _run_jobs(pending, num_jobs):
            path = Path(job.path)
            record = {"shard": path.name, "num_utts": len(job.entries),
                      "num_frames": sum(e[3] for e in job.entries),
                      "num_bytes": result["num_bytes"], "crc32": result["crc32"],
                      "feat_dim": result["feat_dim"], "fingerprint": job.fingerprint,
                      "keys": [e[0] for e in job.entries], "frames": [e[3] for e in job.entries]}
            _save_part(path.parent, record)
            records[job.path] = record
            progress.update()


def _write_index(folder: _Folder, records: dict[str, dict[str, Any]], fmt: str,
                 utts_per_file: int, seed: int, dtype: str) -> None:
    shards = [records[job.path] for job in folder.jobs]
    dims = {r["feat_dim"] for r in shards}
    if len(dims) > 1:
        raise ValueError(f"{folder.path}: shards have different feature dims {sorted(dims)}")
    header = {
        "format": INDEX_FORMAT, "version": INDEX_VERSION, "fmt": fmt, "dtype": dtype,
        "feat_dim": dims.pop() if dims else None, "utts_per_file": utts_per_file, "seed": seed,
        "frame_range": None if folder.frame_range is None else str(folder.frame_range),
        "num_shards": len(shards), "num_utts": sum(r["num_utts"] for r in shards),
        "num_frames": sum(r["num_frames"] for r in shards),
    }
    fields = ("shard", "num_utts", "num_frames", "num_bytes", "crc32", "fingerprint")
    with atomic_write(folder.path / INDEX_NAME) as f:
        f.write(json.dumps(header) + "\n")
        for record in shards:
            line = {k: record[k] for k in fields}
            line.update(longest=max(record["frames"], default=0), keys=record["keys"],
                        frames=record["frames"])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    shutil.rmtree(folder.path / _PARTS_DIR, ignore_errors=True)


# --------------------------------------------------------------------------- CLI


def pack_experiment(exp_dir: PathLike, num_jobs: int = 1) -> PackSummary | None:
    """The tar shards an experiment streams: `data.train` packed as `data.shards` of its
    `hyper-p.json` says (`dir`, `filter_group`, `dtype`, `utts_per_file`, `seed`), the one
    place the length groups come from. Skipped (None) when they are up to date, or when
    the experiment trains map-style and lists no `data.shards`."""
    path = Path(exp_dir) / HYPER_NAME
    hyper = load_hyper(path)
    data = hyper.get("data", {})
    settings = data.get("shards")
    if not settings:
        if hyper.get("train", {}).get("option", {}).get("large_dataset"):
            raise ValueError(f"{path}: train.option.large_dataset is true, so data.shards "
                             "must say where and how to write the tar shards (e.g. "
                             '{"dir": "data/wds/train", "filter_group": ["10:1000", '
                             '"1000:2000"]})')
        logger.info("%s: no data.shards (map-style training): nothing to pack", path)
        return None
    files = []
    for directory in as_list(data.get("train")):
        for name in ("feats.scp", "text"):
            if not (Path(directory) / name).is_file():
                raise FileNotFoundError(f"{Path(directory) / name} does not exist (data.train "
                                        f"of {path}; run stage 1 first)")
            files.append(Path(directory) / name)
    options = {"filter_group": settings.get("filter_group"),
               "dtype": settings.get("dtype", "float32"),
               "utts_per_file": settings.get("utts_per_file", UTTS_PER_FILE),
               "seed": settings.get("seed", 0)}
    out = Path(settings["dir"])
    sig = signature("shards", options, files=files)
    if is_done(out, sig):
        logger.info("shards in %s are up to date", out)
        return None
    summary = pack_data([str(f) for f in files[0::2]], [str(f) for f in files[1::2]], out,
                        filter_group=options["filter_group"],
                        utts_per_file=options["utts_per_file"], num_jobs=num_jobs,
                        dtype=options["dtype"], seed=options["seed"])
    mark_done(out, sig)
    return summary


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exp = commands.add_parser("pack-exp", help="write the tar shards an experiment streams, "
                                               "as its hyper-p.json data.shards says")
    exp.add_argument("exp_dir", help="experiment directory, e.g. exp/synth-ctc")
    exp.add_argument("--nj", type=int, default=1, help="parallel processes")
    pack = commands.add_parser("pack", help="write tar shards and their index")
    pack.add_argument("--scp", required=True, action="extend", nargs="+",
                      help="feats.scp file(s); repeatable")
    pack.add_argument("--text", required=True, action="extend", nargs="+",
                      help="Kaldi text file(s); repeatable")
    pack.add_argument("--out", required=True, help="output folder")
    pack.add_argument("--filter-group", nargs="*", metavar="LO:HI",
                      help="length groups in frames, one subfolder each (default: none)")
    pack.add_argument("--fmt", default=DEFAULT_FMT, help="shard file name format")
    pack.add_argument("--nj", type=int, default=1, help="parallel processes")
    pack.add_argument("--dtype", default="float32", choices=DTYPES, help="feature dtype")
    pack.add_argument("--seed", type=int, default=0, help="shuffling seed")
    pack.add_argument("--utts-per-file", type=int, default=UTTS_PER_FILE,
                      help="maximum utterances per shard")
    check = commands.add_parser("validate", help="check shards against index.jsonl")
    check.add_argument("directory", help="folder holding index.jsonl and its shards")
    check.add_argument("--nj", type=int, default=1, help="parallel processes")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    args = _build_parser().parse_args(argv)
    setup_logging()
    if args.command == "pack-exp":
        pack_experiment(args.exp_dir, args.nj)
        return
    if args.command == "pack":
        pack_data(args.scp, args.text, args.out, args.fmt, args.filter_group or None,
                  utts_per_file=args.utts_per_file, num_jobs=args.nj, dtype=args.dtype,
                  seed=args.seed)
        return
    problems = validate(args.directory, args.nj)
    for problem in problems:
        logger.error("%s", problem)
    if problems:
        logger.error("%s: %d problems", args.directory, len(problems))
        sys.exit(1)
    logger.info("%s: all shards match %s", args.directory, INDEX_NAME)


if __name__ == "__main__":
    main()
