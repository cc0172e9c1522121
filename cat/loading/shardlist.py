"""The training shard list: `trset` patterns, per-shard counts from the index, rank split.

Shard list (`load_shard_list`): every `trset` pattern is brace-expanded, then globbed and
sorted (`data/wds/train/{10_1000,1000_2000}/data-*.tar`, `.../data-0000{0..9}.tar`);
`http://`, `https://` and `pipe:` URLs are brace-expanded only; store URLs (`s3://`,
`gs://`, `memory://`...) are brace-expanded and globbed by their store
(`cat.storage.stores`). Shards may be gzip-compressed (`.tar.gz`, `.tgz`:
`cat.loading.gunzip`). A pattern that matches nothing is an error naming it. Counts come
from the `index.jsonl` of each shard's folder (`cat.formats.prep_wds`): next to a local
shard or a store object; at the same base URL for http(s) shards, with the shard URL's
query string (presigned or token URLs); and for `pipe:` commands next to the command's
last `.tar` (`.tar.gz`, `.tgz`) argument when that is a local file or an http(s) URL.
Shards without an index are an error unless `utts_per_shard_estimate` is set.

Only what the loader needs is kept, in numpy arrays (one entry per shard): utterance and
frame counts, the longest utterance and the index's CRC-32 of each shard. The index lines
put their long key and frame lists last, so only a short prefix of each line is parsed:
an index of 15 million utterances loads in about a second (`bench/resume.py`).
`ShardList.utterance_frames` reads the per-utterance frame counts of a few shards when
needed (the epoch's coverage report).

Rank split (`assign_shards`): every epoch, on every rank alike, shards are dealt largest
first (ties broken by a generator seeded with `(seed, epoch)`) to the rank with the least
work so far, then each rank's list is shuffled with the same generator. Work is frames
when batches are bounded by frames (`max_frames` > 0) and the index gives frames, else
utterances. Dealing largest first keeps the ranks' loads within one shard of each other,
so the epoch's end, where the first rank out of data stops every rank, leaves at most
about one shard per rank untrained.

Usage:
    shards = load_shard_list(["data/wds/train/10_1000/data-*.tar"])
    plan = assign_shards(shards.num_frames, seed=0, epoch=1, world_size=8)
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import heapq
import json
import logging
import os
import posixpath
import shlex
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from braceexpand import braceexpand

from cat.formats.data_list import DataListError, ShardLine, iter_data_list
from cat.formats.shard_format import (
    CONTENT_FEATURES,
    HTTP_PREFIXES,
    HTTP_TIMEOUT_SECONDS,
    INDEX_NAME,
    LISTS_MARK,
    IndexCounts,
    open_index_lines,
    read_index_counts,
)
from cat.loading.tar import UNINDEXED_MEMBER_LIMIT
from cat.storage.patterns import expand_each
from cat.storage.stores import index_url, is_store_url, object_name, store_for

logger = logging.getLogger(__name__)

RAW_LIST = "rawlist:"
#: Gzip-compressed shards, read with decompression (`cat.loading.gunzip`).
GZIP_SUFFIXES = (".tar.gz", ".tgz")
#: Shard names the loader refuses: tars compressed other than with gzip.
COMPRESSED_SUFFIXES = (".tar.bz2", ".tar.xz", ".tar.zst", ".tbz2", ".txz", ".tzst")
URL_PREFIXES = (*HTTP_PREFIXES, "pipe:", RAW_LIST)
#: Entries of a raw-mode `data.list` read as one (virtual) shard.
RAW_SHARD_UTTS = 100


def is_url(location: str) -> bool:
    """True for `http(s)://`, store (`s3://`, `gs://`, ...), `pipe:` and raw-list
    locations (not local files)."""
    return location.startswith(URL_PREFIXES) or is_store_url(location)


def expand_shard_patterns(patterns: Sequence[str] | str,
                          timeout: float = HTTP_TIMEOUT_SECONDS) -> list[str]:
    """Brace-expand, glob and sort shard patterns, read `.list` files (see the module
    docstring)."""
    return expand_each(patterns, lambda pattern: _checked(pattern, timeout))


def _checked(pattern: str, timeout: float) -> list[str]:
    shards = _expand_one(pattern, timeout)
    for shard in shards:
        if _url_path(shard).endswith(COMPRESSED_SUFFIXES):
            raise ValueError(f"shard {shard} (from {pattern!r}) is not gzip-compressed "
                             "but compressed otherwise; the loader reads plain and "
                             "gzip-compressed (.tar.gz, .tgz) tar shards: decompress it "
                             "(or recompress it with gzip) and index the folder")
    return shards


def _expand_one(pattern: str, timeout: float) -> list[str]:
    if is_store_url(pattern):
        return store_for(pattern, timeout).expand(pattern)
    found: list[str] = []
    for expanded in braceexpand(pattern):
        if is_url(expanded):
            found.append(expanded)
            continue
        matches = sorted(glob.glob(expanded))
        if not matches:
            where = "" if expanded == pattern else f" (expanded: {expanded!r})"
            raise FileNotFoundError(f"trset pattern {pattern!r} matches no shard{where}")
        for match in matches:
            found += read_data_list(match) if match.endswith(".list") else [match]
    return found


def read_data_list(path: str) -> list[str]:
    """The shards of a WeNet `data.list` (`cat.formats.data_list`): its shards in shard
    mode; in raw mode its entries as virtual shards of `RAW_SHARD_UTTS` entries
    (`rawlist:<byte offset>:<entries>:<list>`). Errors name the file and line; raw entries
    need a `txt` for training."""
    shards: list[str] = []
    raw: list[int] = []  # byte offset of each raw entry
    for item in iter_data_list(path):
        if isinstance(item, ShardLine):
            shards.append(item.location)
            continue
        if item.txt is None:
            raise DataListError(f"{item.where}: no 'txt' (the transcript training needs)")
        raw.append(item.offset)
    path = os.path.abspath(path)
    return shards or [f"{RAW_LIST}{raw[i]}:{len(raw[i:i + RAW_SHARD_UTTS])}:{path}"
                      for i in range(0, len(raw), RAW_SHARD_UTTS)]


def raw_list_part(url: str) -> tuple[int, int, str]:
    """`(byte offset, entries, list path)` of a raw-list virtual shard URL."""
    offset, count, path = url[len(RAW_LIST):].split(":", 2)
    return int(offset), int(count), path


def _pipe_tar_word(url: str) -> str | None:
    """The last argument of a `pipe:` command naming a .tar (.tar.gz, .tgz) file or URL."""
    try:
        words = shlex.split(url[len("pipe:"):])
    except ValueError:
        return None
    tars = [w for w in words if _url_path(w).endswith((".tar", *GZIP_SUFFIXES))]
    return tars[-1] if tars else None


def _url_path(location: str) -> str:
    if location.startswith(HTTP_PREFIXES):
        return urllib.parse.unquote(urllib.parse.urlsplit(location).path)
    return location


def shard_name(url: str) -> str:
    """The file name a shard has in its index (`data-00003.tar`), "" when unknown."""
    if url.startswith(RAW_LIST):
        return ""
    if is_store_url(url):
        return object_name(url)
    if url.startswith("pipe:"):
        word = _pipe_tar_word(url)
        return shard_name(word) if word else ""
    return posixpath.basename(_url_path(url)) if url.startswith(HTTP_PREFIXES) \
        else os.path.basename(url)


def index_location(shard: str) -> str | None:
    """Where the `index.jsonl` describing `shard` lives, or None when it cannot be told."""
    if shard.startswith(RAW_LIST):
        return None
    if is_store_url(shard):
        return index_url(shard)
    if shard.startswith(HTTP_PREFIXES):
        parts = urllib.parse.urlsplit(shard)
        path = posixpath.join(posixpath.dirname(parts.path), INDEX_NAME)
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
    if shard.startswith("pipe:"):
        word = _pipe_tar_word(shard)
        if word is not None and (word.startswith(HTTP_PREFIXES) or os.path.isfile(word)):
            return index_location(word)
        return None
    return os.path.join(os.path.dirname(shard), INDEX_NAME)


def _try_read_index(location: str, timeout: float) -> IndexCounts | None:
    try:
        return read_index_counts(location, timeout)
    except FileNotFoundError:
        return None
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise OSError(f"cannot fetch {location}: {error}") from None
    except urllib.error.URLError as error:
        raise OSError(f"cannot fetch {location}: {error.reason}") from None
    except OSError as error:  # an object store: no such key
        if error.errno == errno.ENOENT:
            return None
        raise


@dataclasses.dataclass
class ShardList:
    """Shards of a set with their counts (numpy arrays: one entry per shard)."""

    urls: list[str]
    num_utts: np.ndarray  # int64
    num_frames: np.ndarray  # int64; 0 where unknown
    estimated: np.ndarray  # bool: counts are `utts_per_shard_estimate`
    feat_dim: int | None  # from the index headers, when known
    longest: int  # longest utterance in frames according to the indexes (0 if unknown)
    crc32: list[str] = dataclasses.field(default_factory=list)  # "" where unknown
    timeout: float = HTTP_TIMEOUT_SECONDS
    # Byte offset and length of each shard's line in its index (-1: no index).
    index_spans: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((0, 2), np.int64))
    # What the indexed shards hold ("features" or "audio") -> the first index saying so.
    contents: dict[str, str] = dataclasses.field(default_factory=dict)
    # Bytes of each shard according to its index (0: unknown); bounds a member's size.
    num_bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.urls)

    def member_limit(self, shard: int) -> int:
        """The most bytes a member of `shard` may claim: the shard's size from its index,
        or `UNINDEXED_MEMBER_LIMIT` (also for a gzip-compressed shard, whose index gives
        its compressed size, which its members may exceed)."""
        if shard_name(self.urls[shard]).lower().endswith(GZIP_SUFFIXES):
            return UNINDEXED_MEMBER_LIMIT
        size = int(self.num_bytes[shard]) if len(self.num_bytes) else 0
        return size if size > 0 else UNINDEXED_MEMBER_LIMIT

    def names(self) -> list[str]:
        """Shard file names as their indexes list them."""
        return [shard_name(url) for url in self.urls]

    def identity(self) -> dict[str, Any]:
        """What identifies the data of the list, wherever it is stored: each shard's name,
        counts and CRC-32 (recorded in checkpoints; see `describe_change`)."""
        digest = hashlib.sha256()
        for name, utts, frames, crc in zip(self.names(), self.num_utts.tolist(),
                                           self.num_frames.tolist(), self.crc32, strict=True):
            digest.update(f"{name} {utts} {frames} {crc}\n".encode())
        return {"digest": digest.hexdigest()[:32], "num_shards": len(self),
                "crc32": list(self.crc32), "num_utts": self.num_utts.tolist()}

    def index_entry(self, shard: int) -> dict[str, Any] | None:
        """The whole index record of one shard (keys, frames...), None without an index.

        Reads only that line: a seek in a local index, a Range request over http(s) or S3
        (one attempt: the shard reader retries).
        """
        offset, length = (int(v) for v in self.index_spans[shard]) \
            if len(self.index_spans) else (-1, 0)
        location = index_location(self.urls[shard])
        if offset < 0 or location is None:
            return None
        if is_store_url(location):
            line = store_for(location, self.timeout, 1).read_range(location, offset, length)
        elif location.startswith(HTTP_PREFIXES):
            request = urllib.request.Request(
                location, headers={"Range": f"bytes={offset}-{offset + length - 1}"})
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                if response.status != 206:  # the server sends the whole file
                    response.read(offset)
                line = response.read(length)
        else:
            with open(location, "rb") as f:
                f.seek(offset)
                line = f.read(length)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{location}: the entry of {self.urls[shard]} moved since the "
                             "index was loaded (rewritten while training?)") from None

    def utterance_frames(self, shards: Iterable[int]) -> dict[int, np.ndarray]:
        """Per-utterance frame counts (tar order) of `shards`, from their indexes."""
        wanted: dict[str, dict[str, int]] = {}
        for shard in shards:
            location = index_location(self.urls[shard])
            if location is not None and not self.estimated[shard]:
                wanted.setdefault(location, {})[shard_name(self.urls[shard])] = shard
        frames: dict[int, np.ndarray] = {}
        for location, names in wanted.items():
            for line in open_index_lines(location, self.timeout):
                mark = line.find(LISTS_MARK)
                prefix = json.loads(line[:mark] + b"}") if mark > 0 else json.loads(line)
                shard = names.get(prefix.get("shard")) if isinstance(prefix, dict) else None
                if shard is not None:
                    frames[shard] = np.asarray(json.loads(line)["frames"], np.int64)
        return frames


def describe_change(recorded: dict[str, Any], current: dict[str, Any],
                    urls: Sequence[str]) -> str:
    """What differs between two `ShardList.identity()` records, in words."""
    if recorded.get("num_shards") != current["num_shards"]:
        return f"the shard list has {current['num_shards']} shards, it had " \
               f"{recorded.get('num_shards')}"
    for position, url in enumerate(urls):
        for field in ("crc32", "num_utts"):
            old, new = recorded[field][position], current[field][position]
            if old != new:
                return f"shard {url} changed ({field} {old} -> {new}; repacked?)"
    return "the shard names or order changed"


def load_shard_list(patterns: Sequence[str] | str, utts_per_shard_estimate: int = 0,
                    timeout: float = HTTP_TIMEOUT_SECONDS) -> ShardList:
    """Expand `patterns` and attach per-shard counts from the index files."""
    urls = expand_shard_patterns(patterns, timeout)
    indexes: dict[str, IndexCounts | None] = {}
    num_utts = np.zeros(len(urls), np.int64)
    num_frames = np.zeros(len(urls), np.int64)
    estimated = np.zeros(len(urls), bool)
    crc32 = [""] * len(urls)
    spans = np.full((len(urls), 2), -1, np.int64)
    num_bytes = np.zeros(len(urls), np.int64)
    feat_dims: dict[int, str] = {}
    contents: dict[str, str] = {}
    longest = 0
    for position, url in enumerate(urls):
        if url.startswith(RAW_LIST):
            num_utts[position] = raw_list_part(url)[1]  # exact; no frames, keys or CRC
            continue
        location = index_location(url)
        if location is not None and location not in indexes:
            indexes[location] = _try_read_index(location, timeout)
        index = indexes.get(location) if location is not None else None
        name = shard_name(url)
        if index is not None and name in index.shards:
            num_utts[position], num_frames[position], shard_longest, crc32[position], \
                spans[position, 0], spans[position, 1], num_bytes[position] = index.shards[name]
            longest = max(longest, shard_longest)
            if index.header.get("feat_dim") is not None:
                feat_dims.setdefault(int(index.header["feat_dim"]), location)
            contents.setdefault(index.header.get("content", CONTENT_FEATURES), location)
            continue
        if not utts_per_shard_estimate:
            why = (f"{location} does not list {name!r}" if index is not None
                   else f"no index found at {location}" if location is not None
                   else "its index.jsonl cannot be located")
            raise FileNotFoundError(f"shard {url}: no utterance count ({why}); give the "
                                    "stage-2 index.jsonl next to the shards or set "
                                    "train.option.utts_per_shard_estimate")
        num_utts[position] = utts_per_shard_estimate
        estimated[position] = True
    if len(contents) > 1:
        detail = ", ".join(f"{content} in {where}" for content, where in contents.items())
        raise ValueError(f"trset mixes feature and audio shards: {detail}")
    if len(feat_dims) > 1:
        detail = ", ".join(f"{dim} in {where}" for dim, where in feat_dims.items())
        raise ValueError(f"shards have different feature dimensions: {detail}")
    if estimated.any():
        logger.warning("%d of %d shards have no index entry; assuming %d utterances each "
                       "(a changed shard cannot be detected on resume)",
                       int(estimated.sum()), len(urls), utts_per_shard_estimate)
    return ShardList(urls, num_utts, num_frames, estimated,
                     next(iter(feat_dims)) if feat_dims else None, longest, crc32, timeout,
                     spans, contents, num_bytes)


def assign_shards(weights: np.ndarray, seed: int, epoch: int, world_size: int,
                  shuffle: bool = True) -> list[np.ndarray]:
    """Shard indices of every rank for `epoch`, in reading order (see the module doc).

    Without `shuffle` (evaluation) shards keep their order and go round-robin.
    """
    if not shuffle:
        return [np.arange(rank, len(weights), world_size) for rank in range(world_size)]
    rng = np.random.default_rng([seed, epoch])
    work = np.maximum(np.asarray(weights, np.float64), 1.0)
    order = np.lexsort((rng.random(len(work)), -work))
    # (load, tie-break, rank): ranks of equal load take turns in an order drawn per epoch.
    heap = [(0.0, position, int(rank)) for position, rank in
            enumerate(rng.permutation(world_size))]
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for shard in order.tolist():
        load, position, rank = heapq.heappop(heap)
        assigned[rank].append(shard)
        heapq.heappush(heap, (load + float(work[shard]), position, rank))
    return [np.asarray(a, np.int64)[rng.permutation(len(a))] for a in assigned]
