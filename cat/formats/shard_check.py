"""Checking shards against their `index.jsonl`: `python -m cat.formats.prep_wds validate`.

`validate(directory)` reads every shard of a folder in full (gzip-compressed ones,
`.tar.gz`/`.tgz`, decompressed; their size and CRC-32 are those of the compressed file)
and compares it with its index record: size, CRC-32, member names and order, each
transcript's encoding, and each utterance's data: a feature matrix's shape and dtype, or
an audio member decoded (`cat.audio.codec.decode`) with the frame count the index lists
(fbank frames of the audio at 16 kHz) and the folder's sample rate. It also reports
shards the index does not list and temporary files left by an interrupted packing.

Usage:
    problems = validate("data/wds/train/10_1000", num_jobs=2)
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from cat.audio import codec
from cat.core.io import PathLike
from cat.core.process import process_pool
from cat.features.fbank import num_frames
from cat.formats.audio_tables import SAMPLE_RATE, resampled_length
from cat.formats.shard_format import (
    CONTENT_AUDIO,
    INDEX_NAME,
    KEY_ENCODING_NONE,
    ShardIndex,
    encode_key,
    read_index,
    shard_name_regex,
    split_member_name,
    temporary_regex,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- validation

_MAX_PROBLEMS_PER_SHARD = 10


@dataclasses.dataclass(frozen=True)
class FolderKind:
    """What a folder's index says its members are."""

    content: str = "features"
    dtype: str = "float32"
    feat_dim: int | None = None
    # Audio: the one extension, or None for any of codec.FORMATS; the sample rate, if one.
    audio_format: str | None = None
    sample_rate: int | None = None
    # Shards of another tool: keys verbatim, either member of a key first.
    verbatim: bool = False

    @classmethod
    def of(cls, index: ShardIndex) -> FolderKind:
        header = index.header
        return cls(index.content, header.get("dtype") or "float32", header.get("feat_dim"),
                   header.get("audio_format"), header.get("sample_rate"),
                   header.get("key_encoding") == KEY_ENCODING_NONE)

    def data_extensions(self) -> tuple[str, ...]:
        if self.content != CONTENT_AUDIO:
            return ("npy",)
        return (self.audio_format,) if self.audio_format else codec.FORMATS


def check_shard(path: PathLike, record: dict[str, Any], kind: FolderKind) -> list[str]:
    """Problems of one shard against its index record (empty when it is sound)."""
    path = Path(path)
    if not path.is_file():
        return [f"{path}: missing"]
    problems = []
    size = path.stat().st_size
    if size != record["num_bytes"]:
        problems.append(f"{path}: {size} bytes, index says {record['num_bytes']}")
    crc32 = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc32 = zlib.crc32(chunk, crc32)
    if f"{crc32:08x}" != record["crc32"]:
        problems.append(f"{path}: crc32 differs from the index")
    problems += _check_members(path, record, kind)
    return problems[:_MAX_PROBLEMS_PER_SHARD]


def _member_problem(path: Path, position: int, name: str, prefix: str, kind: FolderKind,
                    seen: str | None) -> str | None:
    """Why member `position` cannot be the one the index expects there (None: it can)."""
    extensions = kind.data_extensions()
    if kind.verbatim:
        try:
            key, extension = split_member_name(name)
        except ValueError:
            key, extension = name, ""
        if key == prefix and extension in (*extensions, "txt") and extension != seen \
                and (seen is None or "txt" in (seen, extension)):
            return None
        return (f"{path}: member {position} is {name!r}, expected {prefix}.txt or "
                f"{prefix}.{'/'.join(extensions)}")
    if seen is None:
        if any(name == f"{prefix}.{extension}" for extension in extensions):
            return None
        return f"{path}: member {position} is {name!r}, expected {prefix}.{extensions[0]}"
    return None if name == f"{prefix}.txt" else \
        f"{path}: member {position} is {name!r}, expected {prefix}.txt"


def _check_members(path: Path, record: dict[str, Any], kind: FolderKind) -> list[str]:
    problems: list[str] = []
    keys = record["keys"]
    prefixes = keys if kind.verbatim else [encode_key(k) for k in keys]
    num_members = 2 * len(keys)
    position = 0
    seen: str | None = None
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if position >= num_members:
                    problems.append(f"{path}: unexpected extra member {member.name!r}")
                    break
                utt = keys[position // 2]
                problem = _member_problem(path, position, member.name,
                                          prefixes[position // 2], kind, seen)
                if problem is None and not member.isfile():
                    problem = f"{path}: member {position} ({member.name!r}) is not a file"
                if problem:
                    problems.append(problem)
                    break
                extension = member.name.rpartition(".")[2]
                data = tar.extractfile(member).read()
                problems += _check_data(path, member.name, utt, extension, data,
                                        record["frames"][position // 2], kind)
                seen = None if position % 2 else extension
                position += 1
                if len(problems) >= _MAX_PROBLEMS_PER_SHARD:
                    return problems
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        problems.append(f"{path}: unreadable tar after {position} members: {error}")
        return problems
    if position < num_members and not problems:
        problems.append(f"{path}: ends after {position} of {num_members} members "
                        f"({record['num_utts']} utterances; truncated?)")
    return problems


def _check_data(path: Path, name: str, utt: str, extension: str, data: bytes, frames: int,
                kind: FolderKind) -> list[str]:
    if extension == "txt":
        try:
            if not data.decode("utf-8").strip():
                return [f"{path}: {utt}: empty transcript"]
        except UnicodeDecodeError:
            return [f"{path}: {utt}: transcript is not UTF-8"]
        return []
    if extension == "npy":
        return _check_npy(path, utt, data, frames, np.dtype(kind.dtype), kind.feat_dim)
    return _check_audio(path, name, utt, data, frames, kind.sample_rate)


def _check_audio(path: Path, name: str, utt: str, data: bytes, frames: int,
                 sample_rate: int | None) -> list[str]:
    try:
        waveform, rate = codec.decode(data, name=f"{path}:{name}")
    except codec.AudioDecodeError as error:
        return [str(error)]
    problems = []
    if sample_rate is not None and rate != sample_rate:
        problems.append(f"{path}: {utt}: {rate} Hz audio, index says {sample_rate} Hz")
    count = num_frames(resampled_length(len(waveform), rate, SAMPLE_RATE))
    if count != frames:
        problems.append(f"{path}: {utt}: {len(waveform)} samples at {rate} Hz are {count} "
                        f"frames, index says {frames}")
    return problems


def _check_npy(path: Path, utt: str, data: bytes, frames: int, dtype: np.dtype,
               feat_dim: int | None) -> list[str]:
    try:
        array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as error:
        return [f"{path}: {utt}: unreadable npy: {error}"]
    if array.ndim != 2 or array.shape[0] != frames or \
            (feat_dim is not None and array.shape[1] != feat_dim):
        return [f"{path}: {utt}: shape {array.shape}, index says ({frames}, {feat_dim})"]
    if array.dtype != dtype:
        return [f"{path}: {utt}: dtype {array.dtype}, index says {dtype}"]
    return []


def _check_shard_args(args: tuple) -> list[str]:
    return check_shard(*args)


def validate(directory: PathLike, num_jobs: int = 1) -> list[str]:
    """Check every shard of `directory` against its index; returns the problems found."""
    directory = Path(directory)
    try:
        index = read_index(directory)
    except (OSError, ValueError) as error:
        return [str(error)]
    problems = []
    if index.header.get("fmt"):  # shards of another tool may follow no name pattern
        name_regex = shard_name_regex(index.header["fmt"])
        listed = {record["shard"] for record in index.shards}
        temporary = temporary_regex(name_regex)
        for entry in sorted(os.listdir(directory)):
            if name_regex.fullmatch(entry) and entry not in listed:
                problems.append(f"{directory / entry}: shard not listed in {INDEX_NAME}")
            elif temporary.fullmatch(entry):
                problems.append(f"{directory / entry}: leftover temporary file")
    kind = FolderKind.of(index)
    tasks = [(directory / r["shard"], r, kind) for r in index.shards]
    if num_jobs == 1:
        results = map(_check_shard_args, tasks)
        for result in results:
            problems += result
    else:
        with process_pool(num_jobs) as pool:
            for result in pool.map(_check_shard_args, tasks):
                problems += result
    return problems
