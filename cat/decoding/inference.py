"""Batched decoding of a Kaldi feature directory, shared by `cat.ctc.decode` and `cat.rnnt.decode`.

The model is rebuilt from the experiment's `config.json` and tokenizer and loaded from a
checkpoint (a training checkpoint, or an average written by `cat.utils.avgmodel`).
Utterances are read lazily from `feats.scp`, sorted by length, grouped into batches of at
most `max_frames` padded frames (and `batch_size` utterances), and the batches are dealt to
`nj` CPU processes (one torch thread each) or decoded on the GPU when one is present.

Outputs in the output directory:

* `hyp`: `<utt> <hypothesis>` lines, sorted (an utterance whose hypothesis is empty is
  written as its id alone, so a scorer sees it and counts deletions);
* `decode.log`: the options, the checkpoint, the number of utterances, audio and decoding
  seconds, and the real-time factor (decoding time / audio time), also printed.

Options (`hyper-p.json: inference.infer.option`, or the command line):
`method` (greedy | beam), `beam_size`, `nj`, `max_frames`, `batch_size`, `device`
(auto | cpu | cuda).

Usage:
    python -m cat.ctc.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kaldiio
import numpy as np
import torch

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    check_against_schema,
    load_config,
    load_hyper,
    model_kind,
    tokenizer_file,
)
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.core.process import process_pool
from cat.formats.tables import read_feature_index
from cat.loading.batch import Utterance, collate
from cat.models.registry import build_model
from cat.text.tokenizer import load as load_tokenizer
from cat.training.checkpoint import load_model_state, read_model_state

logger = logging.getLogger(__name__)

FRAME_SHIFT_SECONDS = 0.01
NO_LABEL = np.zeros(0, np.int32)
OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "method": {"enum": ["greedy", "beam"], "description": "search algorithm"},
        "beam_size": {"type": "integer", "minimum": 1, "description": "beam width"},
        "nj": {"type": "integer", "minimum": 1, "description": "CPU decoding processes"},
        "max_frames": {"type": "integer", "minimum": 1,
                       "description": "padded input frames per batch"},
        "batch_size": {"type": "integer", "minimum": 1, "description": "utterances per batch"},
        "device": {"enum": ["auto", "cpu", "cuda"], "description": "where to decode"},
    },
}


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """See `OPTIONS_SCHEMA`."""

    method: str = "beam"
    beam_size: int = 10
    nj: int = 1
    max_frames: int = 40000
    batch_size: int = 64
    device: str = "auto"

    @classmethod
    def from_dict(cls, options: dict[str, Any], source: str) -> DecodeOptions:
        check_against_schema(options, OPTIONS_SCHEMA, source)
        return cls(**options)


@dataclasses.dataclass(frozen=True)
class DecodeSummary:
    """What one decoding run did."""

    num_utts: int
    audio_seconds: float
    decode_seconds: float

    @property
    def rtf(self) -> float:
        return self.decode_seconds / self.audio_seconds if self.audio_seconds else 0.0


def load_model(exp_dir: PathLike, checkpoint: PathLike, expected_kind: str,
               device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The experiment's model (eval mode, on `device`) with `checkpoint`'s weights, and its
    tokenizer."""
    exp_dir = Path(exp_dir)
    hyper = load_hyper(exp_dir / HYPER_NAME)
    config = load_config(exp_dir / CONFIG_NAME)
    kind = model_kind(config)
    if kind != expected_kind:
        raise ValueError(f"{exp_dir / CONFIG_NAME} describes a {kind} model; decode it with "
                         f"cat.{kind}.decode")
    tokenizer = load_tokenizer(tokenizer_file(hyper, str(exp_dir / HYPER_NAME)))
    model = build_model(config, tokenizer.vocab_size, str(exp_dir / CONFIG_NAME))
    load_model_state(model, read_model_state(checkpoint), checkpoint, exp_dir / CONFIG_NAME)
    return model.to(device).eval(), tokenizer


def read_lengths(data_dir: Path) -> dict[str, int]:
    """Frame counts of the utterances of a feature dir's `feats.scp` (from `utt2num_frames`,
    else from the matrix headers); a malformed scp line is an error naming it."""
    table = read_feature_index(data_dir / "feats.scp")
    return dict(zip(table.keys, table.num_frames.tolist(), strict=True))


def plan_batches(lengths: dict[str, int], max_frames: int, batch_size: int) -> list[list[str]]:
    """Utterance ids grouped by similar length, each group within the padded-frame budget."""
    ordered = sorted(lengths, key=lambda key: (lengths[key], key))
    batches: list[list[str]] = []
    current: list[str] = []
    for key in ordered:
        # Sorted ascending: the newest utterance is the longest of the group.
        if current and (lengths[key] * (len(current) + 1) > max_frames
                        or len(current) >= batch_size):
            batches.append(current)
            current = []
        current.append(key)
    if current:
        batches.append(current)
    return batches


def _decode_batches(exp_dir: str, checkpoint: str, kind: str, scp: str, batches: list[list[str]],
                    options: DecodeOptions, device: str) -> list[tuple[str, str]]:
    """Decode `batches` in this process; returns (utt, hypothesis) pairs."""
    if device == "cpu":
        torch.set_num_threads(1)
    model, tokenizer = load_model(exp_dir, checkpoint, kind, torch.device(device))
    features = kaldiio.load_scp(scp)
    results = []
    with torch.inference_mode():
        for keys in batches:
            batch = collate([Utterance(key, features[key], NO_LABEL) for key in keys])
            hyps = model.decode(batch.feats.to(device), batch.feat_lens.to(device),
                                method=options.method, beam_size=options.beam_size)
            results += [(key, tokenizer.decode(list(hyp))) for key, hyp in zip(keys, hyps,
                                                                                 strict=True)]
    return results


def decode_set(exp_dir: PathLike, data_dir: PathLike, checkpoint: PathLike, out_dir: PathLike,
               kind: str, options: DecodeOptions) -> DecodeSummary:
    """Decode every utterance of `data_dir/feats.scp`; writes `out_dir/{hyp,decode.log}`."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    scp = data_dir / "feats.scp"
    if not scp.is_file():
        raise FileNotFoundError(f"{scp} does not exist (run the feature stage first)")
    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = read_lengths(data_dir)
    batches = plan_batches(lengths, options.max_frames, options.batch_size)
    workers = 1 if device == "cuda" else max(1, min(options.nj, len(batches)))
    # Deal the length-sorted batches round-robin so every worker gets a similar load.
    shares = [batches[i::workers] for i in range(workers)]
    start = time.perf_counter()
    if workers == 1:
        pairs = _decode_batches(str(exp_dir), str(checkpoint), kind, str(scp), shares[0],
                                options, device)
    else:
        with process_pool(workers) as pool:
            futures = [pool.submit(_decode_batches, str(exp_dir), str(checkpoint), kind,
                                   str(scp), share, options, device) for share in shares]
            pairs = [pair for future in futures for pair in future.result()]
    seconds = time.perf_counter() - start
    summary = DecodeSummary(len(pairs), sum(lengths.values()) * FRAME_SHIFT_SECONDS, seconds)
    with atomic_write(out_dir / "hyp") as f:
        for key, text in sorted(pairs):
            f.write(f"{key} {text}\n" if text else f"{key}\n")
    report = {"data": str(data_dir), "checkpoint": str(checkpoint), "device": device,
              "workers": workers, **dataclasses.asdict(options), "num_utts": summary.num_utts,
              "audio_seconds": round(summary.audio_seconds, 2),
              "decode_seconds": round(summary.decode_seconds, 2), "rtf": round(summary.rtf, 4)}
    with atomic_write(out_dir / "decode.log") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    logger.info("decoded %d utterances (%.1f s of audio) from %s in %.1f s: RTF %.4f "
                "(%s, %d worker%s)", summary.num_utts, summary.audio_seconds, data_dir,
                summary.decode_seconds, summary.rtf, device, workers, "s" * (workers > 1))
    return summary


def build_parser(kind: str) -> argparse.ArgumentParser:
    """Command line of `cat.<kind>.decode`."""
    parser = argparse.ArgumentParser(prog=f"python -m cat.{kind}.decode",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("exp_dir", help="experiment directory (hyper-p.json, config.json)")
    parser.add_argument("--data", required=True, help="Kaldi feature dir to decode")
    parser.add_argument("--checkpoint", required=True, help="checkpoint or averaged model")
    parser.add_argument("--out", required=True, help="output directory")
    defaults = DecodeOptions()
    parser.add_argument("--method", choices=("greedy", "beam"), default=defaults.method)
    parser.add_argument("--beam-size", type=int, default=defaults.beam_size)
    parser.add_argument("--nj", type=int, default=defaults.nj)
    parser.add_argument("--max-frames", type=int, default=defaults.max_frames)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device)
    return parser


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of `cat.ctc.decode` / `cat.rnnt.decode`."""
    args = build_parser(kind).parse_args(argv)
    setup_logging()
    options = DecodeOptions(args.method, args.beam_size, args.nj, args.max_frames,
                            args.batch_size, args.device)
    summary = decode_set(args.exp_dir, args.data, args.checkpoint, args.out, kind, options)
    print(f"RTF {summary.rtf:.4f} ({summary.num_utts} utterances, "
          f"{summary.audio_seconds:.1f} s of audio)")
    return 0

