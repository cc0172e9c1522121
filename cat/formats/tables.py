"""Utterance tables of stage 2: Kaldi `feats.scp` + `text` joined by id, drops, verdicts.

Shared by both stage-2 writers, the map-style pack (`cat.formats.mappack`) and the tar
shards (`cat.formats.prep_wds`), and by the loaders:

* `FrameRange` (`"lo:hi"`, half-open frame ranges) and `parse_frame_ranges`;
* `DropLog`: utterances left out, each with a reason, written as `<utt> <reason> [detail]`;
* `read_feature_index`: a `feats.scp` (one or more) as an `UtteranceTable` of ark paths,
  offsets and frame counts (from `utt2num_frames`, else the matrix headers), without
  loading a matrix; errors name the scp line;
* `load_utterances`: features and transcripts joined by utterance id, never by line
  order, with `no_label`, `no_features` and `empty_label` drops;
* `transcript_verdict`: why a transcript is not trained (`empty_label`, `no_tokens`,
  `all_unk`), the one rule of the map-style packer and the streaming loader;
  `feature_verdict`: features with NaN or infinite values (`non_finite`), the rule of
  both packers and both loaders.

Usage:
    drops = DropLog()
    table = load_utterances("data/fbank/train/feats.scp", "data/fbank/train/text", drops)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import re
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import kaldiio
import numpy as np
from kaldiio.compression_header import GlobalHeader
from kaldiio.matio import read_token

from cat.core.io import (
    PathLike,
    TableError,
    iter_table,
    read_table,
    write_table,
)
from cat.text.tokenizer import UNK_ID

logger = logging.getLogger(__name__)
FRAME_SHIFT_SECONDS = 0.01
_ARK_LOCATION = re.compile(r"^(?P<ark>.*\S):(?P<offset>\d+)$")


# --------------------------------------------------------------------------- frame ranges


@dataclasses.dataclass(frozen=True)
class FrameRange:
    """Half-open interval `[low, high)` of frame counts; `high=None` has no upper bound.

    Parsed from `"lo:hi"`: `"10:1000"`, `":1000"` (low 0), `"1000:"` (no upper bound).
    `name` is the shard subfolder: `10_1000`, `0_1000`, `1000_`.
    """

    low: int = 0
    high: int | None = None

    def __post_init__(self) -> None:
        if self.low < 0 or (self.high is not None and self.high <= self.low):
            raise ValueError(f"invalid frame range {self}: need 0 <= lo < hi")

    @classmethod
    def parse(cls, spec: str) -> FrameRange:
        """Parse `"lo:hi"` (either side may be empty)."""
        low, sep, high = spec.strip().partition(":")
        if not sep or ":" in high or not re.fullmatch(r"\d*", low) \
                or not re.fullmatch(r"\d*", high):
            raise ValueError(f"invalid frame range {spec!r}: expected 'lo:hi' with "
                             "non-negative integers, either one may be empty")
        if low and high and int(high) <= int(low):
            raise ValueError(f"invalid frame range {spec!r}: hi must be greater than lo")
        return cls(int(low or 0), int(high) if high else None)

    def __contains__(self, num_frames: object) -> bool:
        if not isinstance(num_frames, (int, np.integer)):
            return False
        return self.low <= num_frames and (self.high is None or num_frames < self.high)

    def mask(self, num_frames: np.ndarray) -> np.ndarray:
        """Boolean mask of the counts inside the range."""
        inside = num_frames >= self.low
        if self.high is not None:
            inside &= num_frames < self.high
        return inside

    @property
    def name(self) -> str:
        """Folder name: `lo_hi`, with an empty `hi` when unbounded."""
        return f"{self.low}_{'' if self.high is None else self.high}"

    def __str__(self) -> str:
        return f"{self.low}:{'' if self.high is None else self.high}"


def parse_frame_ranges(specs: Sequence[str]) -> list[FrameRange]:
    """Parse `"lo:hi"` groups, sorted by `lo`; overlapping groups are an error naming both."""
    ranges = sorted((FrameRange.parse(spec) for spec in specs),
                    key=lambda r: (r.low, r.high is None, r.high or 0))
    for previous, current in itertools.pairwise(ranges):
        if previous.high is None or current.low < previous.high:
            raise ValueError(f"frame ranges {str(previous)!r} and {str(current)!r} overlap "
                             "(ranges are half-open [lo, hi))")
    return ranges


# --------------------------------------------------------------------------- drops


class DropLog:
    """Utterances left out, each with a reason; written as `<utt> <reason> [detail]`."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str]] = []

    def add(self, key: str, reason: str, detail: str = "") -> None:
        """Record that `key` was dropped for `reason` (one word) with optional detail."""
        self.entries.append((key, f"{reason} {detail}".strip()))

    def __len__(self) -> int:
        return len(self.entries)

    def counts(self) -> dict[str, int]:
        """Number of drops per reason."""
        return dict(collections.Counter(value.split(" ", 1)[0] for _, value in self.entries))

    def summary(self) -> str:
        """One line, e.g. `3 dropped (no_label=1, out_of_range=2)`."""
        counts = ", ".join(f"{r}={n}" for r, n in sorted(self.counts().items()))
        return f"{len(self)} dropped" + (f" ({counts})" if counts else "")

    def write(self, path: PathLike) -> None:
        """Write the list (sorted by utterance id), atomically; written even when empty."""
        write_table(path, self.entries)


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class UtteranceTable:
    """Utterances joined from scp and text files, sorted by id, metadata in numpy arrays."""

    keys: list[str]
    texts: list[str]
    ark_paths: list[str]
    ark_index: np.ndarray  # int32, into ark_paths
    offsets: np.ndarray  # int64
    num_frames: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.keys)

    def location(self, index: int) -> str:
        """`<ark>:<offset>` of one utterance, as kaldiio.load_mat takes it."""
        return f"{self.ark_paths[self.ark_index[index]]}:{self.offsets[index]}"

    def select(self, indices: Sequence[int] | np.ndarray) -> UtteranceTable:
        """A table of the given rows, in the given order."""
        indices = np.asarray(indices, dtype=np.int64)
        return UtteranceTable([self.keys[i] for i in indices], [self.texts[i] for i in indices],
                              self.ark_paths, self.ark_index[indices], self.offsets[indices],
                              self.num_frames[indices])


def as_path_list(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def read_labels(f_labels: PathLike | Sequence[PathLike]) -> dict[str, str]:
    """Transcripts of one or more Kaldi `text` files (empty ones kept as "")."""
    labels: dict[str, str] = {}
    origin: dict[str, Path] = {}
    for path in as_path_list(f_labels):
        for lineno, (key, text) in enumerate(iter_table(path, allow_empty_value=True), 1):
            if key in labels:
                raise TableError(f"{path}:{lineno}: duplicate utterance {key!r} "
                                 f"(also in {origin[key]})")
            labels[key] = text
            origin[key] = path
    return labels


def read_matrix_shape(fd, offset: int) -> tuple[int, int]:
    """(rows, cols) of the Kaldi matrix at `offset`, reading only its header."""
    fd.seek(offset)
    if fd.read(2) != b"\0B":
        # Text matrices have no header with the size; read the whole thing.
        fd.seek(offset)
        return kaldiio.matio.read_kaldi(fd).shape
    token = read_token(fd)
    if token in ("CM", "CM2", "CM3"):
        header = GlobalHeader.read(fd, token)
        return header.rows, header.cols
    if token in ("FM", "DM"):
        dims = []
        for _ in range(2):
            if fd.read(1) != b"\x04":
                raise ValueError(f"bad matrix header at offset {offset}")
            dims.append(struct.unpack("<i", fd.read(4))[0])
        return dims[0], dims[1]
    raise ValueError(f"no matrix at offset {offset} (type {token!r})")


def read_feature_index(f_scps: PathLike | Sequence[PathLike]) -> UtteranceTable:
    """Ark locations and frame counts of every utterance in one or more `feats.scp`.

    Entries must be `<utt> <ark>:<offset>` (as Kaldi and kaldiio write them; neither may
    contain whitespace, so an id with a space is an error naming the line); relative
    ark paths are taken relative to the working directory and stored absolute. The
    returned table is sorted by id and has empty `texts`.
    """
    entries: dict[str, tuple[int, int]] = {}
    origin: dict[str, Path] = {}
    ark_ids: dict[str, int] = {}
    raw_ark_ids: dict[str, int] = {}  # as written in the scp; saves an abspath per line
    ark_sizes: list[int] = []  # bytes of each ark, by ark id
    frames: dict[str, int] = {}
    for scp in as_path_list(f_scps):
        scp_keys = []
        for lineno, (key, value) in enumerate(iter_table(scp), 1):
            match = _ARK_LOCATION.match(value)
            if not match:
                raise TableError(f"{scp}:{lineno}: utterance {key!r}: expected "
                                 f"'<ark path>:<byte offset>', got {value!r}")
            if any(c.isspace() for c in match["ark"]):
                raise TableError(f"{scp}:{lineno}: {len(value.split()) + 1} fields where "
                                 f"'<utterance id> <ark path>:<byte offset>' is expected: "
                                 f"{f'{key} {value}'!r}; utterance ids (and ark paths) "
                                 "cannot contain whitespace")
            if key in entries:
                raise TableError(f"{scp}:{lineno}: duplicate utterance {key!r} "
                                 f"(also in {origin[key]})")
            ark_id = raw_ark_ids.get(match["ark"])
            if ark_id is None:
                ark = os.path.abspath(match["ark"])
                if ark not in ark_ids and not os.path.exists(ark):
                    raise TableError(f"{scp}:{lineno}: utterance {key!r}: ark {ark} does not "
                                     "exist")
                ark_id = ark_ids.setdefault(ark, len(ark_ids))
                raw_ark_ids[match["ark"]] = ark_id
                if ark_id == len(ark_sizes):
                    info = os.stat(ark)
                    # Unknown (-1) for a named pipe or device, which has no size.
                    ark_sizes.append(info.st_size if stat.S_ISREG(info.st_mode) else -1)
            offset = int(match["offset"])
            if 0 <= ark_sizes[ark_id] <= offset:
                raise TableError(f"{scp}:{lineno}: utterance {key!r}: offset {offset} is past "
                                 f"the end of ark {list(ark_ids)[ark_id]} "
                                 f"({ark_sizes[ark_id]} bytes; truncated, or rewritten after "
                                 "the scp?)")
            entries[key] = (ark_id, offset)
            origin[key] = scp
            scp_keys.append(key)
        frames.update(_frames_from_table(scp, scp_keys))
    ark_paths = list(ark_ids)
    missing = [key for key in entries if key not in frames]
    if missing:
        logger.info("reading %d matrix headers for frame counts (no utt2num_frames entry)",
                    len(missing))
        frames.update(_frames_from_headers(missing, entries, ark_paths))
    keys = sorted(entries)
    return UtteranceTable(
        keys=keys, texts=[], ark_paths=ark_paths,
        ark_index=np.fromiter((entries[k][0] for k in keys), np.int32, len(keys)),
        offsets=np.fromiter((entries[k][1] for k in keys), np.int64, len(keys)),
        num_frames=np.fromiter((frames[k] for k in keys), np.int32, len(keys)),
    )


def _frames_from_table(scp: Path, keys: list[str]) -> dict[str, int]:
    table_path = scp.parent / "utt2num_frames"
    if not table_path.is_file():
        return {}
    table = read_table(table_path)
    frames = {}
    for key in keys:
        value = table.get(key)
        if value is None:
            continue
        if not value.isdigit():
            raise TableError(f"{table_path}: utterance {key!r}: frame count {value!r} "
                             "is not a non-negative integer")
        frames[key] = int(value)
    return frames


def _frames_from_headers(keys: list[str], entries: dict[str, tuple[int, int]],
                         ark_paths: list[str]) -> dict[str, int]:
    by_ark: dict[int, list[str]] = collections.defaultdict(list)
    for key in keys:
        by_ark[entries[key][0]].append(key)
    frames = {}
    for ark_id, ark_keys in sorted(by_ark.items()):
        # Each ark is opened once and read forwards.
        ark_keys.sort(key=lambda k: entries[k][1])
        path = ark_paths[ark_id]
        try:
            fd = open(path, "rb")  # noqa: SIM115  (closed below; errors name the ark)
        except OSError as error:
            raise ValueError(f"cannot open ark {path}: {error}") from None
        with fd:
            for key in ark_keys:
                offset = entries[key][1]
                try:
                    frames[key] = int(read_matrix_shape(fd, offset)[0])
                except (ValueError, struct.error, TypeError, AssertionError) as error:
                    raise ValueError(f"{path}:{offset}: cannot read the matrix header of "
                                     f"utterance {key!r}: {error}") from None
    return frames


def feature_verdict(feats: np.ndarray) -> str:
    """Why a feature matrix is not trained: `non_finite nan=<n> inf=<n>` when it holds NaN
    or infinite values (they would make the CMVN statistics, the loss and every gradient
    non-finite); "" when it is fine. The packers and both loaders decide with it."""
    # numpy tests float16 one value at a time (7x slower than this, bench/collate.py):
    # a half is NaN or infinite exactly when its five exponent bits are all set.
    if (feats.dtype == np.float16 and feats.size and feats.flags.c_contiguous
            and int((feats.view(np.uint16) & 0x7FFF).max()) < 0x7C00):
        return ""
    finite = np.isfinite(feats)
    if finite.all():
        return ""
    nan = int(np.isnan(feats).sum())
    return f"non_finite nan={nan} inf={int(feats.size - finite.sum()) - nan}"


def transcript_verdict(text: str, ids: Sequence[int] | None = None) -> str:
    """Why an utterance with transcript `text` (encoded as `ids`, when given) is not
    trained: `empty_label`, `no_tokens` or `all_unk tokens=<n>`; "" when it is.

    The map-style packer and the streaming loader (`cat.loading.stream`) both decide
    with this function, so they train and drop the same utterances for the same reasons.
    """
    if not text.strip():
        return "empty_label"
    if ids is None:
        return ""
    if not len(ids):
        return "no_tokens"
    if all(i == UNK_ID for i in ids):
        return f"all_unk tokens={len(ids)}"
    return ""


def load_utterances(f_scps: PathLike | Sequence[PathLike],
                    f_labels: PathLike | Sequence[PathLike], drops: DropLog) -> UtteranceTable:
    """Join features and transcripts by utterance id (never by line order).

    Utterances with features but no transcript (`no_label`), with an empty transcript
    (`empty_label`) and transcripts without features (`no_features`) go to `drops`.
    """
    table = read_feature_index(f_scps)
    labels = read_labels(f_labels)
    keep = join_labels(table.keys, labels, drops, unmatched="no_features")
    table.texts = [labels.get(key, "") for key in table.keys]
    return table.select(keep)


def join_labels(keys: Sequence[str], labels: dict[str, str], drops: DropLog,
                unmatched: str) -> list[int]:
    """Indices of `keys` whose transcript passes `transcript_verdict`; the others go to
    `drops` (`no_label` or the verdict), and so do transcripts of no key (`unmatched`)."""
    keep = []
    for index, key in enumerate(keys):
        text = labels.get(key)
        reason = "no_label" if text is None else transcript_verdict(text)
        if reason:
            drops.add(key, reason)
        else:
            keep.append(index)
    present = set(keys)
    for key in sorted(labels):
        if key not in present:
            drops.add(key, unmatched)
    return keep
