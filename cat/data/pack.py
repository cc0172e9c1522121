"""Stage 2 (small corpora): a map-style pack of labels, frame counts and an ark index.

`write_map_pack` joins one or more `feats.scp` with one or more Kaldi `text` files by
utterance id, encodes the transcripts with a tokenizer and writes ONE `.npz` file (no
pickle inside; `np.load(path, allow_pickle=False)` reads it). `MapPack` reads it back;
features stay in the arks and are read lazily with kaldiio.

Pack members (arrays, N utterances in byte order of their ids):

    meta            0-d str: JSON {"format": "cat-map-pack", "version": 1, "num_utts",
                    "num_frames", "frame_range", "tokenizer": {"file", "type", "vocab_size",
                    "sha256"}, "scp": [...], "text": [...]}
    keys            (N,)   S<n>   utterance ids, UTF-8, sorted
    num_frames      (N,)   int32  frames per utterance
    ark_paths       (A,)   str    absolute paths of the arks (a small table)
    ark_index       (N,)   int32  index into ark_paths
    ark_offsets     (N,)   int64  byte offset of the matrix in its ark
    labels          (L,)   int32  all label ids, concatenated
    label_offsets   (N+1,) int64  labels of utterance i are labels[off[i]:off[i+1]]

Frame counts come from `utt2num_frames` next to each `feats.scp` when it has the
utterance, otherwise from the matrix header in the ark (no matrix is loaded). A frame
range `"lo:hi"` keeps `lo <= frames < hi` (half-open; either end may be left out).

Nothing is dropped silently: utterances without a label, without features, with an
empty label, outside the frame range, with no tokens or with only `<unk>` tokens are
counted per reason, logged, and listed as `<utt> <reason> [detail]` in
`<pack stem>.dropped.txt` next to the pack.

The same scp/text joining, frame counting and drop accounting serve the tar shards
(`cat.data.prep_wds`).

Usage:
    python -m cat.data.pack --tokenizer exp/asr/tokenizer.tknz --scp data/train/feats.scp \
        --text data/train/text --filter 10:2000 --out exp/asr/pack/train.npz
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import struct
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import kaldiio
import numpy as np
from kaldiio.compression_header import GlobalHeader
from kaldiio.matio import read_token

from cat.shared.tokenizer import UNK_ID
from cat.shared.tokenizer import load as load_tokenizer
from cat.utils.io import (
    PathLike,
    TableError,
    atomic_write,
    iter_table,
    read_table,
    setup_logging,
    write_table,
)

logger = logging.getLogger(__name__)

PACK_FORMAT = "cat-map-pack"
PACK_VERSION = 1
FRAME_SHIFT_SECONDS = 0.01
_ARK_LOCATION = re.compile(r"^(?P<ark>.*\S):(?P<offset>\d+)$")
# A fixed zip timestamp keeps re-packed files byte-identical.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


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


def _as_list(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def read_labels(f_labels: PathLike | Sequence[PathLike]) -> dict[str, str]:
    """Transcripts of one or more Kaldi `text` files (empty ones kept as "")."""
    labels: dict[str, str] = {}
    origin: dict[str, Path] = {}
    for path in _as_list(f_labels):
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
    frames: dict[str, int] = {}
    for scp in _as_list(f_scps):
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
            entries[key] = (ark_id, int(match["offset"]))
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
                except (ValueError, struct.error, TypeError) as error:
                    raise ValueError(f"{path}:{offset}: cannot read the matrix header of "
                                     f"utterance {key!r}: {error}") from None
    return frames


def transcript_verdict(text: str, ids: Sequence[int] | None = None) -> str:
    """Why an utterance with transcript `text` (encoded as `ids`, when given) is not
    trained: `empty_label`, `no_tokens` or `all_unk tokens=<n>`; "" when it is.

    The map-style packer and the streaming loader (`cat.shared.pipeline`) both decide
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
    keep = []
    for index, key in enumerate(table.keys):
        text = labels.get(key)
        reason = "no_label" if text is None else transcript_verdict(text)
        if reason:
            drops.add(key, reason)
        else:
            keep.append(index)
    feature_keys = set(table.keys)
    for key in sorted(labels):
        if key not in feature_keys:
            drops.add(key, "no_features")
    table.texts = [labels.get(key, "") for key in table.keys]
    return table.select(keep)


# --------------------------------------------------------------------------- writer


def _save_npz(path: PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez (uncompressed), but atomic and with fixed zip timestamps."""
    with atomic_write(path, "wb") as f, \
            zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE)
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def dropped_log_path(out: PathLike) -> Path:
    """Where the drop list of the pack `out` goes: `<dir>/<stem>.dropped.txt`."""
    out = Path(out)
    return out.with_name(f"{out.stem}.dropped.txt")


def write_map_pack(
    f_scps: PathLike | Sequence[PathLike],
    f_labels: PathLike | Sequence[PathLike],
    tokenizer_file: PathLike,
    out: PathLike,
    frame_range: FrameRange | str | None = None,
) -> dict[str, int]:
    """Pack features index + encoded labels into `out` (.npz); returns counts.

    The returned dict has `num_utts`, `num_frames`, `num_tokens`, `num_unk`, `input`
    (utterances seen in scp or text) and one `dropped_<reason>` per drop reason.
    """
    if isinstance(frame_range, str):
        frame_range = FrameRange.parse(frame_range)
    drops = DropLog()
    table = load_utterances(f_scps, f_labels, drops)
    num_input = len(table) + len(drops)
    if frame_range is not None:
        inside = frame_range.mask(table.num_frames)
        for index in np.flatnonzero(~inside):
            drops.add(table.keys[index], "out_of_range",
                      f"num_frames={table.num_frames[index]} range=[{frame_range})")
        table = table.select(np.flatnonzero(inside))

    tokenizer = load_tokenizer(tokenizer_file)
    keep, labels = [], []
    num_unk = 0
    unk_examples: list[str] = []
    for index, (key, text) in enumerate(zip(table.keys, table.texts, strict=True)):
        ids = tokenizer.encode(text)
        unk = sum(1 for i in ids if i == UNK_ID)
        reason = transcript_verdict(text, ids)
        if reason:
            drops.add(key, *reason.split(" ", 1))
        else:
            keep.append(index)
            labels.append(ids)
            num_unk += unk
            if unk and len(unk_examples) < 5:
                unk_examples.append(key)
    table = table.select(keep)

    drops.write(dropped_log_path(out))
    if not len(table):
        raise ValueError(f"no utterances left to pack into {out} ({drops.summary()}; "
                         f"see {dropped_log_path(out)})")
    arrays = _pack_arrays(table, labels)
    meta = {
        "format": PACK_FORMAT, "version": PACK_VERSION, "num_utts": len(table),
        "num_frames": int(table.num_frames.sum(dtype=np.int64)),
        "frame_range": None if frame_range is None else str(frame_range),
        "tokenizer": {"file": str(tokenizer_file), "type": tokenizer.type_name,
                      "vocab_size": tokenizer.vocab_size,
                      "sha256": hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest()},
        "scp": [str(p) for p in _as_list(f_scps)], "text": [str(p) for p in _as_list(f_labels)],
    }
    _save_npz(out, {"meta": np.array(json.dumps(meta, ensure_ascii=False)), **arrays})

    num_tokens = int(arrays["labels"].size)
    logger.info("packed %d utterances (%.2f h, %d tokens) into %s; %s, listed in %s",
                len(table), meta["num_frames"] * FRAME_SHIFT_SECONDS / 3600, num_tokens, out,
                drops.summary(), dropped_log_path(out))
    if num_unk:
        logger.warning("%d <unk> tokens kept in utterances such as %s", num_unk,
                       ", ".join(unk_examples))
    counts = {"input": num_input, "num_utts": len(table), "num_frames": meta["num_frames"],
              "num_tokens": num_tokens, "num_unk": num_unk}
    counts.update({f"dropped_{reason}": n for reason, n in drops.counts().items()})
    return counts


def _pack_arrays(table: UtteranceTable, labels: list[list[int]]) -> dict[str, np.ndarray]:
    lengths = np.fromiter(map(len, labels), np.int64, len(labels))
    label_offsets = np.zeros(len(labels) + 1, np.int64)
    np.cumsum(lengths, out=label_offsets[1:])
    flat = np.fromiter((i for ids in labels for i in ids), np.int32, int(label_offsets[-1]))
    # Only the arks still referenced go into the path table.
    used, ark_index = np.unique(table.ark_index, return_inverse=True)
    return {
        "keys": np.array([k.encode("utf-8") for k in table.keys]),
        "num_frames": table.num_frames.astype(np.int32),
        "ark_paths": np.array([table.ark_paths[i] for i in used], dtype=str),
        "ark_index": ark_index.astype(np.int32),
        "ark_offsets": table.offsets.astype(np.int64),
        "labels": flat,
        "label_offsets": label_offsets,
    }


# --------------------------------------------------------------------------- reader


class Utterance(NamedTuple):
    """One packed utterance."""

    key: str
    features: np.ndarray
    label: np.ndarray


class MapPack:
    """Lazy reader of a map-style pack: metadata in numpy arrays, features from the arks.

    Picklable (only the path travels; a worker reloads the arrays) and safe in forked
    DataLoader workers: open ark handles are per process.
    """

    _MEMBERS = ("meta", "keys", "num_frames", "ark_paths", "ark_index", "ark_offsets",
                "labels", "label_offsets")

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self._load()

    def _load(self) -> None:
        try:
            with np.load(self.path, allow_pickle=False) as data:
                missing = [m for m in self._MEMBERS if m not in data.files]
                if missing:
                    raise ValueError(f"missing member {missing[0]!r}")
                arrays = {m: data[m] for m in self._MEMBERS}
        except FileNotFoundError:
            raise FileNotFoundError(f"pack file {self.path} does not exist") from None
        except (ValueError, OSError, zipfile.BadZipFile) as error:
            raise ValueError(f"{self.path}: not a map pack: {error}") from None
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("format") != PACK_FORMAT or meta.get("version") != PACK_VERSION:
            raise ValueError(f"{self.path}: not a {PACK_FORMAT} version {PACK_VERSION} file")
        self.meta: dict[str, Any] = meta
        self.keys: np.ndarray = arrays["keys"]
        self.num_frames: np.ndarray = arrays["num_frames"]
        self.ark_paths: list[str] = [str(p) for p in arrays["ark_paths"]]
        self.ark_index: np.ndarray = arrays["ark_index"]
        self.ark_offsets: np.ndarray = arrays["ark_offsets"]
        self.labels: np.ndarray = arrays["labels"]
        self.label_offsets: np.ndarray = arrays["label_offsets"]
        self._handles: dict[str, Any] = {}
        self._handles_pid = os.getpid()

    def __len__(self) -> int:
        return len(self.num_frames)

    @property
    def label_lengths(self) -> np.ndarray:
        """Number of label ids per utterance (int64)."""
        return np.diff(self.label_offsets)

    def metadata_bytes(self) -> int:
        """Bytes held by the per-utterance metadata arrays (labels excluded)."""
        return sum(a.nbytes for a in (self.keys, self.num_frames, self.ark_index,
                                      self.ark_offsets, self.label_offsets))

    def key(self, index: int) -> str:
        """Utterance id of entry `index`."""
        return self.keys[index].decode("utf-8")

    def find(self, key: str) -> int:
        """Index of utterance `key`; KeyError if absent."""
        target = key.encode("utf-8")
        if len(target) <= self.keys.dtype.itemsize:
            index = int(np.searchsorted(self.keys, target))
            if index < len(self) and self.keys[index] == target:
                return index
        raise KeyError(f"{key!r} is not in {self.path}")

    def label(self, index: int) -> np.ndarray:
        """Label ids (int32) of entry `index`."""
        return self.labels[self.label_offsets[index]:self.label_offsets[index + 1]]

    def features(self, index: int) -> np.ndarray:
        """Feature matrix of entry `index`, read from its ark."""
        if self._handles_pid != os.getpid():
            # A forked worker must not share file offsets with its parent.
            self._handles, self._handles_pid = {}, os.getpid()
        ark = self.ark_paths[self.ark_index[index]]
        return kaldiio.load_mat(f"{ark}:{self.ark_offsets[index]}", fd_dict=self._handles)

    def __getitem__(self, index: int) -> Utterance:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} utterances")
        index = int(index) % len(self)
        return Utterance(self.key(index), self.features(index), self.label(index))

    def close(self) -> None:
        """Close the ark files opened so far."""
        if self._handles_pid == os.getpid():
            for handle in self._handles.values():
                handle.close()
        self._handles = {}

    def __enter__(self) -> MapPack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self._load()


# --------------------------------------------------------------------------- CLI


def main(argv: Iterable[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m cat.data.pack",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer file (.tknz)")
    parser.add_argument("--scp", required=True, action="extend", nargs="+",
                        help="feats.scp file(s); repeatable")
    parser.add_argument("--text", required=True, action="extend", nargs="+",
                        help="Kaldi text file(s); repeatable")
    parser.add_argument("--filter", type=FrameRange.parse, default=None,
                        help="keep utterances with lo <= frames < hi ('lo:hi', ends optional)")
    parser.add_argument("--out", required=True, help="pack file to write (.npz)")
    args = parser.parse_args(None if argv is None else list(argv))
    setup_logging()
    write_map_pack(args.scp, args.text, args.tokenizer, args.out, args.filter)


if __name__ == "__main__":
    main()
