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

The scp/text joining, frame counting and drop accounting are `cat.formats.tables`', shared
with the tar shards (`cat.formats.prep_wds`).

Usage:
    python -m cat.formats.mappack --tokenizer exp/asr/tokenizer.tknz --scp data/train/feats.scp \
        --text data/train/text --filter 10:2000 --out exp/asr/pack/train.npz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import kaldiio
import numpy as np

from cat.core.io import (
    PathLike,
    atomic_write,
    setup_logging,
)
from cat.formats.tables import (
    FRAME_SHIFT_SECONDS,
    DropLog,
    FrameRange,
    UtteranceTable,
    as_path_list,
    feature_verdict,
    load_utterances,
    transcript_verdict,
)
from cat.text.tokenizer import UNK_ID
from cat.text.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)

PACK_FORMAT = "cat-map-pack"
PACK_VERSION = 1
# A fixed zip timestamp keeps re-packed files byte-identical.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


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
    table = _drop_non_finite(table, labels, drops)

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
        "scp": [str(p) for p in as_path_list(f_scps)],
        "text": [str(p) for p in as_path_list(f_labels)],
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


def _drop_non_finite(table: UtteranceTable, labels: list[list[int]], drops: DropLog
                     ) -> UtteranceTable:
    """`table` without utterances whose features hold NaN or infinite values (dropped as
    `non_finite`); `labels` is cut alike. Reads every matrix once."""
    handles: dict[str, Any] = {}
    keep = []
    try:
        for index in range(len(table)):
            location = table.location(index)
            try:
                matrix = kaldiio.load_mat(location, fd_dict=handles)
            except Exception as error:  # kaldiio signals bad data with asserts and OS errors
                raise ValueError(f"{location}: cannot read the features of "
                                 f"{table.keys[index]!r}: {type(error).__name__}: {error}"
                                 ) from error
            verdict = feature_verdict(matrix)
            if verdict:
                drops.add(table.keys[index], *verdict.split(" ", 1))
            else:
                keep.append(index)
    finally:
        for handle in handles.values():
            handle.close()
    if len(keep) < len(table):
        labels[:] = [labels[i] for i in keep]
        return table.select(keep)
    return table


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
    parser = argparse.ArgumentParser(prog="python -m cat.formats.mappack",
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
