"""Factory for small feature corpora: random fbank-like matrices in Kaldi arks + a `text`.

`write_feature_corpus` writes `<dir>/feats.scp` (`<utt> <ark>:<offset>`, via kaldiio),
the arks themselves, `<dir>/text` and, optionally, `<dir>/utt2num_frames`, all sorted in
byte order like a Kaldi data directory, and returns what it wrote so that tests can
compare packed outputs with the sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import kaldiio
import numpy as np

from cat.core.io import PathLike, write_table

#: A small pool of common characters for random Mandarin transcripts.
CHINESE_CHARACTERS = (
    "的一是在不了有和人这中大为上个国我以要他时来用们"
    "生到作地于出就分对成会可主发年动同工也能下过子说"
)


@dataclasses.dataclass
class FeatureCorpus:
    """Paths and contents of a corpus written by `write_feature_corpus`."""

    directory: Path
    feats_scp: Path
    text: Path
    utt2num_frames: Path | None
    features: dict[str, np.ndarray]
    transcripts: dict[str, str]

    @property
    def keys(self) -> list[str]:
        """Utterance ids in byte order."""
        return sorted(self.features)


def utterance_ids(num_utts: int, num_speakers: int = 3, speed_perturb: bool = False) -> list[str]:
    """AISHELL-style ids (`BAC009S0002W0001`), sorted; `speed_perturb` adds `sp0.9-`/`sp1.1-`."""
    ids = [f"BAC009S{1 + i % num_speakers:04d}W{i:04d}" for i in range(num_utts)]
    if speed_perturb:
        ids += [f"sp{factor}-{utt}" for factor in ("0.9", "1.1") for utt in ids]
    return sorted(ids)


def random_transcript(rng: np.random.Generator, min_chars: int = 2, max_chars: int = 12,
                      spaces: bool = False) -> str:
    """A random string of common Chinese characters, words optionally separated by spaces."""
    length = int(rng.integers(min_chars, max_chars + 1))
    chars = [CHINESE_CHARACTERS[i] for i in rng.integers(0, len(CHINESE_CHARACTERS), length)]
    if not spaces:
        return "".join(chars)
    words, position = [], 0
    while position < length:
        step = int(rng.integers(1, 4))
        words.append("".join(chars[position:position + step]))
        position += step
    return " ".join(words)


def write_transcripts(path: PathLike, num_utts: int = 50, spaces: bool = False, seed: int = 0,
                      extra: dict[str, str] | None = None) -> dict[str, str]:
    """Write a Kaldi `text` of random transcripts (plus `extra` lines); returns its contents."""
    rng = np.random.default_rng(seed)
    transcripts = {key: random_transcript(rng, spaces=spaces) for key in utterance_ids(num_utts)}
    transcripts.update(extra or {})
    write_table(path, transcripts.items())
    return transcripts


def write_feature_corpus(
    directory: PathLike,
    keys: Sequence[str] | None = None,
    num_utts: int = 20,
    num_frames: Sequence[int] | None = None,
    frame_range: tuple[int, int] = (5, 60),
    dim: int = 80,
    num_arks: int = 2,
    transcripts: dict[str, str] | None = None,
    spaces: bool = False,
    write_utt2num_frames: bool = True,
    compression_method: int | None = None,
    seed: int = 0,
) -> FeatureCorpus:
    """Write a random feature corpus into `directory` and return its contents.

    `num_frames` gives one frame count per key; without it counts are drawn uniformly
    from `frame_range` (inclusive). Utterances are spread round-robin over `num_arks`
    arks so that the scp points into several files at increasing offsets. `transcripts`
    overrides the random text for the keys it contains (an empty string writes an empty
    transcript; keys that have no features appear in `text` only). With a kaldiio
    `compression_method` (Kaldi compressed matrices), `features` holds the decompressed
    values that a reader gets back.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    keys = list(keys) if keys is not None else utterance_ids(num_utts)
    if num_frames is None:
        frames = [int(n) for n in rng.integers(frame_range[0], frame_range[1] + 1, len(keys))]
    else:
        frames = [int(n) for n in num_frames]
        if len(frames) != len(keys):
            raise ValueError(f"{len(frames)} frame counts for {len(keys)} keys")
    features = {key: rng.normal(-5.0, 3.0, (n, dim)).astype(np.float32)
                for key, n in zip(keys, frames, strict=True)}
    keys = sorted(keys)
    scp_lines: list[tuple[str, str]] = []
    for ark_index in range(num_arks):
        ark_keys = keys[ark_index::num_arks]
        if not ark_keys:
            continue
        ark = directory / f"feats.{ark_index + 1}.ark"
        part_scp = directory / f".feats.{ark_index + 1}.scp"
        kaldiio.save_ark(str(ark), {key: features[key] for key in ark_keys}, scp=str(part_scp),
                         compression_method=compression_method)
        with open(part_scp, encoding="utf-8") as f:
            scp_lines += [tuple(line.rstrip("\n").split(" ", 1)) for line in f]
        part_scp.unlink()
    if compression_method is not None:
        features = {key: kaldiio.load_mat(location) for key, location in scp_lines}
    feats_scp = directory / "feats.scp"
    write_table(feats_scp, scp_lines)
    texts = {key: random_transcript(rng, spaces=spaces) for key in keys}
    texts.update(transcripts or {})
    text = directory / "text"
    write_table(text, texts.items())
    utt2num_frames = None
    if write_utt2num_frames:
        utt2num_frames = directory / "utt2num_frames"
        write_table(utt2num_frames, ((key, len(features[key])) for key in keys))
    return FeatureCorpus(directory, feats_scp, text, utt2num_frames, features, texts)


def poison_features(feats_scp: PathLike, key: str, value: float = float("nan"),
                    position: tuple[int, int] = (0, 0)) -> None:
    """Set one value of utterance `key`'s (uncompressed float32) matrix to `value`, in its
    ark in place, so that packs and scp entries written before still point at it."""
    entries = dict(line.split(" ", 1) for line in
                   Path(feats_scp).read_text(encoding="utf-8").splitlines())
    ark, _, offset = entries[key].strip().rpartition(":")
    matrix = kaldiio.load_mat(entries[key].strip())
    if matrix.dtype != np.float32:
        raise ValueError(f"{key}: only float32 matrices can be poisoned, not {matrix.dtype}")
    # "\0B" "FM " then rows and columns, each a size byte and an int32.
    start = int(offset) + 2 + 3 + 10 + 4 * (position[0] * matrix.shape[1] + position[1])
    with open(ark, "r+b") as f:
        f.seek(start)
        f.write(np.float32(value).tobytes())
    if np.isnan(value) != np.isnan(kaldiio.load_mat(entries[key].strip())[position]):
        raise AssertionError(f"{key}: poisoning {ark} at {start} failed")
