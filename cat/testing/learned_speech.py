"""Factory for a tiny CTC model that has learned a few real recordings by heart, and for long
recordings made of them whose transcripts, seams and times are known exactly.

Synthetic speech hid the errors of joining windows; real speech with real pauses shows
them. `read_real_speech(folder)` reads real utterances (`<key>.flac` files and a Kaldi
`text`, as `tests/decoding/real_speech` holds them) and finds where each one's speech
starts and ends (Silero VAD, `cat.audio.vad`). `train_learned_experiment(root, speech)`
writes and trains an experiment on them with this toolkit's own stage 1 and training: a
Conformer CTC model (64 dimensions, 2 heads, 2 blocks) over training utterances made of
the real ones in varied surroundings (alone; two or three in a row with pauses of 0 to
1 s of silence, noise or synthetic music between them; trimmed to their speech or whole;
louder or quieter), so that it recognises each of them wherever it stands in a
recording (character error rate 0 on each), which lets a test or a benchmark count
exactly what segmentation and the joining of results add.

Long recordings (`LongRecording`: samples, reference transcript, and for each real
utterance in it where its audio and its speech start and end):

* `loop_recording`: one utterance `repeats` times with `pause` seconds of silence between;
* `mixed_recording`: the utterances in a random order, whole or trimmed to their speech,
  with pauses of 0.1 to 1.0 s, none at all, or music or noise between them;
* `unpaused_recording`: the utterances trimmed to their speech, end to end.

Usage:
    speech = read_real_speech("tests/decoding/real_speech")
    experiment, checkpoint = train_learned_experiment(tmp_path, speech)
    long = loop_recording(speech[0], repeats=120, pause=0.3)
    long.write(tmp_path / "long.wav")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import soundfile

from cat.audio.vad import FRAME_SAMPLES, SileroVad
from cat.core.io import PathLike, read_table
from cat.features.extract import extract
from cat.formats.mappack import write_map_pack
from cat.testing.audio import write_kaldi_data_dir
from cat.testing.training import tiny_model_config
from cat.text import tokenizer as tk

RATE = 16000
EXP = "exp/learned"


@dataclasses.dataclass(frozen=True)
class RealSpeech:
    """A real utterance: 16 kHz float32 samples, transcript, speech from `speech[0]` to
    `speech[1]` (samples, by the VAD at threshold 0.5)."""

    key: str
    samples: np.ndarray
    text: str
    speech: tuple[int, int]

    @property
    def trimmed(self) -> np.ndarray:
        """Its speech alone."""
        return self.samples[self.speech[0]:self.speech[1]]


def speech_span(samples: np.ndarray, threshold: float = 0.5) -> tuple[int, int]:
    """First and end sample of the frames the VAD finds speech in (the whole when none)."""
    probabilities = SileroVad().probabilities(samples)
    frames = np.flatnonzero(probabilities >= threshold)
    if not len(frames):
        return 0, len(samples)
    return int(frames[0]) * FRAME_SAMPLES, min(len(samples), (int(frames[-1]) + 1) * FRAME_SAMPLES)


def read_real_speech(folder: PathLike) -> list[RealSpeech]:
    """The `<key>.flac` utterances of `folder` with the transcripts of its `text`."""
    folder = Path(folder)
    speech = []
    for key, text in sorted(read_table(folder / "text").items()):
        samples, rate = soundfile.read(folder / f"{key}.flac", dtype="float32")
        if rate != RATE:
            raise ValueError(f"{folder / key}.flac: {rate} Hz, expected {RATE}")
        speech.append(RealSpeech(key, samples, "".join(text.split()), speech_span(samples)))
    return speech


# ----------------------------------------------------------------------------- recordings


def filler(kind: str, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """`seconds` of `silence` (a faint noise floor), `noise` (white noise) or `music`
    (notes of a few harmonics changing every 0.2-0.5 s)."""
    count = round(seconds * RATE)
    if kind == "silence":
        return (2e-4 * rng.standard_normal(count)).astype(np.float32)
    if kind == "noise":
        return (rng.uniform(0.005, 0.03) * rng.standard_normal(count)).astype(np.float32)
    if kind != "music":
        raise ValueError(f"unknown filler {kind!r}; expected silence, noise or music")
    out = np.zeros(count, np.float32)
    start = 0
    while start < count:
        length = min(count - start, round(rng.uniform(0.2, 0.5) * RATE))
        time = np.arange(length) / RATE
        pitch = 220.0 * 2 ** (rng.integers(-12, 13) / 12)
        note = sum(np.sin(2 * np.pi * pitch * harmonic * time) / harmonic
                   for harmonic in (1, 2, 3))
        envelope = np.minimum(1.0, np.minimum(time, time[::-1]) * 50)
        out[start:start + length] = 0.05 * note * envelope
        start += length
    return out


@dataclasses.dataclass(frozen=True)
class Placed:
    """A real utterance in a long recording: its key, and the seconds where its audio and
    its speech start and end."""

    key: str
    start: float
    end: float
    speech_start: float
    speech_end: float


@dataclasses.dataclass(frozen=True)
class LongRecording:
    """Samples (16 kHz float32), the reference transcript, and the utterances in order."""

    samples: np.ndarray
    text: str
    placed: tuple[Placed, ...]

    @property
    def seconds(self) -> float:
        return len(self.samples) / RATE

    def write(self, path: PathLike) -> Path:
        """As a 16-bit WAV file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(path, self.samples, RATE, subtype="PCM_16")
        return path


def _compose(parts: Sequence[tuple[RealSpeech | None, np.ndarray]]) -> LongRecording:
    """Samples of `parts` one after the other; a part with an utterance is placed."""
    placed, text, offset = [], "", 0
    for speech, samples in parts:
        if speech is not None:
            # Trimmed or whole: where its speech lies in these samples.
            first = 0 if len(samples) == len(speech.trimmed) else speech.speech[0]
            length = speech.speech[1] - speech.speech[0]
            placed.append(Placed(speech.key, offset / RATE, (offset + len(samples)) / RATE,
                                 (offset + first) / RATE, (offset + first + length) / RATE))
            text += speech.text
        offset += len(samples)
    samples = np.concatenate([samples for _, samples in parts]) if parts else \
        np.zeros(0, np.float32)
    return LongRecording(np.clip(samples, -1, 1).astype(np.float32), text, tuple(placed))


def loop_recording(speech: RealSpeech, repeats: int, pause: float) -> LongRecording:
    """`speech` (whole) `repeats` times with `pause` seconds of silence between."""
    gap = np.zeros(round(pause * RATE), np.float32)
    parts: list[tuple[RealSpeech | None, np.ndarray]] = []
    for index in range(repeats):
        if index:
            parts.append((None, gap))
        parts.append((speech, speech.samples))
    return _compose(parts)


#: What `mixed_recording` puts between two utterances: seconds and filler.
GAPS = (*((pause, "silence") for pause in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)),
        (0.0, "silence"), (0.0, "silence"), (0.6, "music"), (1.0, "music"), (0.5, "noise"),
        (1.0, "noise"))


def mixed_recording(speech: Sequence[RealSpeech], count: int, seed: int = 0) -> LongRecording:
    """`count` utterances drawn from `speech`, each whole or trimmed to its speech, one
    after the other with a gap of `GAPS` drawn between each two (no pause at all between
    two trimmed ones is speech without a pause), and half a second of silence before the
    first and after the last."""
    rng = np.random.default_rng(seed)
    parts: list[tuple[RealSpeech | None, np.ndarray]] = [(None, filler("silence", 0.5, rng))]
    for index in range(count):
        chosen = speech[int(rng.integers(len(speech)))]
        if index:
            seconds, kind = GAPS[int(rng.integers(len(GAPS)))]
            parts.append((None, filler(kind, seconds, rng)))
        parts.append((chosen, chosen.trimmed if rng.random() < 0.6 else chosen.samples))
    parts.append((None, filler("silence", 0.5, rng)))
    return _compose(parts)


def unpaused_recording(speech: Sequence[RealSpeech], count: int) -> LongRecording:
    """`count` utterances of `speech` in turn, trimmed to their speech, end to end (speech
    without a pause), with half a second of silence before the first and after the last."""
    silence = np.zeros(RATE // 2, np.float32)
    return _compose([(None, silence),
                     *((speech[index % len(speech)], speech[index % len(speech)].trimmed)
                       for index in range(count)), (None, silence)])


def _training_utterance(speech: Sequence[RealSpeech], rng: np.random.Generator
                        ) -> tuple[np.ndarray, str]:
    count = int(rng.choice([1, 1, 2, 2, 3]))
    parts: list[tuple[RealSpeech | None, np.ndarray]] = [
        (None, filler(str(rng.choice(["silence", "noise", "music"])),
                      float(rng.uniform(0.0, 0.8)), rng))]
    for index in range(count):
        chosen = speech[int(rng.integers(len(speech)))]
        trimmed = rng.random() < 0.5
        if index:
            seconds, kind = GAPS[int(rng.integers(len(GAPS)))]
            if seconds == 0 and not trimmed:
                seconds = 0.2
            parts.append((None, filler(kind, seconds, rng)))
        parts.append((chosen, chosen.trimmed if trimmed else chosen.samples))
    parts.append((None, filler(str(rng.choice(["silence", "noise", "music"])),
                               float(rng.uniform(0.0, 0.8)), rng)))
    recording = _compose(parts)
    gain = float(10 ** (rng.uniform(-6, 6) / 20))
    return np.clip(recording.samples * gain, -1, 1), recording.text


# ----------------------------------------------------------------------------- the model


def learned_model_config() -> dict:
    """`config.json`: a 2-block Conformer (64 dimensions, 2 heads, 4x subsampling) with a
    CTC head, over 80-dim fbank with the global CMVN training computes."""
    config = tiny_model_config("ctc", 80, peak_lr=2e-3, warmup_steps=50)
    config["encoder"]["kwargs"].update({"hdim": 64, "num_cells": 2, "num_heads": 2,
                                        "kernel_size": 15, "subsampling_channels": 32,
                                        "global_cmvn": True})
    return config


def write_learned_experiment(root: PathLike, speech: Sequence[RealSpeech],
                             num_utts: int = 64, epochs: int = 40, seed: int = 0) -> Path:
    """Write the experiment under `root` (see the module doc): `corpus/train` (`num_utts`
    utterances made of `speech`, and each of `speech` alone), its features, tokenizer,
    packs, `hyper-p.json` and `config.json`; returns the experiment directory."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    audio = root / "corpus/train/audio"
    audio.mkdir(parents=True, exist_ok=True)
    wav_scp, text = {}, {}
    for item in speech:
        path = audio / f"{item.key}.wav"
        soundfile.write(path, item.samples, RATE, subtype="PCM_16")
        wav_scp[item.key], text[item.key] = str(path), item.text
    for index in range(num_utts):
        key = f"mix{index:04d}"
        samples, transcript = _training_utterance(speech, rng)
        soundfile.write(audio / f"{key}.wav", samples, RATE, subtype="PCM_16")
        wav_scp[key], text[key] = str(audio / f"{key}.wav"), transcript
    data_dir = write_kaldi_data_dir(root / "corpus/train/data", wav_scp, text,
                                    {key: "S0001" for key in wav_scp})
    extract(data_dir, root / "data/fbank/train", progress=False)
    exp_dir = root / EXP
    tokenizer_file = exp_dir / "tokenizer.tknz"
    texts = root / "data/fbank/train/text"
    tk.save(tk.train_sentencepiece([texts], "char", 0), tokenizer_file)
    for part in ("train", "dev"):
        write_map_pack(root / "data/fbank/train/feats.scp", texts, tokenizer_file,
                       exp_dir / f"pack/{part}.npz")
    hyper = {
        "data": {"train": ["data/fbank/train"], "dev": ["data/fbank/train"],
                 "test": ["data/fbank/train"], "front_end": "kaldi"},
        "tokenizer": {"type": "sentencepiece",
                      "option-train": {"model_type": "char", "vocab_size": 0},
                      "file": f"{EXP}/tokenizer.tknz"},
        "env": {"OMP_NUM_THREADS": "1"},
        "train": {"bin": "cat.ctc.train",
                  "option": {"batch_size": 8, "max_frames": 0, "workers": 0, "threads": 1,
                             "epochs": epochs, "check_freq": 0, "keep_checkpoints": 1,
                             "seed": seed}},
        "inference": {"avgmodel": {"mode": "last", "num": 1},
                      "infer": {"bin": "cat.ctc.decode",
                                "option": {"method": "greedy", "beam_size": 1}},
                      "er": {"cer": True}},
    }
    (exp_dir / "hyper-p.json").write_text(json.dumps(hyper, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    (exp_dir / "config.json").write_text(json.dumps(learned_model_config(), indent=1),
                                         encoding="utf-8")
    return exp_dir


def train_learned_experiment(root: PathLike, speech: Sequence[RealSpeech],
                             num_utts: int = 64, epochs: int = 40, seed: int = 0
                             ) -> tuple[Path, Path]:
    """`write_learned_experiment` under `root`, trained there on one thread: (the
    experiment directory, its last checkpoint). Decode from `root` (paths in
    `hyper-p.json` are relative to it)."""
    from cat.training.cli import train

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(root), mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        exp_dir = write_learned_experiment(root, speech, num_utts, epochs, seed)
        train(EXP, "cat.ctc.train")
    checkpoint = max((exp_dir / "check").glob("ckpt-*.pt"))
    return exp_dir, checkpoint
