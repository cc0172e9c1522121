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

`pack-audio` packs audio shards instead, from Kaldi data dirs (`cat.formats.audio_pack`:
16 kHz `wav`/`flac`/`opus` members and transcripts, WeNet UIO compatible; the loader
computes the features). `pack-exp` packs what an experiment streams: its
`hyper-p.json`'s `data.train` as `data.shards` says, the one place its length groups
come from, audio when `data.shards.audio` names a format (`pack_experiment`). `index`
writes the index of shards another tool wrote (`cat.formats.shard_index`).

With `--cmd` (the recipe's `$train_cmd`, `cat.core.launch`), the shards still to write are
dealt to `--nj` tasks of one array job (a Slurm array with the slurm backend) (logs
`<out>/log/pack.<task>.log`); the index is written here once all are done, and a re-run
after a failed task writes only the shards that are missing.

Usage:
    python -m cat.formats.prep_wds pack-exp exp/synth-ctc --nj 4
    python -m cat.formats.prep_wds pack-exp exp/synth-ctc --nj 40 --cmd "$train_cmd"
    python -m cat.formats.prep_wds pack --scp data/train/feats.scp --text data/train/text \
        --out data/wds/train --filter-group 10:1000 1000:2000 --nj 4
    python -m cat.formats.prep_wds pack-audio --data data/train_l --out data/wds_audio/train_l \
        --format opus --bitrate 32000 --filter-group 10:1000 1000:2000 --nj 4
    python -m cat.formats.prep_wds validate data/wds/train/10_1000
    python -m cat.formats.prep_wds index /data/wenet/shards --nj 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kaldiio
import numpy as np

from cat.audio import codec
from cat.core.config import HYPER_NAME, as_list, load_hyper
from cat.core.io import PathLike, setup_logging
from cat.core.launch import ArrayJobError, Launcher, LaunchError, add_cmd_argument
from cat.core.stages import is_done, mark_done, signature
from cat.formats.audio_pack import pack_audio
from cat.formats.shard_check import validate
from cat.formats.shard_format import (
    CONTENT_FEATURES,
    DROPPED_NAME,
    INDEX_NAME,
    INDEX_VERSION,
    shard_name_regex,
)
from cat.formats.shard_index import index_folder
from cat.formats.shard_pack import (
    DEFAULT_FMT,
    UTTS_PER_FILE,
    Folder,
    PackSummary,
    check_options,
    folder_name,
    log_summary,
    prepare_folder,
    reuse_finished,
    split_folders,
    write_index,
    write_pending,
)
from cat.formats.shard_writer import ShardJob, write_shard
from cat.formats.tables import DropLog, load_utterances

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16")
#: Feature bytes one core packs per second, to plan worker processes: the rate measured on
#: a loaded 2-core VM (bench/README.md, bench/pack.py; about 1,000 MB/s when idle).
PACK_BYTES_PER_SECOND = 400e6


# --------------------------------------------------------------------------- planning


def _plan(folder: Folder, fmt: str, utts_per_file: int, seed: int, dtype: str,
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
    launcher: Launcher | None = None,
) -> PackSummary:
    """Pack utterances into webdataset tar shards under `d_out` (see the module doc).

    `f_scps`/`f_labels`: a `feats.scp`/`text` path or a list of them, joined by id.
    `fmt`: shard file names (one `%d`-style conversion). `filter_group`: `"lo:hi"`
    length groups in frames, one subfolder each; None writes everything to `d_out`.
    """
    name_regex = shard_name_regex(fmt)
    ranges = check_options(filter_group, utts_per_file, num_jobs)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    d_out = Path(d_out)

    drops = DropLog()
    table = load_utterances(f_scps, f_labels, drops)
    num_input = len(table) + len(drops)
    folders = split_folders(table, d_out, ranges, drops)
    ark_stats = {}
    for ark in table.ark_paths:
        stat = os.stat(ark)
        ark_stats[ark] = [stat.st_size, stat.st_mtime_ns]
    for folder in folders:
        _plan(folder, fmt, utts_per_file, seed, dtype, ark_stats)
    previous = [prepare_folder(folder, name_regex) for folder in folders]
    drops.write(d_out / DROPPED_NAME)
    if not any(len(folder.table) for folder in folders):
        raise ValueError(f"no utterances left to pack into {d_out} ({drops.summary()}; "
                         f"see {d_out / DROPPED_NAME})")

    pending, records = reuse_finished(folders, previous)
    # The estimate reads one matrix: only when workers are possible at all.
    write_pending(pending, num_jobs, records, write_shard, _record_of,
                  lambda: _work_seconds(pending, dtype), launcher, d_out / "log")
    # Utterances the shard writer left out (non-finite features): in the drop log too.
    non_finite = {}
    for folder in folders:
        for job in folder.jobs:
            written = set(records[job.path]["keys"])
            for key, _, _, _ in job.entries:
                if key not in written:
                    non_finite[key] = records[job.path].get("dropped", {}).get(key, "")
        if non_finite:
            kept = [i for i, key in enumerate(folder.table.keys) if key not in non_finite]
            folder.table = folder.table.select(kept)
    for key, verdict in sorted(non_finite.items()):
        drops.add(key, "non_finite", verdict.partition(" ")[2])
    if non_finite:
        drops.write(d_out / DROPPED_NAME)
    for folder in folders:
        dims = {records[job.path]["feat_dim"] for job in folder.jobs}
        if len(dims) > 1:
            raise ValueError(f"{folder.path}: shards have different feature dims {sorted(dims)}")
        write_index(folder, records, {"fmt": fmt, "content": CONTENT_FEATURES, "dtype": dtype,
                                      "feat_dim": dims.pop() if dims else None},
                    utts_per_file, seed)

    summary = PackSummary(
        num_input=num_input,
        num_utts={folder_name(f, d_out): len(f.table) for f in folders},
        num_shards={folder_name(f, d_out): len(f.jobs) for f in folders},
        dropped=drops.counts(), shards_written=len(pending),
        shards_kept=sum(len(f.jobs) for f in folders) - len(pending),
        num_frames={folder_name(f, d_out): int(f.table.num_frames.sum(dtype=np.int64))
                    for f in folders})
    log_summary(summary, folders, drops, d_out, DROPPED_NAME)
    return summary


def _work_seconds(pending: list[ShardJob], dtype: str) -> float | None:
    """Single-core seconds the pending shards take (their feature bytes at the measured
    packing speed), from one utterance's feature dim; None when it cannot be read (the
    shard writer then says why)."""
    if not pending:
        return 0.0
    try:
        dim = kaldiio.load_mat(pending[0].entries[0][1]).shape[1]
    except Exception:  # kaldiio signals bad data with asserts, struct and OS errors
        return None
    frames = sum(entry[3] for job in pending for entry in job.entries)
    return frames * dim * np.dtype(dtype).itemsize / PACK_BYTES_PER_SECOND


def _record_of(job: ShardJob, result: dict[str, Any]) -> dict[str, Any]:
    dropped = dict(result.get("dropped", []))
    entries = [entry for entry in job.entries if entry[0] not in dropped]
    frames = [entry[3] for entry in entries]
    return {"num_utts": len(entries), "num_frames": sum(frames),
            "num_bytes": result["num_bytes"], "crc32": result["crc32"],
            "feat_dim": result["feat_dim"], "keys": [entry[0] for entry in entries],
            "frames": frames, "dropped": dropped}


# --------------------------------------------------------------------------- CLI


def pack_experiment(exp_dir: PathLike, num_jobs: int = 1,
                    launcher: Launcher | None = None) -> PackSummary | None:
    """The tar shards an experiment streams: `data.train` packed as `data.shards` of its
    `hyper-p.json` says (`dir`, `filter_group`, `dtype`, `utts_per_file`, `seed`), the one
    place the length groups come from. With `data.shards.audio` (`{"format": "opus",
    "bitrate": 32000}`) `data.train` names Kaldi data dirs (`wav.scp`, `text`, optional
    `segments`) packed as audio shards (`cat.formats.audio_pack.pack_audio`); without,
    feature dirs (`feats.scp`, `text`). Skipped (None) when they are up to date, or when
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
    audio = settings.get("audio")
    if audio is not None and "dtype" in settings:
        raise ValueError(f"{path}: data.shards.dtype is the dtype of feature shards; with "
                         "data.shards.audio the shards hold audio")
    directories = [Path(d) for d in as_list(data.get("train"))]
    files = _experiment_inputs(directories, audio is not None, path)
    options = {"filter_group": settings.get("filter_group"),
               "utts_per_file": settings.get("utts_per_file", UTTS_PER_FILE),
               "seed": settings.get("seed", 0)}
    if audio is None:
        options["dtype"] = settings.get("dtype", "float32")
    else:
        options["audio"] = {"format": audio["format"], "bitrate": audio.get("bitrate")}
    out = Path(settings["dir"])
    sig = signature("shards", options, files=files)
    if is_done(out, sig):
        logger.info("shards in %s are up to date", out)
        return None
    if audio is None:
        summary = pack_data([str(d / "feats.scp") for d in directories],
                            [str(d / "text") for d in directories], out,
                            filter_group=options["filter_group"],
                            utts_per_file=options["utts_per_file"], num_jobs=num_jobs,
                            dtype=options["dtype"], seed=options["seed"], launcher=launcher)
    else:
        summary = pack_audio(directories, out, audio["format"],
                             opus_bitrate=audio.get("bitrate"),
                             filter_group=options["filter_group"],
                             utts_per_file=options["utts_per_file"], num_jobs=num_jobs,
                             seed=options["seed"], launcher=launcher)
    mark_done(out, sig)
    return summary


def _experiment_inputs(directories: list[Path], audio: bool, hyper_path: Path) -> list[Path]:
    """The files of `data.train` that packing reads (their signature decides a re-run)."""
    if not directories:
        raise ValueError(f"{hyper_path}: data.shards needs data.train")
    files = []
    for directory in directories:
        for name in ("wav.scp", "text") if audio else ("feats.scp", "text"):
            if not (directory / name).is_file():
                hint = "a Kaldi data dir, as data.shards.audio asks" if audio else \
                    "run stage 1 first"
                raise FileNotFoundError(f"{directory / name} does not exist (data.train of "
                                        f"{hyper_path}; {hint})")
            files.append(directory / name)
        if audio and (directory / "segments").is_file():
            files.append(directory / "segments")
    return files


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exp = commands.add_parser("pack-exp", help="write the tar shards an experiment streams, "
                                               "as its hyper-p.json data.shards says")
    exp.add_argument("exp_dir", help="experiment directory, e.g. exp/synth-ctc")
    exp.add_argument("--nj", type=int, default=1, help="parallel processes (cluster jobs)")
    add_cmd_argument(exp)
    pack = commands.add_parser("pack", help="write feature tar shards and their index")
    pack.add_argument("--scp", required=True, action="extend", nargs="+",
                      help="feats.scp file(s); repeatable")
    pack.add_argument("--text", required=True, action="extend", nargs="+",
                      help="Kaldi text file(s); repeatable")
    pack.add_argument("--dtype", default="float32", choices=DTYPES, help="feature dtype")
    audio = commands.add_parser("pack-audio", help="write audio tar shards and their index")
    audio.add_argument("--data", required=True, action="extend", nargs="+",
                       help="Kaldi data dir(s) with wav.scp, text, optional segments; "
                            "repeatable")
    audio.add_argument("--format", default="opus", choices=codec.FORMATS,
                       help="audio format of the members")
    audio.add_argument("--bitrate", type=int,
                       help=f"Opus bitrate in bit/s (default {codec.DEFAULT_OPUS_BITRATE})")
    for command in (pack, audio):
        command.add_argument("--out", required=True, help="output folder")
        command.add_argument("--filter-group", nargs="*", metavar="LO:HI",
                             help="length groups in frames, one subfolder each "
                                  "(default: none)")
        command.add_argument("--fmt", default=DEFAULT_FMT, help="shard file name format")
        command.add_argument("--nj", type=int, default=1,
                             help="parallel processes (cluster jobs)")
        add_cmd_argument(command)
        command.add_argument("--seed", type=int, default=0, help="shuffling seed")
        command.add_argument("--utts-per-file", type=int, default=UTTS_PER_FILE,
                             help="maximum utterances per shard")
    check = commands.add_parser("validate", help="check shards against index.jsonl")
    check.add_argument("directory", help="folder holding index.jsonl and its shards")
    check.add_argument("--nj", type=int, default=1, help="parallel processes")
    index = commands.add_parser("index", help="write index.jsonl for shards another tool "
                                              "wrote (WeNet UIO)")
    index.add_argument("directory", help="folder holding the shards (*.tar)")
    index.add_argument("--nj", type=int, default=1, help="parallel processes")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    args = _build_parser().parse_args(argv)
    setup_logging()
    try:
        _run(args)
    except (ArrayJobError, LaunchError) as error:
        logger.error("%s", error)
        sys.exit(1)


def _run(args: argparse.Namespace) -> None:
    if args.command == "pack-exp":
        pack_experiment(args.exp_dir, args.nj, Launcher.from_cmd(args.cmd))
    elif args.command == "pack":
        pack_data(args.scp, args.text, args.out, args.fmt, args.filter_group or None,
                  utts_per_file=args.utts_per_file, num_jobs=args.nj, dtype=args.dtype,
                  seed=args.seed, launcher=Launcher.from_cmd(args.cmd))
    elif args.command == "pack-audio":
        pack_audio(args.data, args.out, args.format, opus_bitrate=args.bitrate, fmt=args.fmt,
                   filter_group=args.filter_group or None, utts_per_file=args.utts_per_file,
                   num_jobs=args.nj, seed=args.seed, launcher=Launcher.from_cmd(args.cmd))
    elif args.command == "index":
        index_folder(args.directory, args.nj)
    else:
        _validate(args.directory, args.nj)


def _validate(directory: str, num_jobs: int) -> None:
    problems = validate(directory, num_jobs)
    for problem in problems:
        logger.error("%s", problem)
    if problems:
        logger.error("%s: %d problems", directory, len(problems))
        sys.exit(1)
    logger.info("%s: all shards match %s", directory, INDEX_NAME)


if __name__ == "__main__":
    main()
