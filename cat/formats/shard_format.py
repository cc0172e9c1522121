"""The tar shard format: member names, the key codec and the `index.jsonl` of a folder.

One place for what the writers (`cat.formats.prep_wds`, `cat.formats.audio_pack`) and
the readers (`cat.loading.shardlist`, `cat.loading.stream`) must agree on:

* a folder holds one kind of shard (the index header's `content`):
  `features`: members `<encode_key(utt)>.npy` (the feature matrix) and
  `<encode_key(utt)>.txt` (transcript); `audio`: `<encode_key(utt)>.<audio_format>`
  (16 kHz mono `wav`, `flac` or `opus`, `cat.audio.codec`) and `<encode_key(utt)>.txt`,
  as WeNet UIO shards hold them. An index without `content` is a feature index;
* webdataset splits member names at the first dot, so ids such as
  `sp0.9-BAC009S0002W0122` are escaped: `%` -> `%25`, `.` -> `%2E`, `/` -> `%2F`
  (`decode_key` reverses it). Shards written by another tool (WeNet UIO: keys such as
  `A/B/utt.1`) are indexed as they are (`python -m cat.formats.prep_wds index`): their
  header says `"key_encoding": "none"`, their keys are the member names up to the LAST
  dot (`split_member_name`), and either member of a key may come first;
* `index.jsonl`, written last: line 1 is a header `{"format": "cat-wds-index",
  "version": 1, "fmt", "content", <content fields>, "utts_per_file", "seed",
  "frame_range", "num_shards", "num_utts", "num_frames"}`, the content fields being
  `"dtype", "feat_dim"` for features and `"audio_format", "bitrate", "sample_rate":
  16000, "feat_dim": null` for audio; then one line per shard
  `{"shard", "num_utts", "num_frames", "num_bytes", "crc32", "fingerprint", "longest",
  "keys", "frames"}` (keys and frame counts in tar order; for audio, the fbank frame
  count of the 16 kHz audio, `cat.features.fbank.num_frames`; `crc32` of the whole tar
  file as 8 hex digits; `longest` the most frames of an utterance). The long lists
  come last, so that `read_index_counts` parses only a short prefix of each line;
* `read_index` reads and checks a whole index (errors name the file and line);
  `read_index_counts` only the counts, the CRC-32 and where each shard's line is.

Usage:
    index = read_index("data/wds/train/10_1000")
    counts = read_index_counts("data/wds/train/10_1000/index.jsonl")
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cat.audio.codec import FORMATS as AUDIO_FORMATS
from cat.core.io import PathLike
from cat.storage.stores import is_store_url, store_for

logger = logging.getLogger(__name__)
INDEX_NAME = "index.jsonl"
# What the packer left out of a folder, with reasons (`<utt> <reason> [detail]`).
DROPPED_NAME = "dropped.txt"
HTTP_PREFIXES = ("http://", "https://")
HTTP_TIMEOUT_SECONDS = 60.0
INDEX_FORMAT = "cat-wds-index"
INDEX_VERSION = 1
# What the shards of a folder hold (the header's "content"; absent: features).
CONTENT_FEATURES = "features"
CONTENT_AUDIO = "audio"
CONTENTS = (CONTENT_FEATURES, CONTENT_AUDIO)
# How member names hold the keys (the header's "key_encoding"; absent: escaped).
KEY_ENCODING_ESCAPED = "escaped"
KEY_ENCODING_NONE = "none"
_KEY_ESCAPES = {"%": "%25", ".": "%2E", "/": "%2F"}
_KEY_UNESCAPES = {v: k for k, v in _KEY_ESCAPES.items()}
_ESCAPED = re.compile(r"%(?:25|2E|2F)")
_ESCAPE_TABLE = str.maketrans(_KEY_ESCAPES)


# --------------------------------------------------------------------------- keys


def shard_name_regex(fmt: str) -> re.Pattern:
    """The names a shard name format (`data-%05d.tar`) gives; a bad format is an error."""
    conversions = re.findall(r"%[^%]*?[a-zA-Z]", fmt.replace("%%", ""))
    if len(conversions) != 1 or not re.fullmatch(r"%0?\d*d", conversions[0]) \
            or not fmt.endswith(".tar") or "/" in fmt:
        raise ValueError(f"invalid shard name format {fmt!r}: expected one integer "
                         "conversion such as 'data-%05d.tar', ending in .tar, no '/'")
    before, _, after = fmt.partition(conversions[0])
    return re.compile(re.escape(before.replace("%%", "%")) + r"\d+"
                      + re.escape(after.replace("%%", "%")))


def temporary_regex(name_regex: re.Pattern) -> re.Pattern:
    """Names `atomic_write` gives our shards, index and drop list while they are written."""
    return re.compile(rf"\.(?:{name_regex.pattern}|{re.escape(INDEX_NAME)}|"
                      rf"{re.escape(DROPPED_NAME)})\.tmp\.\d+")


def encode_key(key: str) -> str:
    """Escape `key` for a tar member name that webdataset groups correctly."""
    return key.translate(_ESCAPE_TABLE)


def decode_key(name: str) -> str:
    """Inverse of `encode_key`; a `%` not starting a known escape is an error."""
    if "%" in _ESCAPED.sub("", name):
        raise ValueError(f"{name!r} is not an encoded key (stray '%')")
    return _ESCAPED.sub(lambda m: _KEY_UNESCAPES[m.group(0)], name)


def split_member_name(name: str) -> tuple[str, str]:
    """`(key, extension)` of a member name, split at the LAST dot (as WeNet reads UIO).

    Our own member names hold no dot before the extension, so both readings agree.
    """
    key, dot, extension = name.rpartition(".")
    if not dot or not key or "/" in extension:
        raise ValueError(f"member {name!r} has no extension")
    return key, extension


# --------------------------------------------------------------------------- index


@dataclasses.dataclass
class ShardIndex:
    """Contents of one folder's `index.jsonl`."""

    directory: Path
    header: dict[str, Any]
    shards: list[dict[str, Any]]

    @property
    def num_utts(self) -> int:
        """Utterances in all shards."""
        return int(self.header["num_utts"])

    @property
    def num_frames(self) -> int:
        """Frames in all shards."""
        return int(self.header["num_frames"])

    @property
    def content(self) -> str:
        """`features` or `audio`."""
        return self.header.get("content", CONTENT_FEATURES)

    def member_key(self, key: str) -> str:
        """The name of `key`'s members, before their extension."""
        if self.header.get("key_encoding", KEY_ENCODING_ESCAPED) == KEY_ENCODING_NONE:
            return key
        return encode_key(key)

    def paths(self) -> list[Path]:
        """Shard files in index order."""
        return [self.directory / record["shard"] for record in self.shards]


_SHARD_FIELDS = {"shard": str, "num_utts": int, "num_frames": int, "num_bytes": int,
                 "crc32": str, "fingerprint": str, "keys": list, "frames": list}


def read_index(directory: PathLike) -> ShardIndex:
    """Read and check `directory/index.jsonl`; errors name the file and line."""
    path = Path(directory) / INDEX_NAME
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:1: not JSON: {error}") from None
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT \
            or header.get("version") != INDEX_VERSION:
        raise ValueError(f"{path}:1: not a {INDEX_FORMAT} version {INDEX_VERSION} header")
    _check_content(path, header)
    shards = []
    for lineno, line in enumerate(lines[1:], 2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{lineno}: not JSON: {error}") from None
        for field, kind in _SHARD_FIELDS.items():
            if not isinstance(record.get(field), kind):
                raise ValueError(f"{path}:{lineno}: field {field!r} missing or not {kind.__name__}")
        if not len(record["keys"]) == len(record["frames"]) == record["num_utts"] \
                or sum(record["frames"]) != record["num_frames"] \
                or record.get("longest", max(record["frames"], default=0)) \
                != max(record["frames"], default=0):
            raise ValueError(f"{path}:{lineno}: {record['shard']}: num_utts, num_frames, "
                             "longest, keys and frames disagree")
        shards.append(record)
    if len(shards) != header.get("num_shards") \
            or sum(r["num_utts"] for r in shards) != header.get("num_utts"):
        raise ValueError(f"{path}: header totals disagree with the {len(shards)} shard lines")
    return ShardIndex(Path(directory), header, shards)


def _check_content(path: Path, header: dict[str, Any]) -> None:
    content = header.get("content", CONTENT_FEATURES)
    if content not in CONTENTS:
        raise ValueError(f"{path}:1: content {content!r} is not one of {CONTENTS}")
    encoding = header.get("key_encoding", KEY_ENCODING_ESCAPED)
    if encoding not in (KEY_ENCODING_ESCAPED, KEY_ENCODING_NONE):
        raise ValueError(f"{path}:1: key_encoding {encoding!r} is not "
                         f"{KEY_ENCODING_ESCAPED!r} or {KEY_ENCODING_NONE!r}")
    if content != CONTENT_AUDIO:
        return
    audio_format, rate = header.get("audio_format"), header.get("sample_rate")
    # null: shards of another tool that mix formats or sample rates.
    if audio_format is not None and audio_format not in AUDIO_FORMATS:
        raise ValueError(f"{path}:1: audio_format {audio_format!r} is not one of "
                         f"{AUDIO_FORMATS} (or null)")
    if rate is not None and (not isinstance(rate, int) or rate <= 0):
        raise ValueError(f"{path}:1: sample_rate {rate!r} is not a positive integer (or null)")


# Each index line holds the counts first, then these long lists (see the module docstring).
LISTS_MARK = b', "keys": '


def open_index_lines(location: str, timeout: float = HTTP_TIMEOUT_SECONDS) -> Iterator[bytes]:
    """The lines (bytes) of an index: a local file, an http(s) URL or a store object
    (`s3://`, `gs://`, ...: `cat.storage.stores`)."""
    if is_store_url(location):
        with io.BufferedReader(store_for(location, timeout).open(location), 1 << 20) as reader:
            yield from reader
        return
    if location.startswith(HTTP_PREFIXES):
        with urllib.request.urlopen(location, timeout=timeout) as response:
            yield from response
        return
    with open(location, "rb") as f:
        yield from f


@dataclasses.dataclass(frozen=True)
class IndexCounts:
    """What one `index.jsonl` says about its shards (counts only, no keys)."""

    header: dict[str, Any]
    # name -> (utts, frames, longest, crc32, byte offset of its line, length of the line,
    # bytes of the shard: 0 where the index does not say)
    shards: dict[str, tuple[int, int, int, str, int, int, int]]


_COUNT_FIELDS = ("shard", "num_utts", "num_frames", "longest", "crc32")


def _shard_record(line: bytes) -> dict[str, Any]:
    mark = line.find(LISTS_MARK)
    record = json.loads(line[:mark] + b"}") if mark > 0 else {}
    if not all(field in record for field in _COUNT_FIELDS):
        # Another field order, or an index written before `longest` existed.
        record = json.loads(line)
        record.setdefault("longest", max(record.get("frames") or [0]))
    return record


def read_index_counts(location: str, timeout: float = HTTP_TIMEOUT_SECONDS) -> IndexCounts:
    """The header and per-shard counts of one `index.jsonl` (errors name file and line)."""
    header: dict[str, Any] | None = None
    shards: dict[str, tuple[int, int, int, str, int, int, int]] = {}
    offset = 0
    for lineno, line in enumerate(open_index_lines(location, timeout), 1):
        start, offset = offset, offset + len(line)
        try:
            if header is None:
                header = json.loads(line)
                if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
                    raise ValueError(f"{location}:1: not a {INDEX_FORMAT} header")
                continue
            record = _shard_record(line)
            shards[record["shard"]] = (int(record["num_utts"]), int(record["num_frames"]),
                                       int(record["longest"]), str(record["crc32"]), start,
                                       len(line), int(record.get("num_bytes") or 0))
        except json.JSONDecodeError as error:
            raise ValueError(f"{location}:{lineno}: not JSON: {error}") from None
        except (KeyError, TypeError) as error:
            raise ValueError(f"{location}:{lineno}: bad shard record: {error!r}") from None
    if header is None:
        raise ValueError(f"{location}: empty index")
    return IndexCounts(header, shards)
