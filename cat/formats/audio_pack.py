"""Stage 2 (large corpora, audio): Kaldi data dirs into audio tar shards with an index.

`pack_audio` packs what `cat.formats.audio_tables.load_audio_utterances` reads of one
or more data dirs (`wav.scp`, optional `segments`, `text`) into webdataset tar shards
whose members are, per utterance, `<key>.<format>` (16 kHz mono `wav`, `flac` or
`opus`, one format per folder) and `<key>.txt` (the transcript, UTF-8): WeNet UIO
compatible, the keys escaped as in the feature shards (`cat.formats.shard_format`).
The loader computes the fbank; each utterance's `frames` in the index are the frame
count of its 16 kHz audio (`cat.features.fbank.num_frames`), so length groups and the
balancing of ranks work by duration as for feature shards.

As for feature shards (`cat.formats.prep_wds.pack_data`), length groups (`filter_group`,
in frames) go to subfolders `lo_hi`, shard contents are decided up front and seeded (the
same output for any `num_jobs`), each tar is written under a temporary name and renamed
when complete, a re-run keeps the finished shards whose inputs (entries, options, the
audio files' sizes and mtimes) are unchanged, each folder's `index.jsonl` is written
last, a WeNet shard-mode `data.list` (one absolute shard path per line,
`cat.formats.data_list`) just before it, and `d_out/dropped.txt` lists every utterance
left out, with its reason (`no_label`, `no_audio`, `empty_label`, `bad_audio`,
`bad_segment`, `too_short`, `out_of_range`). The index header says `"content": "audio"`,
`"audio_format"`, `"bitrate"` (Opus only, else null), `"sample_rate": 16000` and
`"feat_dim": null`.

Shard contents: within each length group the recordings are shuffled (seeded) and
each recording's utterances follow in time order, so that a job decodes each of its
recordings once (a recording may continue into the next shard; that job decodes it
again). Without `segments` every recording is one utterance, so this is a shuffle of
utterances. Utterances of one recording sit together in a shard: the loader's shuffle
buffer mixes them with the other shards' (keep it above a few recordings' segments).

Usage:
    summary = pack_audio(["data/train_l"], "data/wds_audio/train_l", "opus",
                         filter_group=["10:1000", "1000:2000"], num_jobs=4)
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cat.audio import codec
from cat.core.io import PathLike, iter_table
from cat.core.launch import Launcher
from cat.features.plan import DEFAULT_MAX_OVERSHOOT
from cat.formats.audio_tables import SAMPLE_RATE, AudioTable, load_audio_utterances
from cat.formats.audio_writer import AudioShardJob, write_audio_shard
from cat.formats.data_list import DATA_LIST_NAME, write_shard_list
from cat.formats.shard_format import CONTENT_AUDIO, DROPPED_NAME, INDEX_VERSION, shard_name_regex
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
from cat.formats.tables import DropLog

logger = logging.getLogger(__name__)


def _recording_runs(table: AudioTable, rng: np.random.Generator) -> np.ndarray:
    """Rows grouped by recording (in time order), the recordings in a seeded order."""
    if np.unique(table.recording).size == len(table):
        return rng.permutation(len(table))  # one utterance per recording (rows by id)
    rows = np.arange(len(table))
    # By recording, then start time, then id (rows are sorted by id).
    order = np.lexsort((rows, table.starts, table.recording))
    firsts = np.flatnonzero(np.diff(table.recording[order], prepend=-1))
    runs = np.split(order, firsts[1:])
    # Recordings in the order of their first utterance id, so that the shuffle does not
    # depend on how the wav.scp files number them.
    runs.sort(key=lambda run: int(run.min()))
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])


def _plan(folder: Folder, fmt: str, utts_per_file: int, seed: int, audio_format: str,
          opus_bitrate: int | None, max_overshoot: float) -> None:
    table: AudioTable = folder.table
    if not len(table):
        return
    group = "" if folder.frame_range is None else folder.frame_range.name
    rng = np.random.default_rng([seed, zlib.crc32(group.encode("utf-8"))])
    order = _recording_runs(table, rng)
    frame_range = (0, None) if folder.frame_range is None else \
        (folder.frame_range.low, folder.frame_range.high)
    num_shards = math.ceil(len(table) / utts_per_file)
    for shard_index, rows in enumerate(np.array_split(order, num_shards)):
        numbers: dict[int, int] = {}
        for i in rows:
            numbers.setdefault(int(table.recording[i]), len(numbers))
        recordings = [table.recordings[n] for n in numbers]
        entries = [(table.keys[i], numbers[int(table.recording[i])], float(table.starts[i]),
                    float(table.ends[i]), table.texts[i], int(table.num_frames[i]))
                   for i in rows]
        digest = hashlib.sha256(json.dumps(
            {"version": INDEX_VERSION, "content": CONTENT_AUDIO, "format": audio_format,
             "bitrate": opus_bitrate, "sample_rate": SAMPLE_RATE,
             "max_overshoot": max_overshoot, "frame_range": list(frame_range),
             "recordings": [[r.spec, r.stat] for r in recordings]},
            ensure_ascii=False).encode("utf-8"))
        for entry in entries:
            digest.update(json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n")
        folder.jobs.append(AudioShardJob(
            str(folder.path / (fmt % shard_index)), entries, [r.spec for r in recordings],
            audio_format, opus_bitrate or codec.DEFAULT_OPUS_BITRATE, max_overshoot,
            frame_range, digest.hexdigest()))


def _read_dropped(path: Path) -> dict[str, str]:
    """A previous run's drop list (utterance -> reason and detail); empty if none."""
    try:
        return dict(iter_table(path, allow_empty_value=True))
    except (OSError, ValueError):
        return {}


def _attach_drops(folders: list[Folder], previous: list[dict[str, dict[str, Any]]],
                  old_drops: dict[str, str]) -> None:
    """Give each reusable record of an index the drops its shard's writer made.

    An index record lists what its shard holds; the utterances planned for it but not
    in it were dropped while writing it, with reasons the last `dropped.txt` kept. A
    record whose reasons are lost is forgotten, so that its shard is written again.
    """
    for folder, records in zip(folders, previous, strict=True):
        for job in folder.jobs:
            name = Path(job.path).name
            record = records.get(name)
            if record is None or "dropped" in record or \
                    record.get("fingerprint") != job.fingerprint:
                continue
            missing = set(e[0] for e in job.entries) - set(record["keys"])
            if all(utt in old_drops for utt in missing):
                record["dropped"] = [[utt, old_drops[utt]] for utt in sorted(missing)]
            else:
                del records[name]


def _record_of(job: AudioShardJob, result: dict[str, Any]) -> dict[str, Any]:
    return {"num_utts": len(result["keys"]), "num_frames": sum(result["frames"]),
            "num_bytes": result["num_bytes"], "crc32": result["crc32"], "feat_dim": None,
            "keys": result["keys"], "frames": result["frames"], "dropped": result["dropped"],
            "conversions": result["conversions"]}


def _write_data_list(folder: Folder) -> None:
    """The folder's shards as a WeNet shard-mode `data.list` (none for an empty folder)."""
    path = folder.path / DATA_LIST_NAME
    if folder.jobs:
        write_shard_list(path, [job.path for job in folder.jobs])
    else:
        path.unlink(missing_ok=True)


def check_audio_options(audio_format: str, opus_bitrate: int | None) -> int | None:
    """The Opus bitrate to use (None for `wav`/`flac`); bad values are errors."""
    if audio_format not in codec.FORMATS:
        raise ValueError(f"audio format must be one of {codec.FORMATS}, got {audio_format!r}")
    if audio_format != "opus":
        if opus_bitrate is not None:
            raise ValueError(f"a bitrate is for opus; {audio_format} is lossless")
        return None
    bitrate = codec.DEFAULT_OPUS_BITRATE if opus_bitrate is None else int(opus_bitrate)
    codec.opus_compression_level(bitrate)  # raises for a bitrate Opus cannot take
    return bitrate


def pack_audio(
    data_dirs: PathLike | Sequence[PathLike],
    d_out: PathLike,
    audio_format: str = "opus",
    *,
    opus_bitrate: int | None = None,
    fmt: str = DEFAULT_FMT,
    filter_group: Sequence[str] | None = None,
    utts_per_file: int = UTTS_PER_FILE,
    num_jobs: int = 1,
    seed: int = 0,
    max_overshoot: float = DEFAULT_MAX_OVERSHOOT,
    launcher: Launcher | None = None,
) -> PackSummary:
    """Pack the utterances of Kaldi data dirs into audio shards under `d_out`.

    `audio_format`: `wav`, `flac` or `opus` (`opus_bitrate` in bit/s, default
    `cat.audio.codec.DEFAULT_OPUS_BITRATE`). `filter_group`: `"lo:hi"` length groups in
    16 kHz fbank frames, one subfolder each. See the module doc for the rest.
    """
    name_regex = shard_name_regex(fmt)
    ranges = check_options(filter_group, utts_per_file, num_jobs)
    bitrate = check_audio_options(audio_format, opus_bitrate)
    d_out = Path(d_out)

    drops = DropLog()
    table = load_audio_utterances(data_dirs, drops, num_jobs, max_overshoot)
    num_input = len(table) + len(drops)
    folders = split_folders(table, d_out, ranges, drops)
    for folder in folders:
        _plan(folder, fmt, utts_per_file, seed, audio_format, bitrate, max_overshoot)
    if not any(len(folder.table) for folder in folders):
        drops.write(d_out / DROPPED_NAME)
        raise ValueError(f"no utterances left to pack into {d_out} ({drops.summary()}; "
                         f"see {d_out / DROPPED_NAME})")
    previous = [prepare_folder(folder, name_regex) for folder in folders]
    _attach_drops(folders, previous, _read_dropped(d_out / DROPPED_NAME))

    pending, records = reuse_finished(folders, previous)
    write_pending(pending, num_jobs, records, write_audio_shard, _record_of,
                  launcher=launcher, log_dir=Path(d_out) / "log")
    conversions: collections.Counter = collections.Counter()
    for job in pending:
        conversions.update(records[job.path].get("conversions", {}))
    for message, count in sorted(conversions.items()):
        logger.warning("%d %s", count, message)
    for folder in folders:
        for job in folder.jobs:
            for utt, reason in records[job.path]["dropped"]:
                drops.add(utt, reason)
    drops.write(d_out / DROPPED_NAME)
    for folder in folders:
        _write_data_list(folder)
        write_index(folder, records, {
            "fmt": fmt, "content": CONTENT_AUDIO, "audio_format": audio_format,
            "bitrate": bitrate, "sample_rate": SAMPLE_RATE, "feat_dim": None},
            utts_per_file, seed)

    packed = {folder_name(f, d_out): [records[job.path] for job in f.jobs] for f in folders}
    summary = PackSummary(
        num_input=num_input,
        num_utts={name: sum(r["num_utts"] for r in shards) for name, shards in packed.items()},
        num_shards={name: len(shards) for name, shards in packed.items()},
        dropped=drops.counts(), shards_written=len(pending),
        shards_kept=sum(len(f.jobs) for f in folders) - len(pending),
        num_frames={name: sum(r["num_frames"] for r in shards)
                    for name, shards in packed.items()})
    log_summary(summary, folders, drops, d_out, DROPPED_NAME)
    if not sum(summary.num_utts.values()):
        raise ValueError(f"no utterance of {d_out} could be packed ({drops.summary()}; see "
                         f"{d_out / DROPPED_NAME})")
    return summary
