"""Factory for tiny, complete training experiments (a recipe directory in miniature).

`write_tiny_experiment(root)` lays out, relative to `root` (the recipe directory):

    data/fbank/{train,dev}/          random features (Kaldi arks, feats.scp, text)
    data/wds/{train,dev}/            the same utterances as tar shards (+ index.jsonl)
    exp/<name>/tokenizer.tknz        a SentencePiece char tokenizer of the transcripts
    exp/<name>/pack/{train,dev}.npz  map-style packs
    exp/<name>/hyper-p.json          map-style by default; `large_dataset` flips to shards
                                     (`use_audio_shards`: audio shards of the same utterances)
    exp/<name>/config.json           a tiny Conformer CTC or RNN-T model

Paths inside the JSON files are relative to `root`, so run training from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from cat.core.io import PathLike
from cat.formats.audio_pack import pack_audio
from cat.formats.mappack import write_map_pack
from cat.testing.audio import make_audio_file, write_kaldi_data_dir
from cat.testing.features import (
    FeatureCorpus,
    random_transcript,
    utterance_ids,
    write_feature_corpus,
)
from cat.testing.shards import write_shards
from cat.text import tokenizer as tk


def tiny_model_config(kind: str = "ctc", feat_dim: int = 8, peak_lr: float = 3e-3,
                      warmup_steps: int = 5, stop_step: int = 100000) -> dict[str, Any]:
    """`config.json` of a one-block Conformer (4x subsampling) with a CTC or RNN-T head."""
    config: dict[str, Any] = {
        "encoder": {"type": "ConformerNet",
                    "kwargs": {"idim": feat_dim, "hdim": 16, "num_cells": 1, "num_heads": 2,
                               "kernel_size": 3, "dropout": 0.0, "conv_norm": "layernorm",
                               "subsampling_channels": 4}},
        "scheduler": {"type": "SchedulerNoam",
                      "kwargs": {"peak_lr": peak_lr, "warmup_steps": warmup_steps,
                                 "stop_step": stop_step},
                      "optimizer": {"type": "AdamW", "kwargs": {"betas": [0.9, 0.98]}}},
    }
    # The tiny corpora are random: starting blank-heavy would leave little loss to lose,
    # so these models start from the default initialisation.
    if kind == "ctc":
        config["ctc"] = {"dropout": 0.0, "blank_init_prob": 0.0}
    else:
        config["decoder"] = {"type": "LSTMPredictor",
                             "kwargs": {"embed_dim": 8, "hdim": 8, "dropout": 0.0}}
        config["joiner"] = {"type": "JointNet", "kwargs": {"hdim": 8, "blank_init_prob": 0.0}}
    return config


@dataclasses.dataclass
class TinyExperiment:
    """What `write_tiny_experiment` wrote; paths in `hyper-p.json` are relative to `root`."""

    root: Path
    name: str
    train: FeatureCorpus
    dev: FeatureCorpus
    train_shards: list[Path]
    dev_shards: list[Path]

    @property
    def exp_dir(self) -> Path:
        """Absolute experiment directory."""
        return self.root / self.name

    @property
    def hyper_path(self) -> Path:
        """Absolute path of `hyper-p.json`."""
        return self.exp_dir / "hyper-p.json"

    def hyper(self) -> dict[str, Any]:
        """The current `hyper-p.json`."""
        return json.loads(self.hyper_path.read_text(encoding="utf-8"))

    def use_shards(self, **options: Any) -> None:
        """Switch `hyper-p.json` to the streaming path over `data/wds/train` shards."""
        self.set_options(**{"large_dataset": True, "trset": "data/wds/train/data-*.tar",
                            **options})

    def use_audio_shards(self, audio_format: str = "flac", features: str = "device",
                         utts_per_shard: int = 10, **options: Any) -> None:
        """Switch training and dev to streaming audio shards of the same utterances
        (synthetic recordings as long as their features, the same transcripts), 80-dim
        fbank computed where `features` says (`train.option.audio.features`)."""
        folders = [f"data/wds/{part}_{audio_format}" for part in ("train", "dev")]
        for folder, part, corpus in zip(folders, ("train", "dev"), (self.train, self.dev),
                                        strict=True):
            _audio_shards(corpus, self.root / f"data/audio/{part}", self.root / folder,
                          audio_format, utts_per_shard)
        self.set_options(**{"large_dataset": True, "trset": f"{folders[0]}/*.tar",
                            "dev_large_dataset": True, "devset": f"{folders[1]}/*.tar",
                            "audio": {"features": features}, **options})
        config_path = self.exp_dir / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["encoder"]["kwargs"]["idim"] = AUDIO_FEAT_DIM
        config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")

    def set_options(self, **options: Any) -> None:
        """Update `train.option` keys of `hyper-p.json`."""
        hyper = self.hyper()
        hyper["train"]["option"].update(options)
        self.hyper_path.write_text(json.dumps(hyper, ensure_ascii=False, indent=1),
                                   encoding="utf-8")


#: The fbank bins of `TinyExperiment.use_audio_shards`.
AUDIO_FEAT_DIM = 80


def _audio_shards(corpus: FeatureCorpus, audio_dir: Path, shard_dir: Path, audio_format: str,
                  utts_per_shard: int) -> None:
    """Audio shards (`pack_audio`) of recordings with the frame counts and transcripts of
    `corpus`."""
    wav_scp = {}
    for number, (key, features) in enumerate(sorted(corpus.features.items())):
        seconds = (len(features) * 160 + 240) / 16000  # Kaldi's frames of 25 ms every 10 ms
        path = make_audio_file(audio_dir / "wav" / f"{key}.{audio_format}", seconds,
                               seed=number)
        wav_scp[key] = str(path)
    data_dir = write_kaldi_data_dir(audio_dir / "data", wav_scp, corpus.transcripts,
                                    {key: key[:11] for key in wav_scp})
    pack_audio(data_dir, shard_dir, audio_format, utts_per_file=utts_per_shard)


def _transcripts(keys: list[str], seed: int, max_chars: int) -> dict[str, str]:
    rng = np.random.default_rng(seed)
    return {key: random_transcript(rng, 1, max_chars) for key in keys}


def write_tiny_experiment(
    root: PathLike,
    name: str = "exp/tiny",
    kind: str = "ctc",
    num_train: int = 40,
    num_dev: int = 8,
    feat_dim: int = 8,
    frame_range: tuple[int, int] = (40, 100),
    utts_per_shard: int = 5,
    max_chars: int = 5,
    extra_train: dict[str, tuple[int, str]] | None = None,
    options: dict[str, Any] | None = None,
    seed: int = 0,
) -> TinyExperiment:
    """Write a complete tiny experiment under `root` (see the module docstring).

    `extra_train` adds training utterances `{key: (frames, transcript)}`, e.g. ones a CTC
    model cannot emit. `options` override `train.option` keys.
    """
    root = Path(root)
    train_keys = utterance_ids(num_train)
    rng = np.random.default_rng(seed)
    frames = [int(n) for n in rng.integers(frame_range[0], frame_range[1] + 1, num_train)]
    texts = _transcripts(train_keys, seed, max_chars)
    for key, (count, text) in (extra_train or {}).items():
        train_keys.append(key)
        frames.append(count)
        texts[key] = text
    train = write_feature_corpus(root / "data/fbank/train", keys=train_keys, num_frames=frames,
                                 dim=feat_dim, transcripts=texts, seed=seed)
    dev_keys = [f"dev-{key}" for key in utterance_ids(num_dev)]
    dev = write_feature_corpus(root / "data/fbank/dev", keys=dev_keys, dim=feat_dim,
                               frame_range=frame_range, seed=seed + 1,
                               transcripts=_transcripts(dev_keys, seed + 1, max_chars))
    exp_dir = root / name
    tokenizer_file = exp_dir / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([train.text, dev.text], "char", 0), tokenizer_file)
    write_map_pack(train.feats_scp, train.text, tokenizer_file, exp_dir / "pack/train.npz")
    write_map_pack(dev.feats_scp, dev.text, tokenizer_file, exp_dir / "pack/dev.npz")
    train_shards = write_shards(train, root / "data/wds/train", utts_per_shard)
    dev_shards = write_shards(dev, root / "data/wds/dev", utts_per_shard)

    option = {"large_dataset": False, "batch_size": 4, "max_frames": 0, "workers": 0,
              "threads": 1, "epochs": 2, "check_freq": 0, "keep_checkpoints": 2,
              "shuffle_buffer": 12, "sort_buffer": 8, "log_interval": 1, "seed": seed}
    option.update(options or {})
    hyper = {
        "data": {"train": ["data/fbank/train"], "dev": ["data/fbank/dev"],
                 "test": ["data/fbank/dev"]},
        "tokenizer": {"type": "sentencepiece",
                      "option-train": {"model_type": "char", "vocab_size": 0},
                      "file": f"{name}/tokenizer.tknz"},
        "env": {"OMP_NUM_THREADS": "1"},
        "train": {"bin": f"cat.{kind}.train", "option": option},
        "inference": {"avgmodel": {"mode": "best", "num": 2},
                      "infer": {"bin": f"cat.{kind}.decode", "option": {"beam_size": 4}},
                      "er": {"cer": True}},
    }
    if option["large_dataset"] and "trset" not in option:
        option["trset"] = "data/wds/train/data-*.tar"
    (exp_dir / "hyper-p.json").write_text(json.dumps(hyper, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    (exp_dir / "config.json").write_text(
        json.dumps(tiny_model_config(kind, feat_dim), indent=1), encoding="utf-8")
    return TinyExperiment(root, name, train, dev, train_shards, dev_shards)


@dataclasses.dataclass(frozen=True)
class EpochCoverage:
    """What an epoch's independent per-batch logs (`log_utterances`) and its record say."""

    trained: int
    missing: list[str]
    duplicated: list[str]
    retrained: int

    def __str__(self) -> str:
        return (f"trained {self.trained}, missing {len(self.missing)}, duplicated "
                f"{len(self.duplicated)}, retrained {self.retrained}")


def epoch_coverage(exp_dir: PathLike, keys: list[str], epoch: int = 1) -> EpochCoverage:
    """Every utterance of `keys` against the batches the ranks logged in `epoch`
    (`log/utts/epoch-<EEE>.rank-<R>.txt`, one line per batch) and `log/epoch-<EEE>.json`."""
    log = Path(exp_dir) / "log"
    trained: list[str] = []
    for path in sorted((log / "utts").glob(f"epoch-{epoch:03d}.rank-*.txt")):
        trained += [key for line in path.read_text(encoding="utf-8").splitlines()
                    for key in line.split()]
    counts: dict[str, int] = {}
    for key in trained:
        counts[key] = counts.get(key, 0) + 1
    record = json.loads((log / f"epoch-{epoch:03d}.json").read_text(encoding="utf-8"))
    return EpochCoverage(len(trained), sorted(set(keys) - set(counts)),
                         sorted(key for key, count in counts.items() if count > 1),
                         int(record["retrained"]))


def latest_step(exp_dir: PathLike) -> int:
    """The update count of the newest checkpoint an experiment lists, 0 while it lists none
    (or while its list is being written)."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        listed = json.loads((Path(exp_dir) / "check/checkpoints.json").read_text())
        return int(listed["checkpoints"][-1]["step"])
    return 0
