"""A small writer of WeNet UIO data, independent of this project's packer, for tests.

WeNet's UIO "shard" mode stores utterances in plain tar files: per utterance a UTF-8
transcript member `<key>.txt` and an audio member `<key>.<ext>` (`wav`, `flac`,
`opus` ...), one after the other; WeNet's own packing tool writes the transcript first,
with default tar metadata. A reader groups consecutive members by the name before the
LAST dot, so keys may hold dots and path prefixes: key `A/B/utt.1` has the members
`A/B/utt.1.txt` and `A/B/utt.1.wav`. (Plain webdataset splits at the first dot of the
file name instead and would read that as key `A/B/utt` with extensions `1.txt` and
`1.wav`.)

A `data.list` names the data, one entry per line: in shard mode a shard path or URL per
line; in raw mode a JSON object per line with the utterance `key`, the path of its audio
file `wav` and its transcript `txt` (non-ASCII text written as is).

This module is written from that description, not from `cat.formats.prep_wds`, so that a
test can check that our readers accept data made by someone else's tool.

Usage:
    corpus = make_uio_corpus(tmp_path, {"A/B/utt.1": "今天 天气", "BAC009S0002W0122": "好"})
    # corpus.shards, corpus.shard_list (shard mode data.list), corpus.raw_list (raw mode)
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import soundfile

from cat.core.io import PathLike, atomic_write


@dataclasses.dataclass(frozen=True)
class UioUtterance:
    """One utterance of a shard: its key, encoded audio bytes and transcript."""

    key: str
    audio: bytes
    text: str
    audio_format: str = "wav"


@dataclasses.dataclass(frozen=True)
class UioCorpus:
    """What `make_uio_corpus` wrote."""

    shards: list[Path]
    shard_list: Path
    raw_list: Path
    texts: dict[str, str]


def check_key(key: str) -> str:
    """A key usable as a tar member name and a file path; returns it, else ValueError."""
    parts = key.split("/")
    if (not key or key.startswith("/") or any(part in ("", ".", "..") for part in parts)
            or any(char.isspace() for char in key)):
        raise ValueError(f"unusable UIO key {key!r}: empty, absolute, with an empty, '.' "
                         "or '..' path part, or with whitespace")
    return key


def member_names(key: str, audio_format: str = "wav") -> tuple[str, str]:
    """The transcript and audio member names of `key`."""
    check_key(key)
    return f"{key}.txt", f"{key}.{audio_format}"


def split_member_name(name: str) -> tuple[str, str]:
    """WeNet's reading of a member name: `(key, extension)` split at the last dot."""
    key, dot, extension = name.rpartition(".")
    if not dot or "/" in extension:
        raise ValueError(f"member {name!r} has no extension")
    return key, extension


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)  # default metadata (mtime 0, mode 0644, uid 0)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_uio_shard(path: PathLike, utterances: Iterable[UioUtterance],
                    text_first: bool = True) -> Path:
    """Write one UIO shard (gzip-compressed when `path` ends in `.tar.gz` or `.tgz`).

    Members come in utterance order, transcript first unless `text_first` is False.
    """
    path = Path(path)
    mode = "w:gz" if path.name.endswith((".tar.gz", ".tgz")) else "w"
    with atomic_write(path, "wb") as f, tarfile.open(fileobj=f, mode=mode) as tar:
        for utterance in utterances:
            text_name, audio_name = member_names(utterance.key, utterance.audio_format)
            members = [(text_name, utterance.text.encode("utf-8")),
                       (audio_name, utterance.audio)]
            for name, data in members if text_first else reversed(members):
                _add(tar, name, data)
    return path


def write_shard_list(path: PathLike, shards: Iterable[PathLike | str]) -> Path:
    """A shard-mode `data.list`: one shard path or URL per line."""
    with atomic_write(path) as f:
        for shard in shards:
            f.write(f"{shard}\n")
    return Path(path)


def write_raw_list(path: PathLike, entries: Iterable[tuple[str, PathLike | str, str]]) -> Path:
    """A raw-mode `data.list`: `{"key": ..., "wav": <audio path>, "txt": ...}` per line."""
    with atomic_write(path) as f:
        for key, wav, text in entries:
            record = {"key": check_key(key), "wav": str(wav), "txt": text}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return Path(path)


def synth_wav(duration: float, sample_rate: int = 16000, seed: int = 0) -> bytes:
    """A 16-bit mono WAV of a few harmonics and a little noise, written by soundfile."""
    rng = np.random.default_rng(seed)
    time = np.arange(round(duration * sample_rate)) / sample_rate
    pitch = rng.uniform(100.0, 250.0)
    voice = sum(np.sin(2 * np.pi * pitch * k * time) / k for k in range(1, 12))
    waveform = 0.2 * voice + 0.01 * rng.standard_normal(time.size)
    samples = np.clip(np.round(waveform * 32768), -32768, 32767).astype(np.int16)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def make_uio_corpus(root: PathLike, texts: Mapping[str, str] | Sequence[tuple[str, str]],
                    utts_per_shard: int = 2, sample_rate: int = 16000, seed: int = 0,
                    gzip: bool = False) -> UioCorpus:
    """Write WeNet-style data for `texts` (key -> transcript) under `root`.

    `root/shards/shards_000000000.tar`...: `utts_per_shard` utterances each, with the
    shard-mode `root/data.list`; `root/wav/<key>.wav` with the raw-mode
    `root/raw.list`. Utterance `i` lasts 0.5 + 0.1 * (i % 5) seconds.
    """
    root = Path(root)
    items = list(texts.items()) if isinstance(texts, Mapping) else list(texts)
    if len({key for key, _ in items}) != len(items):
        raise ValueError("duplicate keys in texts")
    if utts_per_shard < 1:
        raise ValueError(f"utts_per_shard must be positive, got {utts_per_shard}")
    utterances = [UioUtterance(check_key(key), synth_wav(0.5 + 0.1 * (i % 5), sample_rate,
                                                         seed + i), text)
                  for i, (key, text) in enumerate(items)]
    suffix = ".tar.gz" if gzip else ".tar"
    shards = []
    for number, start in enumerate(range(0, len(utterances), utts_per_shard)):
        shard = root / "shards" / f"shards_{number:09d}{suffix}"
        shards.append(write_uio_shard(shard, utterances[start:start + utts_per_shard]))
    raw_entries = []
    for utterance in utterances:
        wav = root / "wav" / f"{utterance.key}.wav"
        wav.parent.mkdir(parents=True, exist_ok=True)
        wav.write_bytes(utterance.audio)
        raw_entries.append((utterance.key, wav, utterance.text))
    return UioCorpus(shards, write_shard_list(root / "data.list", shards),
                     write_raw_list(root / "raw.list", raw_entries), dict(items))
