"""An `index.jsonl` for tar shards another tool wrote: `python -m cat.formats.prep_wds index`.

WeNet UIO shards (and any tar of `<key>.<ext>` + `<key>.txt` members, `<ext>` one of
`wav`, `flac`, `opus` or `npy`) stream with exact counts once their folder has an index.
`index_folder(directory)` reads every `*.tar` (also `*.tar.gz`, `*.tgz`) of the folder
in full, in name order, and writes the index `cat.formats.shard_format` describes:
per shard its utterances (consecutive members grouped by the name before the LAST dot,
as WeNet reads them; keys are kept exactly as the member names hold them, never
escaped or unescaped), their frames (fbank frames of the audio at 16 kHz, from
decoding it with `cat.audio.codec.decode`; rows of an `.npy`), the tar's size and
CRC-32. The header says `"key_encoding": "none"`, and for audio the one
`audio_format` and `sample_rate` of all members (null when they differ; the loader
resamples to 16 kHz anyway). A member that is not UTF-8 text, undecodable audio, an
unknown extension, a key without its transcript or audio, or a key in two places is an
error naming the shard and member.

A folder whose index our packer wrote is refused (`validate` checks it). A re-run
whose shards all have the sizes and modification times of the last index keeps it.

Usage:
    index = index_folder("/data/wenet/shards", num_jobs=4)
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
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
    CONTENT_FEATURES,
    INDEX_FORMAT,
    INDEX_NAME,
    INDEX_VERSION,
    KEY_ENCODING_NONE,
    ShardIndex,
    read_index,
    split_member_name,
)
from cat.formats.shard_pack import hours, write_index_lines

logger = logging.getLogger(__name__)
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_NUMBERED = re.compile(r"(?P<prefix>.*?)(?P<number>\d+)\.tar")


class _CrcReader:
    """A file read through tarfile's stream mode, counting the CRC-32 of its bytes."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.crc32 = 0
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        return data


def shard_fingerprint(path: Path) -> str:
    """Identifies a shard file's version by its size and modification time."""
    stat = path.stat()
    return hashlib.sha256(f"{stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()


class _Utterance:
    """The members of one key seen so far."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.text: str | None = None
        self.extension: str | None = None
        self.frames = 0


def _add_member(path: Path, utterance: _Utterance, name: str, extension: str, data: bytes,
                facts: dict[str, set]) -> None:
    where = f"{path}: member {name!r}"
    if extension == "txt":
        if utterance.text is not None:
            raise ValueError(f"{where}: a second transcript of key {utterance.key!r}")
        try:
            utterance.text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: the transcript is not UTF-8") from None
        return
    if extension not in (*codec.FORMATS, "npy"):
        raise ValueError(f"{where}: unknown extension {extension!r}; expected txt, npy or "
                         f"one of {codec.FORMATS}")
    if utterance.extension is not None:
        raise ValueError(f"{where}: key {utterance.key!r} already has a "
                         f".{utterance.extension} member")
    utterance.extension = extension
    if extension == "npy":
        try:
            array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError) as error:
            raise ValueError(f"{where}: unreadable npy: {error}") from None
        if array.ndim != 2:
            raise ValueError(f"{where}: a {array.ndim}-dim array, expected [frames, dim]")
        utterance.frames = int(array.shape[0])
        facts["feat_dims"].add(int(array.shape[1]))
        facts["dtypes"].add(str(array.dtype))
        return
    waveform, rate = codec.decode(data, name=f"{path}:{name}")
    utterance.frames = num_frames(resampled_length(len(waveform), rate, SAMPLE_RATE))
    facts["audio_formats"].add(extension)
    facts["sample_rates"].add(rate)


def _finish(path: Path, utterance: _Utterance, record: dict[str, Any]) -> None:
    if utterance.text is None or utterance.extension is None:
        has = "a transcript" if utterance.extension is None else f"a .{utterance.extension}"
        raise ValueError(f"{path}: key {utterance.key!r} has only {has} member "
                         "(a shard holds <key>.txt and <key>.<audio or npy> per utterance)")
    record["keys"].append(utterance.key)
    record["frames"].append(utterance.frames)


def index_shard(path: PathLike) -> dict[str, Any]:
    """The index record of one shard, plus what it holds (`content` and its facts)."""
    path = Path(path)
    record: dict[str, Any] = {"shard": path.name, "keys": [], "frames": []}
    facts: dict[str, set] = {"audio_formats": set(), "sample_rates": set(),
                             "feat_dims": set(), "dtypes": set()}
    seen: set[str] = set()
    current: _Utterance | None = None
    with open(path, "rb") as raw:
        reader = _CrcReader(raw)
        try:
            with tarfile.open(fileobj=reader, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    key, extension = split_member_name(member.name)
                    if current is None or key != current.key:
                        if current is not None:
                            _finish(path, current, record)
                        if key in seen:
                            raise ValueError(f"{path}: member {member.name!r}: key {key!r} "
                                             "also has members earlier, not next to these")
                        seen.add(key)
                        current = _Utterance(key)
                    _add_member(path, current, member.name, extension,
                                tar.extractfile(member).read(), facts)
        except (tarfile.TarError, EOFError) as error:
            raise ValueError(f"{path}: unreadable shard: {error}") from None
        if current is not None:
            _finish(path, current, record)
        while reader.read(1 << 20):  # what follows the end of the archive
            pass
    contents = {CONTENT_FEATURES if facts["feat_dims"] else None,
                CONTENT_AUDIO if facts["audio_formats"] else None} - {None}
    if len(contents) > 1:
        raise ValueError(f"{path}: holds both audio and .npy features")
    record.update(num_utts=len(record["keys"]), num_frames=sum(record["frames"]),
                  num_bytes=reader.size, crc32=f"{reader.crc32:08x}",
                  fingerprint=shard_fingerprint(path),
                  content=contents.pop() if contents else None,
                  **{name: sorted(values) for name, values in facts.items()})
    return record


def _shard_name_format(names: list[str]) -> str | None:
    """`data-%05d.tar` when every name is one prefix and a zero-padded number."""
    matches = [_NUMBERED.fullmatch(name) for name in names]
    if not all(matches) or len({(m["prefix"], len(m["number"])) for m in matches}) != 1:
        return None
    prefix, width = matches[0]["prefix"], len(matches[0]["number"])
    return f"{prefix.replace('%', '%%')}%0{width}d.tar"


def _one(values: set, name: str, directory: Path) -> Any:
    if len(values) > 1:
        logger.warning("%s: shards hold more than one %s (%s): the index says null", directory,
                       name, ", ".join(map(str, sorted(values))))
    return next(iter(values)) if len(values) == 1 else None


def index_folder(directory: PathLike, num_jobs: int = 1) -> ShardIndex:
    """Write `directory/index.jsonl` for the shards in it (see the module doc)."""
    directory = Path(directory)
    shards = sorted(p for p in directory.iterdir()
                    if p.is_file() and p.name.endswith(SHARD_SUFFIXES)
                    and not p.name.startswith("."))
    if not shards:
        raise FileNotFoundError(f"{directory}: no *.tar, *.tar.gz or *.tgz shards")
    old = _previous_index(directory)
    if old is not None and [r["shard"] for r in old.shards] == [p.name for p in shards] and \
            all(r["fingerprint"] == shard_fingerprint(p) for r, p in zip(old.shards, shards,
                                                                       strict=True)):
        logger.info("%s is up to date", directory / INDEX_NAME)
        return old
    if num_jobs == 1 or len(shards) == 1:
        records = [index_shard(path) for path in shards]
    else:
        with process_pool(min(num_jobs, len(shards))) as pool:
            records = list(pool.map(index_shard, shards))
    _check_keys_unique(directory, records)
    header = _header(directory, shards, records)
    write_index_lines(directory, header, records)
    logger.info("%s: %d shards, %d utterances, %.2f h", directory / INDEX_NAME, len(records),
                header["num_utts"], hours(header["num_frames"]))
    return read_index(directory)


def _check_keys_unique(directory: Path, records: list[dict[str, Any]]) -> None:
    """Refuse a key in two shards: the loader would train that utterance twice an epoch."""
    first: dict[str, str] = {}
    for record in records:
        for key in record["keys"]:
            shard = first.setdefault(key, record["shard"])
            if shard != record["shard"]:
                raise ValueError(f"{directory}: key {key!r} is in shards {shard} and "
                                 f"{record['shard']}: an utterance must be in one shard "
                                 "(it would be trained twice per epoch); remove one")


def _previous_index(directory: Path) -> ShardIndex | None:
    if not (directory / INDEX_NAME).is_file():
        return None
    try:
        old = read_index(directory)
    except ValueError:
        return None
    if old.header.get("key_encoding") != KEY_ENCODING_NONE:
        raise FileExistsError(f"{directory / INDEX_NAME} was written by the packer (its keys "
                              "are escaped in the member names); check it with validate")
    return old


def _header(directory: Path, shards: list[Path], records: list[dict[str, Any]]
            ) -> dict[str, Any]:
    contents = {r["content"] for r in records} - {None}
    if len(contents) > 1:
        audio = next(p for p, r in zip(shards, records, strict=True)
                     if r["content"] == CONTENT_AUDIO)
        features = next(p for p, r in zip(shards, records, strict=True)
                        if r["content"] == CONTENT_FEATURES)
        raise ValueError(f"{directory}: {audio.name} holds audio, {features.name} features; "
                         "index them in separate folders")
    content = contents.pop() if contents else CONTENT_AUDIO

    def union(name: str) -> set:
        return {value for record in records for value in record[name]}

    if content == CONTENT_AUDIO:
        fields = {"audio_format": _one(union("audio_formats"), "audio format", directory),
                  "bitrate": None,
                  "sample_rate": _one(union("sample_rates"), "sample rate", directory),
                  "feat_dim": None}
    else:
        dims = union("feat_dims")
        if len(dims) > 1:
            raise ValueError(f"{directory}: shards hold features of dims {sorted(dims)}")
        fields = {"dtype": _one(union("dtypes"), "dtype", directory), "feat_dim": dims.pop()}
    return {"format": INDEX_FORMAT, "version": INDEX_VERSION,
            "fmt": _shard_name_format([p.name for p in shards]), "content": content,
            "key_encoding": KEY_ENCODING_NONE, **fields, "utts_per_file": None, "seed": None,
            "frame_range": None, "num_shards": len(records),
            "num_utts": sum(r["num_utts"] for r in records),
            "num_frames": sum(r["num_frames"] for r in records)}
