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

With language models (`decode_passes`, used by `cat.utils.pipeline lm`): beam search
with token-level shallow fusion and LODR (`FusionSpec`, `cat.lm.scorer`), several
first passes (one per fusion setting, e.g. the points of a weight grid) sharing one
network forward per batch, each writing `hyp`, `nbest.jsonl` (`cat.lm.rescore`) and
`decode.log` into its own directory. `--lm` etc. on the command line decode one pass.

Usage:
    python -m cat.ctc.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test
    python -m cat.ctc.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test-lm \
        --lm exp/synth-lm-char-5gram/lm.arpa --alpha 0.3 --beta 0.5
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
from cat.lm.rescore import NBEST_NAME, write_nbest
from cat.lm.scorer import ShallowFusion, TokenLM
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


@dataclasses.dataclass(frozen=True)
class FusionSpec:
    """Shallow fusion of a token-level n-gram (ARPA or kenlm binary `lm`), optionally
    with LODR (`lodr`, subtracted with `lodr_weight`); see `cat.lm.scorer`."""

    lm: str
    alpha: float
    beta: float = 0.0
    lodr: str | None = None
    lodr_weight: float = 0.0

    def build(self, pieces: list[str], models: dict[str, TokenLM]) -> ShallowFusion:
        """The scorer, loading each LM file once per process (`models` caches them)."""
        for path in (self.lm, self.lodr):
            if path is not None and path not in models:
                models[path] = TokenLM(path, pieces)
        return ShallowFusion(models[self.lm], self.alpha, self.beta,
                             models[self.lodr] if self.lodr else None, self.lodr_weight)




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


def _search_batches(exp_dir: str, checkpoint: str, kind: str, scp: str,
                    batches: list[list[str]], options: DecodeOptions, device: str,
                    specs: list[FusionSpec | None]) -> tuple[list[list], float, list[float]]:
    """N-best beam search of `batches` once per fusion spec (one network forward per batch).

    Returns, per spec, (utt, [(text, score), ...]) pairs; the forward seconds; and the
    search seconds per spec.
    """
    if device == "cpu":
        torch.set_num_threads(1)
    model, tokenizer = load_model(exp_dir, checkpoint, kind, torch.device(device))
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    models: dict[str, TokenLM] = {}
    fusions = [spec.build(pieces, models) if spec is not None else None for spec in specs]
    features = kaldiio.load_scp(scp)
    results: list[list] = [[] for _ in specs]
    search_seconds = [0.0] * len(specs)
    forward_seconds = 0.0
    with torch.inference_mode():
        for keys in batches:
            start = time.perf_counter()
            batch = collate([Utterance(key, features[key], NO_LABEL) for key in keys])
            encoded = model.search_inputs(batch.feats.to(device), batch.feat_lens.to(device))
            forward_seconds += time.perf_counter() - start
            for index, fusion in enumerate(fusions):
                start = time.perf_counter()
                nbest = model.nbest(encoded, options.beam_size, fusion)
                search_seconds[index] += time.perf_counter() - start
                results[index] += [(key, [(tokenizer.decode(tokens), score)
                                          for tokens, score in hyps])
                                   for key, hyps in zip(keys, nbest, strict=True)]
    return results, forward_seconds, search_seconds


def _plan_workers(data_dir: Path, options: DecodeOptions) -> tuple[Path, dict[str, int], str,
                                                                   list[list[list[str]]]]:
    """The scp, utterance lengths, device and each worker's share of the batches."""
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
    return scp, lengths, device, [batches[i::workers] for i in range(workers)]


def decode_passes(exp_dir: PathLike, data_dir: PathLike, checkpoint: PathLike, kind: str,
                  options: DecodeOptions,
                  passes: list[tuple[FusionSpec | None, PathLike]]) -> list[DecodeSummary]:
    """Beam-search `data_dir` once per (fusion, output dir) pass; each output dir gets
    `hyp`, `nbest.jsonl` and `decode.log`. Decoding seconds of a pass: the wall time of
    the run, shared between the passes in proportion to their search time (the network
    forward, done once, counts for each)."""
    if options.method != "beam":
        raise ValueError(f"decoding with language models needs method 'beam', got "
                         f"{options.method!r}")
    data_dir = Path(data_dir)
    scp, lengths, device, shares = _plan_workers(data_dir, options)
    specs = [spec for spec, _ in passes]
    start = time.perf_counter()
    if len(shares) == 1:
        outputs = [_search_batches(str(exp_dir), str(checkpoint), kind, str(scp), shares[0],
                                   options, device, specs)]
    else:
        with process_pool(len(shares)) as pool:
            futures = [pool.submit(_search_batches, str(exp_dir), str(checkpoint), kind,
                                   str(scp), share, options, device, specs) for share in shares]
            outputs = [future.result() for future in futures]
    wall = time.perf_counter() - start
    forward_seconds = sum(out[1] for out in outputs)
    search_seconds = [sum(out[2][i] for out in outputs) for i in range(len(passes))]
    busy = forward_seconds + sum(search_seconds)
    audio = sum(lengths.values()) * FRAME_SHIFT_SECONDS
    summaries = []
    for index, (spec, out_dir) in enumerate(passes):
        out_dir = Path(out_dir)
        nbest = [pair for out in outputs for pair in out[0][index]]
        seconds = wall * (forward_seconds + search_seconds[index]) / busy if busy else wall
        summary = DecodeSummary(len(nbest), audio, seconds)
        write_nbest(out_dir / NBEST_NAME, nbest)
        with atomic_write(out_dir / "hyp") as f:
            for key, hyps in sorted(nbest):
                text = hyps[0][0] if hyps else ""
                f.write(f"{key} {text}\n" if text else f"{key}\n")
        report = {"data": str(data_dir), "checkpoint": str(checkpoint), "device": device,
                  "workers": len(shares), **dataclasses.asdict(options),
                  "fusion": dataclasses.asdict(spec) if spec is not None else None,
                  "num_utts": summary.num_utts, "audio_seconds": round(audio, 2),
                  "decode_seconds": round(seconds, 2), "rtf": round(summary.rtf, 4),
                  "passes_in_run": len(passes)}
        with atomic_write(out_dir / "decode.log") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        summaries.append(summary)
    logger.info("decoded %d utterances (%.1f s of audio) from %s with %d pass%s in %.1f s "
                "(%s, %d worker%s)", len(lengths), audio, data_dir, len(passes),
                "es" * (len(passes) > 1), wall, device, len(shares), "s" * (len(shares) > 1))
    return summaries


def decode_set(exp_dir: PathLike, data_dir: PathLike, checkpoint: PathLike, out_dir: PathLike,
               kind: str, options: DecodeOptions) -> DecodeSummary:
    """Decode every utterance of `data_dir/feats.scp`; writes `out_dir/{hyp,decode.log}`."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    scp, lengths, device, shares = _plan_workers(data_dir, options)
    workers = len(shares)
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
    lm = parser.add_argument_group("shallow fusion (beam search; also writes nbest.jsonl)")
    lm.add_argument("--lm", help="token-level n-gram (ARPA or kenlm binary)")
    lm.add_argument("--alpha", type=float, default=0.3, help="LM weight")
    lm.add_argument("--beta", type=float, default=0.0, help="bonus per token")
    lm.add_argument("--lodr", help="low-order n-gram of the training transcripts (LODR)")
    lm.add_argument("--lodr-weight", type=float, default=0.0, help="weight of the LODR LM")
    return parser


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of `cat.ctc.decode` / `cat.rnnt.decode`."""
    args = build_parser(kind).parse_args(argv)
    setup_logging()
    options = DecodeOptions(args.method, args.beam_size, args.nj, args.max_frames,
                            args.batch_size, args.device)
    if args.lm:
        spec = FusionSpec(args.lm, args.alpha, args.beta, args.lodr, args.lodr_weight)
        summary = decode_passes(args.exp_dir, args.data, args.checkpoint, kind, options,
                                [(spec, args.out)])[0]
    else:
        summary = decode_set(args.exp_dir, args.data, args.checkpoint, args.out, kind, options)
    print(f"RTF {summary.rtf:.4f} ({summary.num_utts} utterances, "
          f"{summary.audio_seconds:.1f} s of audio)")
    return 0

