"""Checking shards against their `index.jsonl`: `python -m cat.formats.prep_wds validate`.

`validate(directory)` reads every shard of a folder in full and compares it with its
index record: size, CRC-32, member names and order, each matrix's shape and dtype, each
transcript's encoding; it also reports shards the index does not list and temporary
files left by an interrupted packing.

Usage:
    problems = validate("data/wds/train/10_1000", num_jobs=2)
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from cat.core.io import PathLike
from cat.core.process import process_pool
from cat.formats.shard_format import (
    INDEX_NAME,
    encode_key,
    read_index,
    shard_name_regex,
    temporary_regex,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- validation

_MAX_PROBLEMS_PER_SHARD = 10


def check_shard(path: PathLike, record: dict[str, Any], dtype: str,
                feat_dim: int | None) -> list[str]:
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
    problems += _check_members(path, record, np.dtype(dtype), feat_dim)
    return problems[:_MAX_PROBLEMS_PER_SHARD]


def _check_members(path: Path, record: dict[str, Any], dtype: np.dtype,
                   feat_dim: int | None) -> list[str]:
    problems: list[str] = []
    expected = [(encode_key(k), ext) for k in record["keys"] for ext in ("npy", "txt")]
    position = 0
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if position >= len(expected):
                    problems.append(f"{path}: unexpected extra member {member.name!r}")
                    break
                name, ext = expected[position]
                utt = record["keys"][position // 2]
                if member.name != f"{name}.{ext}" or not member.isfile():
                    problems.append(f"{path}: member {position} is {member.name!r}, "
                                    f"expected {name}.{ext}")
                    break
                data = tar.extractfile(member).read()
                if ext == "npy":
                    problems += _check_npy(path, utt, data, record["frames"][position // 2],
                                           dtype, feat_dim)
                else:
                    try:
                        if not data.decode("utf-8").strip():
                            problems.append(f"{path}: {utt}: empty transcript")
                    except UnicodeDecodeError:
                        problems.append(f"{path}: {utt}: transcript is not UTF-8")
                position += 1
                if len(problems) >= _MAX_PROBLEMS_PER_SHARD:
                    return problems
    except (tarfile.TarError, OSError, EOFError) as error:
        problems.append(f"{path}: unreadable tar after {position} members: {error}")
        return problems
    if position < len(expected) and not problems:
        problems.append(f"{path}: ends after {position} of {len(expected)} members "
                        f"({record['num_utts']} utterances; truncated?)")
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
    name_regex = shard_name_regex(index.header["fmt"])
    listed = {record["shard"] for record in index.shards}
    temporary = temporary_regex(name_regex)
    for entry in sorted(os.listdir(directory)):
        if name_regex.fullmatch(entry) and entry not in listed:
            problems.append(f"{directory / entry}: shard not listed in {INDEX_NAME}")
        elif temporary.fullmatch(entry):
            problems.append(f"{directory / entry}: leftover temporary file")
    tasks = [(directory / r["shard"], r, index.header["dtype"], index.header["feat_dim"])
             for r in index.shards]
    if num_jobs == 1:
        results = map(_check_shard_args, tasks)
        for result in results:
            problems += result
    else:
        with process_pool(num_jobs) as pool:
            for result in pool.map(_check_shard_args, tasks):
                problems += result
    return problems
