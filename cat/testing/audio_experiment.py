"""Factory for a tiny experiment whose features are stage 1's fbank of real audio files.

`write_audio_experiment(root)` lays out, relative to `root` (the recipe directory):

    corpus/{train,test}/audio/*.wav     synthetic recordings (`cat.testing.audio`)
    corpus/{train,test}/data/           their Kaldi data dirs (wav.scp, text, utt2spk)
    data/fbank/{train,test}/            stage 1's 80-dim fbank of them (`cat.features.extract`)
    exp/<name>/tokenizer.tknz           a SentencePiece char tokenizer of the transcripts
    exp/<name>/pack/{train,dev}.npz     map-style packs (dev is the test set)
    exp/<name>/hyper-p.json             map-style training, decoding options of stage 4
    exp/<name>/config.json              a tiny Conformer CTC or RNN-T model taking 80 bins

so that decoding the test set's audio directly can be compared with stage 4's decoding of
its extracted features. Paths inside the JSON files are relative to `root`.

Usage:
    experiment = write_audio_experiment(tmp_path, kind="ctc")
    train(experiment.exp_dir, "cat.ctc.train")  # from root
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from cat.core.io import PathLike, read_table, write_table
from cat.features.extract import extract
from cat.features.fbank import front_end
from cat.formats.mappack import write_map_pack
from cat.testing.audio import make_data_dir
from cat.testing.features import random_transcript
from cat.testing.training import tiny_model_config
from cat.text import tokenizer as tk

FEAT_DIM = 80


@dataclasses.dataclass(frozen=True)
class AudioExperiment:
    """What `write_audio_experiment` wrote."""

    root: Path
    name: str
    train_data: Path
    test_data: Path

    @property
    def exp_dir(self) -> Path:
        """Absolute experiment directory."""
        return self.root / self.name

    @property
    def test_features(self) -> Path:
        """Stage 1's feature dir of the test set."""
        return self.root / "data/fbank/test"

    def test_audio(self) -> dict[str, Path]:
        """The test set's audio file per utterance id."""
        return {utt: Path(spec) for utt, spec in read_table(self.test_data / "wav.scp").items()}


def _corpus(root: Path, durations: Sequence[float], seed: int) -> Path:
    """A data dir of recordings with random transcripts."""
    data_dir = make_data_dir(root, durations, num_speakers=2, seed=seed)
    rng = np.random.default_rng(seed)
    texts = {utt: random_transcript(rng, 2, 6) for utt in read_table(data_dir / "wav.scp")}
    write_table(data_dir / "text", texts.items())
    return data_dir


def write_audio_experiment(root: PathLike, name: str = "exp/tiny", kind: str = "ctc",
                           train_durations: Sequence[float] = (0.8, 1.2, 1.0, 1.5, 0.9, 1.3,
                                                               1.1, 0.7, 1.4, 1.0),
                           test_durations: Sequence[float] = (0.6, 1.3, 0.9, 1.6, 1.1, 0.8),
                           epochs: int = 2, seed: int = 0,
                           front_end_name: str = "kaldi",
                           corpus: Callable[[Path, Sequence[float], int], Path] | None = None
                           ) -> AudioExperiment:
    """Write a complete tiny experiment over synthetic audio (see the module docstring);
    its features and `data.front_end` are of `front_end_name` (`FRONT_ENDS`). `corpus(root,
    durations, seed)` writes the recordings and data dir of a set (default: recordings of
    sines with random transcripts)."""
    root = Path(root)
    corpus = corpus or _corpus
    train_data = corpus(root / "corpus/train", train_durations, seed)
    test_data = corpus(root / "corpus/test", test_durations, seed + 100)
    for data_dir, part in ((train_data, "train"), (test_data, "test")):
        extract(data_dir, root / "data/fbank" / part, options=front_end(front_end_name),
                progress=False)
    exp_dir = root / name
    tokenizer_file = exp_dir / "tokenizer.tknz"
    texts = [root / "data/fbank/train/text", root / "data/fbank/test/text"]
    tk.save(tk.train_sentencepiece(texts, "char", 0), tokenizer_file)
    write_map_pack(root / "data/fbank/train/feats.scp", texts[0], tokenizer_file,
                   exp_dir / "pack/train.npz")
    write_map_pack(root / "data/fbank/test/feats.scp", texts[1], tokenizer_file,
                   exp_dir / "pack/dev.npz")
    hyper = {
        "data": {"train": ["data/fbank/train"], "dev": ["data/fbank/test"],
                 "test": ["data/fbank/test"], "front_end": front_end_name},
        "tokenizer": {"type": "sentencepiece",
                      "option-train": {"model_type": "char", "vocab_size": 0},
                      "file": f"{name}/tokenizer.tknz"},
        "env": {"OMP_NUM_THREADS": "1"},
        "train": {"bin": f"cat.{kind}.train",
                  "option": {"batch_size": 4, "max_frames": 0, "workers": 0, "threads": 1,
                             "epochs": epochs, "check_freq": 0, "keep_checkpoints": 2,
                             "seed": seed}},
        "inference": {"avgmodel": {"mode": "best", "num": 2},
                      "infer": {"bin": f"cat.{kind}.decode",
                                "option": {"beam_size": 4, "max_frames": 300}},
                      "er": {"cer": True}},
    }
    (exp_dir / "hyper-p.json").write_text(json.dumps(hyper, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    (exp_dir / "config.json").write_text(
        json.dumps(tiny_model_config(kind, FEAT_DIM), indent=1), encoding="utf-8")
    return AudioExperiment(root, name, train_data, test_data)


#: How much `train_audio_experiment` lowers the blank logit's bias, per model kind: a tiny
#: model after an epoch of random audio emits blank everywhere, and tests of searches and
#: streaming need tokens that depend on the features.
LOWERED_BLANK = {"ctc": 3.0, "rnnt": 1.0}


def train_audio_experiment(root: PathLike, kind: str = "ctc", epochs: int = 1,
                           configure: Callable[[dict[str, Any]], None] | None = None,
                           front_end_name: str = "kaldi") -> tuple[AudioExperiment, Path]:
    """`write_audio_experiment` under `root` (features of `front_end_name`) with its
    `config.json` changed by `configure`, trained there (one thread), and its first
    checkpoint with the blank bias lowered (`LOWERED_BLANK`) as `exp/tiny/lowered-blank.pt`:
    (the experiment, that checkpoint)."""
    from cat.training.cli import train

    root = Path(root)
    with contextlib.chdir(root), mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        experiment = write_audio_experiment(root, kind=kind, epochs=epochs,
                                            front_end_name=front_end_name)
        config_path = experiment.exp_dir / "config.json"
        if configure is not None:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            configure(config)
            config_path.write_text(json.dumps(config), encoding="utf-8")
        train(experiment.name, f"cat.{kind}.train")
    state = torch.load(next((experiment.exp_dir / "check").glob("ckpt-*.pt")),
                       map_location="cpu")
    key = "ctc.bias" if kind == "ctc" else "transducer.joiner.out.bias"
    state["model"][key][0] -= LOWERED_BLANK[kind]
    checkpoint = experiment.exp_dir / "lowered-blank.pt"
    torch.save(state, checkpoint)
    return experiment, checkpoint
