"""WeNet `data.list` files: what they may hold, and one strict reader for training and decoding.

A `data.list` names data one entry per line, in one of two modes (the first non-empty
line decides; mixing them is an error):

* shard mode: a tar shard (`.tar`, or gzip-compressed `.tar.gz`/`.tgz`) per line, a
  path (relative paths are relative to the list's folder), an `http(s)://` URL, a store
  URL (`s3://`, `gs://`, ...: `cat.storage.stores`), or a `pipe:` command;
* raw mode: a JSON object per line, `{"key": ..., "wav": <audio path>, "txt": ...}`,
  optionally with `"start"` and `"end"` in seconds (a piece of the file; end -1: the
  file's end). A relative `wav` is relative to the list's folder. `txt` is what training
  needs; decoding does not read it.

Every error names the list and line: text that is not UTF-8, a line that is not JSON or
not an object, a missing or non-string `key`/`wav`, a key that is empty or holds
whitespace (a `<key> <text>` line cannot hold it), a non-numeric `start`/`end`, a key
given twice, an empty list.

`write_shard_list` writes a shard-mode list (stage 2 writes one, `data.list`, next to
each audio-shard folder's `index.jsonl`, for WeNet to read the shards with).

`iter_raw_entries` yields each raw entry with its byte offset, so a reader can come back
to a line later (`read_raw_entries`) without holding the list in memory.

Usage:
    listing = read_data_list("data/train/data.list")
    if listing.raw: ...  # listing.entries: RawEntry(key, wav, txt, start, end, where, offset)
    else: ...            # listing.shards: [ShardLine(location, "data.list:3"), ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

from cat.core.io import PathLike, atomic_write
from cat.storage.stores import is_store_url

#: The file name of the list stage 2 writes next to each audio-shard folder's index.
DATA_LIST_NAME = "data.list"
#: Locations that are not paths on this machine.
URL_PREFIXES = ("http://", "https://", "s3://", "pipe:")


class DataListError(ValueError):
    """A malformed data.list; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class RawEntry:
    """One raw-mode line: the utterance `key`, its audio file `wav` (made absolute),
    transcript `txt` (None when absent), the piece `start` to `end` seconds, `where`
    (`list:line`) and the line's byte `offset`."""

    key: str
    wav: str
    txt: str | None
    start: float
    end: float
    where: str
    offset: int


@dataclasses.dataclass(frozen=True)
class ShardLine:
    """One shard-mode line: the shard's `location` (resolved) and `where` (`list:line`)."""

    location: str
    where: str


@dataclasses.dataclass(frozen=True)
class DataList:
    """A whole list: `shards` in shard mode, else raw `entries`."""

    path: str
    shards: list[ShardLine]
    entries: list[RawEntry]

    @property
    def raw(self) -> bool:
        return bool(self.entries)


def check_key(key: Any, where: str) -> str:
    """`key` when it can be an utterance id, else DataListError naming `where`."""
    if key is None:
        raise DataListError(f"{where}: 'key' is missing")
    if not isinstance(key, str) or not key or any(char.isspace() for char in key):
        raise DataListError(f"{where}: key {key!r} is empty, not a string or holds "
                            "whitespace, which a `<key> <text>` line cannot hold")
    return key


def resolve(location: str, folder: str) -> str:
    """A list's location: URLs and absolute paths as they are, others under `folder`."""
    if location.startswith(URL_PREFIXES) or is_store_url(location) or os.path.isabs(location):
        return location
    return os.path.join(folder, location)


def parse_raw_entry(line: bytes | str, where: str, folder: str, offset: int = 0) -> RawEntry:
    """The entry of one raw-mode line (see the module docstring)."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        entry = json.loads(text)
    except UnicodeDecodeError as error:
        raise DataListError(f"{where}: not UTF-8 ({error})") from None
    except ValueError as error:
        raise DataListError(f"{where}: not JSON: {error}") from None
    if not isinstance(entry, dict):
        raise DataListError(f"{where}: not a JSON object")
    key = check_key(entry.get("key"), where)
    if not isinstance(entry.get("wav"), str) or not entry["wav"]:
        raise DataListError(f"{where}: 'wav' is missing or not a string")
    txt = entry.get("txt")
    if txt is not None and not isinstance(txt, str):
        raise DataListError(f"{where}: 'txt' is not a string")
    bounds = []
    for name, default in (("start", 0.0), ("end", -1.0)):
        value = entry.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise DataListError(f"{where}: '{name}' is not a number of seconds: {value!r}")
        bounds.append(float(value))
    return RawEntry(key, resolve(entry["wav"], folder), txt, bounds[0], bounds[1], where,
                    offset)


def _lines(path: str) -> Iterator[tuple[int, int, str]]:
    """(line number, byte offset, stripped text) of the non-empty lines."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            try:
                text = line.decode("utf-8").strip()
            except UnicodeDecodeError as error:
                raise DataListError(f"{path}:{lineno}: not UTF-8 ({error})") from None
            if text:
                yield lineno, start, text


def iter_data_list(path: PathLike) -> Iterator[ShardLine | RawEntry]:
    """A `ShardLine` or a `RawEntry` per line, checked as a whole list is (one mode, keys
    once); locations and `wav` paths resolved against the list's folder."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    mode = None
    first: dict[str, str] = {}
    for lineno, offset, text in _lines(path):
        where = f"{path}:{lineno}"
        line_mode = "raw" if text.startswith("{") else "shard"
        if mode is None:
            mode = (line_mode, lineno)
        elif line_mode != mode[0]:
            raise DataListError(f"{where}: the list mixes shard paths and raw JSON entries "
                                f"(line {mode[1]} is {mode[0]}-mode); keep one kind per "
                                "data.list")
        if line_mode == "shard":
            yield ShardLine(resolve(text, folder), where)
            continue
        entry = parse_raw_entry(text, where, folder, offset)
        if entry.key in first:
            raise DataListError(f"{where}: key {entry.key!r} again (first at "
                                f"{first[entry.key]})")
        first[entry.key] = where
        yield entry
    if mode is None:
        raise DataListError(f"{path}: an empty data.list")


def read_data_list(path: PathLike) -> DataList:
    """The whole list (see `iter_data_list`)."""
    shards: list[ShardLine] = []
    entries: list[RawEntry] = []
    for item in iter_data_list(path):
        if isinstance(item, ShardLine):
            shards.append(item)
        else:
            entries.append(item)
    return DataList(str(path), shards, entries)


def read_raw_entries(path: PathLike, offset: int, count: int) -> list[RawEntry]:
    """`count` raw entries of the list from byte `offset` on (an offset `iter_data_list`
    gave), read again; an error if the list ends or changed kind before that."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    entries: list[RawEntry] = []
    with open(path, "rb") as f:
        f.seek(offset)
        position = offset
        while len(entries) < count:
            line = f.readline()
            if not line:
                raise DataListError(f"{path} ends before its entry {len(entries) + 1} of "
                                    f"{count} from byte {offset} (changed since it was read?)")
            start, position = position, position + len(line)
            if line.strip():
                entries.append(parse_raw_entry(line, f"{path} at byte {start}", folder, start))
    return entries


def write_shard_list(path: PathLike, shards: list[PathLike]) -> None:
    """A shard-mode `data.list` at `path` (written atomically): one absolute shard path
    per line, as WeNet reads them from any working directory."""
    with atomic_write(path) as f:
        f.writelines(f"{os.path.abspath(shard)}\n" for shard in shards)
