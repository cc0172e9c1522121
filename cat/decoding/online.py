"""Streaming recognition: audio in pieces of any size -> fbank frames -> encoder chunks ->
partial hypotheses, and its command line (`python -m cat.stream`; CAT-style aliases
`cat.ctc.stream`, `cat.rnnt.stream`).

`StreamingRecognizer` takes a chunk encoder (`cat.models.chunked.StreamingEncoder`, or
the exported `encoder-streaming` ONNX model, `OnnxChunkEncoder`) and a family's chunk
search (`step(encoder_out)`, `tokens`). Stage 1's fbank is computed as the audio comes:
a frame's window only covers its own samples, so the frames are those of the whole
recording however the audio is cut. A chunk is encoded as soon as its frames are there;
`finish()` encodes what is left. Hypotheses equal the full forward of the chunk-masked
model (`ConformerNet.set_decode_chunk_size`).

Latency (`decode_utterance`): the audio is taken as arriving in real time; a chunk can
start when its last sample has arrived and the previous chunk is done. First-token
latency is when the first token's chunk is done, from the start of the audio; final
latency when the last chunk is done, from the end of the audio.

The model is that of `cat.decoding.searcher.load_model`: a `config.json` changed since the
checkpoint was trained is an error naming the keys, unless `--allow-config-change`.

With `--tlg`, the chunks' frame posteriors (CTC and CTC-CRF models) are decoded with a TLG
graph as they come (`cat.decoding.wfst.TlgChunkSearch`): partial words after each chunk,
the same final words as WFST decoding of the whole utterance; `--hotwords` are boosted in
that graph (built from `--lm-arpa` into the `--tlg` directory).

Usage:
    python -m cat.stream exp/synth-ctc-stream --wav-scp data/test/wav.scp \
        --chunk-size 16 --out exp/synth-ctc-stream/stream-c16/test
    python -m cat.stream exp/synth-crf-stream --wav-scp data/test/wav.scp --chunk-size 16 \
        --tlg exp/synth-crf-stream/decode-lm/word-3gram-tlg/graph --lm-weight 0.5 \
        --out exp/synth-crf-stream/stream-tlg-c16/test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from cat.core.config import CONFIG_NAME, HYPER_NAME, experiment_kind, load_hyper
from cat.core.io import PathLike, atomic_write, read_table
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.searcher import load_model, write_hyp
from cat.features.fbank import FbankOptions, compute_fbank, read_audio
from cat.models.chunked import MIN_INPUT_FRAMES, SUBSAMPLING_OVERLAP, StreamingEncoder
from cat.models.registry import check_command, family

logger = logging.getLogger(__name__)


class StreamingError(ValueError):
    """Audio or options a streaming recognizer cannot take; the message says why."""


class ChunkSearch(Protocol):
    """A search over encoder chunks: a family's greedy search (token ids), or TLG decoding
    of frame posteriors (words, `cat.decoding.wfst.TlgChunkSearch`)."""

    #: What it has emitted so far (token ids or words; their count dates the first token).
    tokens: list[Any]

    def step(self, encoder_out: torch.Tensor) -> None:
        """Search one chunk's encoder output [T', D] (batch of one removed)."""

    def finish(self) -> None:
        """The audio has ended (after its last chunk)."""

    def text(self, tokenizer: Any) -> str:
        """The hypothesis so far."""


class TokenChunkSearch:
    """What a family's token search over chunks shares: nothing to do at the end, its
    text the tokenizer's of its token ids."""

    tokens: list[int]

    def finish(self) -> None:
        """Nothing is held back: the tokens are final as they come."""

    def text(self, tokenizer: Any) -> str:
        return tokenizer.decode(self.tokens)


class FeatureStream:
    """Stage 1's fbank of audio given in pieces: `accept` returns the new frames."""

    def __init__(self, options: FbankOptions | None = None) -> None:
        self.options = options or FbankOptions()
        self.samples = np.zeros(0, np.float32)

    def accept(self, sample_rate: int, samples: np.ndarray) -> np.ndarray:
        if sample_rate != self.options.sample_rate:
            raise StreamingError(f"audio at {sample_rate} Hz: the model takes "
                                 f"{self.options.sample_rate} Hz audio; resample it first")
        self.samples = np.concatenate([self.samples, np.asarray(samples, np.float32)])
        window, shift = self.options.window_size, self.options.window_shift
        if len(self.samples) < window:
            return np.zeros((0, self.options.num_mel_bins), np.float32)
        count = 1 + (len(self.samples) - window) // shift
        frames = compute_fbank(self.samples[:window + shift * (count - 1)],
                               self.options.sample_rate, self.options)
        self.samples = self.samples[shift * count:]
        return frames


class StreamingRecognizer:
    """Audio pieces -> chunks -> `search`; `text()` is the partial hypothesis."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], stride: int,
                 search: ChunkSearch, tokenizer: Any) -> None:
        self.encode, self.stride, self.search = encode, stride, search
        self.tokenizer = tokenizer
        self.features = FeatureStream()
        self.pending = np.zeros((0, self.features.options.num_mel_bins), np.float32)
        self.frames_seen = 0
        # (feature frames the chunk needed, seconds it took, tokens after it) per chunk
        self.chunks: list[tuple[int, float, int]] = []

    def _run(self, frames: np.ndarray) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            self.search.step(self.encode(torch.from_numpy(frames)[None])[0])
        needed = self.frames_seen - len(self.pending) + len(frames)
        self.chunks.append((needed, time.perf_counter() - start, len(self.search.tokens)))

    def accept_waveform(self, sample_rate: int, samples: np.ndarray) -> str:
        """Take the next piece of audio; return the hypothesis so far."""
        new = self.features.accept(sample_rate, samples)
        self.frames_seen += len(new)
        self.pending = np.concatenate([self.pending, new])
        while len(self.pending) >= self.stride + SUBSAMPLING_OVERLAP:
            self._run(self.pending[:self.stride + SUBSAMPLING_OVERLAP])
            self.pending = self.pending[self.stride:]
        return self.text()

    def finish(self) -> str:
        """Encode what is left of the audio; return the final hypothesis."""
        if len(self.pending) >= MIN_INPUT_FRAMES:
            self._run(self.pending)
        self.pending = self.pending[:0]
        self.search.finish()
        return self.text()

    def text(self) -> str:
        return self.search.text(self.tokenizer)


@dataclasses.dataclass(frozen=True)
class UtteranceResult:
    text: str
    seconds: float
    compute_seconds: float
    first_token_latency: float | None
    final_latency: float


def decode_utterance(recognizer: StreamingRecognizer, samples: np.ndarray, sample_rate: int,
                     piece_seconds: float = 0.1) -> UtteranceResult:
    """Feed `samples` in pieces of `piece_seconds`; the text and the latencies (see the
    module docstring)."""
    piece = max(1, int(piece_seconds * sample_rate))
    for start in range(0, len(samples), piece):
        recognizer.accept_waveform(sample_rate, samples[start:start + piece])
    text = recognizer.finish()
    options = recognizer.features.options
    duration = len(samples) / sample_rate
    done, first = 0.0, None
    for frames, seconds, tokens in recognizer.chunks:
        arrived = min(duration, ((frames - 1) * options.window_shift + options.window_size)
                      / options.sample_rate)
        done = max(done, arrived) + seconds
        if first is None and tokens:
            first = done
    return UtteranceResult(text, duration, sum(c[1] for c in recognizer.chunks), first,
                           max(done - duration, 0.0))


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {command}",
        description="Streaming greedy decoding of audio in chunks, with latencies.")
    parser.add_argument("exp_dir", help="experiment directory (hyper-p.json, config.json)")
    parser.add_argument("--wav-scp", required=True, help="Kaldi wav.scp of the audio")
    parser.add_argument("--chunk-size", type=int, required=True,
                        help="encoder output frames per chunk (within the trained range)")
    parser.add_argument("--checkpoint", help="checkpoint (default: stage 4's)")
    parser.add_argument("--piece-seconds", type=float, default=0.1,
                        help="audio fed per call (the result does not depend on it)")
    parser.add_argument("--out", required=True, help="output directory (hyp, stream.json)")
    parser.add_argument("--allow-config-change", action="store_true", default=None,
                        help="decode although config.json changed since the checkpoint was "
                             "trained (the changed keys are logged; default: hyper-p.json "
                             "inference.infer.option.allow_config_change)")
    parser.add_argument("--tlg", metavar="DIR",
                        help="streaming WFST decoding: the frame posteriors of a CTC or CTC-CRF "
                             "model through the TLG graph in DIR (TLG.fst, words.json: stage "
                             "5's exp/<name>/decode-lm/<setting>/graph, or built there from "
                             "--lm-arpa) instead of greedy search")
    parser.add_argument("--lm-arpa", metavar="ARPA",
                        help="--tlg: the word LM to build the graph from when DIR does not "
                             "hold it for these hotwords")
    parser.add_argument("--hotwords", metavar="FILE",
                        help="--tlg: phrases boosted in the graph (one per line, optional "
                             "' :score'; cat.decoding.wfst.hotword_boosts)")
    parser.add_argument("--hotwords-score", type=float, default=1.5,
                        help="--tlg --hotwords: the bonus per token of a phrase without its own")
    parser.add_argument("--lm-weight", type=float, default=1.0,
                        help="--tlg: the word LM's weight (stage 5's weights.json)")
    parser.add_argument("--beam", type=float, default=16.0, help="--tlg: the decoder's beam")
    return parser


def main(command: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of `cat.stream` and its aliases `cat.ctc.stream` / `cat.rnnt.stream`
    (`command`): the search is the family's `ChunkSearch` of `config.json`'s model kind."""
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    checkpoint = Path(args.checkpoint) if args.checkpoint else \
        select_checkpoint(args.exp_dir, load_hyper(Path(args.exp_dir) / HYPER_NAME))
    try:
        kind = experiment_kind(args.exp_dir)
        check_command(command, kind, str(Path(args.exp_dir) / CONFIG_NAME))
        model, tokenizer = load_model(args.exp_dir, checkpoint, kind, torch.device("cpu"),
                                      args.allow_config_change)
        encoder = StreamingEncoder(model.encoder, args.chunk_size)
        if (args.hotwords or args.lm_arpa) and not args.tlg:
            raise ValueError("--hotwords and --lm-arpa go with --tlg (streaming greedy search "
                             "has no hypotheses to favour a phrase among)")
        if args.tlg:
            from cat.decoding.wfst import TlgChunkSearch, check_frame_posteriors

            check_frame_posteriors(model)
            graph = _tlg_graph(args, tokenizer)

            def searcher(model: Any, chunk_size: int) -> ChunkSearch:
                return TlgChunkSearch(model, graph, lm_weight=args.lm_weight, beam=args.beam)
        else:
            searcher = family(kind, "stream").ChunkSearch
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    results = {}
    for key, spec in sorted(read_table(args.wav_scp).items()):
        samples, rate = read_audio(spec)
        recognizer = StreamingRecognizer(_chunk_encoder(encoder), encoder.stride,
                                         searcher(model, args.chunk_size), tokenizer)
        results[key] = decode_utterance(recognizer, samples, rate, args.piece_seconds)
    info = {"checkpoint": str(checkpoint), "chunk_size": args.chunk_size, "runtime": "pytorch"}
    if args.tlg:
        info.update(tlg=args.tlg, lm_weight=args.lm_weight, beam=args.beam,
                    hotwords=args.hotwords)
    write_summary(Path(args.out), results, info)
    return 0


def _tlg_graph(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The TLG of `--tlg` (with `--hotwords` boosted), built from `--lm-arpa` unless the
    directory holds it."""
    from cat.decoding.wfst import decoding_graph, hotword_boosts, read_graph

    if args.hotwords is None and args.lm_arpa is None:
        return read_graph(args.tlg)
    boosts = (hotword_boosts(args.hotwords, tokenizer, args.hotwords_score)
              if args.hotwords is not None else None)
    if args.lm_arpa is None:
        graph = read_graph(args.tlg)
        if graph.info.get("hotword_boosts", {}) != (boosts or {}):
            raise ValueError(f"{args.tlg}: the graph there was built for other hotwords; give "
                             "--lm-arpa to build it for these")
        return graph
    return decoding_graph(tokenizer, args.lm_arpa, args.tlg, boosts)


def _chunk_encoder(encoder: StreamingEncoder) -> Callable[[torch.Tensor], torch.Tensor]:
    state = list(encoder.initial_state())

    def encode(feats: torch.Tensor) -> torch.Tensor:
        out, state[0], state[1] = encoder(feats, state[0], state[1])
        return out

    return encode


def write_summary(out: PathLike, results: dict[str, UtteranceResult],
                  info: dict[str, Any]) -> dict[str, Any]:
    """`hyp` and `stream.json` (RTF, mean latencies) under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_hyp(out / "hyp", ((key, r.text) for key, r in results.items()))
    audio = sum(r.seconds for r in results.values())
    firsts = [r.first_token_latency for r in results.values() if r.first_token_latency is not None]
    summary = {**info, "num_utts": len(results), "audio_seconds": round(audio, 2),
               "rtf": sum(r.compute_seconds for r in results.values()) / max(audio, 1e-9),
               "mean_first_token_latency": float(np.mean(firsts)) if firsts else None,
               "mean_final_latency": float(np.mean([r.final_latency for r in results.values()]))}
    with atomic_write(out / "stream.json") as f:
        f.write(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), file=sys.stderr)
    return summary
