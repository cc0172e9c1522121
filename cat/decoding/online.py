"""Streaming recognition: audio in pieces of any size -> fbank frames -> encoder chunks ->
partial hypotheses, and its command line (`python -m cat.stream`; CAT-style aliases
`cat.ctc.stream`, `cat.rnnt.stream`).

`StreamingRecognizer` takes a `ChunkEncoder` (`streaming_encoder(model, chunk_size)`: that
of the model's streaming strategy, `AsrModel.streaming`, `cat.models.streaming`: U2's
caches or CUSIDE's windows; or an export's `streaming.onnx` in onnxruntime,
`cat.decoding.export.onnx_chunk_encoder`) and a family's chunk search
(`step(encoder_out)`, `tokens`). Stage 1's fbank is computed as the audio comes: a frame's
window only covers its own samples, so the frames are those of the whole recording however
the audio is cut. A chunk is encoded as soon as its frames are there (its stride and the
frames it reads beyond, `lookahead`: the subsampling's 3 for U2, a CUSIDE model's real
right context);
`finish()` encodes what is left. Hypotheses equal those of decoding the whole utterance in
the same chunks (`python -m cat.decode --chunk-size N`, `AsrModel.set_decode_chunk_size`:
the chunk-masked forward, CUSIDE's chunked forward). `--right-context` chooses among the
right contexts of strategies that have them (a CUSIDE model's `simulated | real | none`;
default: simulated with a simulation network).

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
    python -m cat.stream exp/synth-ctc-cuside --wav-scp data/test/wav.scp \
        --chunk-size 12 --out exp/synth-ctc-cuside/stream-c12/test
    python -m cat.stream exp/synth-crf-cuside --wav-scp data/test/wav.scp --chunk-size 16 \
        --tlg exp/synth-crf-cuside/decode-lm/word-3gram-tlg/graph --lm-weight 0.5 \
        --out exp/synth-crf-cuside/stream-tlg-c16/test
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
from cat.features.fbank import (
    FbankOptions,
    compute_fbank,
    experiment_front_end,
    num_frames,
    read_audio,
)
from cat.models.registry import check_command, family
from cat.models.streaming import ChunkEncoder, StreamingError, right_context_choices

logger = logging.getLogger(__name__)


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


class FeatureStream:
    """Stage 1's fbank (of the experiment's front end, `options`) of audio given in pieces:
    `accept` returns the frames whose windows the audio so far holds, `flush` at the end
    the last ones, whose windows reach past it (without `snip_edges`: reflected, as the
    whole recording's). The frames are those of `compute_fbank` of the whole audio."""

    def __init__(self, options: FbankOptions | None = None) -> None:
        self.options = options or FbankOptions()
        self.samples = np.zeros(0, np.float32)  # from sample `base` on
        self.base = self.total = self.done = 0

    def accept(self, sample_rate: int, samples: np.ndarray) -> np.ndarray:
        if sample_rate != self.options.sample_rate:
            raise StreamingError(f"audio at {sample_rate} Hz: the model takes "
                                 f"{self.options.sample_rate} Hz audio; resample it first")
        self.samples = np.concatenate([self.samples, np.asarray(samples, np.float32)])
        self.total += len(samples)
        options = self.options
        # Frames whose window ends within the samples so far.
        ready = (self.total - options.window_size - options.first_sample) // \
            options.window_shift + 1
        return self._frames(max(ready, self.done), final=False)

    def flush(self) -> np.ndarray:
        """The frames left at the end of the audio (none with `snip_edges`)."""
        return self._frames(num_frames(self.total, self.options), final=True)

    def _frames(self, last: int, final: bool) -> np.ndarray:
        options = self.options
        first, shift = self.done, options.window_shift
        if last <= first:
            return np.zeros((0, options.num_mel_bins), np.float32)
        index = np.arange(first * shift + options.first_sample,
                          (last - 1) * shift + options.first_sample + options.window_size)
        index = np.where(index < 0, -index - 1, index)  # Kaldi's reflection at the ends
        if final:
            index = np.where(index >= self.total, 2 * self.total - 1 - index, index)
        # The frames' windows, one after the other, as whole windows of their own.
        frames = compute_fbank(self.samples[index - self.base], options.sample_rate,
                               dataclasses.replace(options, snip_edges=True))
        self.done = last
        keep = max(0, last * shift + options.first_sample)
        self.samples, self.base = self.samples[keep - self.base:], keep
        return frames


def streaming_encoder(model: Any, chunk_size: int,
                      right_context: str | None = None) -> ChunkEncoder:
    """The `ChunkEncoder` of `model` in chunks of `chunk_size` encoder frames, with
    `right_context`: its streaming strategy's (`AsrModel.streaming`). ValueError for chunks
    or a right context the model cannot stream with."""
    return model.streaming.chunk_encoder(chunk_size, right_context)


class StreamingRecognizer:
    """Audio pieces -> chunks -> `search`; `text()` is the partial hypothesis. `fbank`: the
    experiment's front end (`cat.features.fbank.experiment_front_end`; default Kaldi's)."""

    def __init__(self, encoder: ChunkEncoder, search: ChunkSearch, tokenizer: Any,
                 fbank: FbankOptions | None = None) -> None:
        self.encoder, self.search = encoder, search
        self.stride, self.lookahead = encoder.stride, encoder.lookahead
        self.tokenizer = tokenizer
        self.features = FeatureStream(fbank)
        self.pending = np.zeros((0, self.features.options.num_mel_bins), np.float32)
        self.frames_seen = 0
        # (feature frames the chunk needed, seconds it took, tokens after it) per chunk
        self.chunks: list[tuple[int, float, int]] = []

    def _run(self, frames: np.ndarray, encode: Callable[[torch.Tensor], torch.Tensor]) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            out = encode(torch.from_numpy(frames)[None])[0]
            if out.size(0):
                self.search.step(out)
        needed = self.frames_seen - len(self.pending) + len(frames)
        self.chunks.append((needed, time.perf_counter() - start, len(self.search.tokens)))

    def accept_waveform(self, sample_rate: int, samples: np.ndarray) -> str:
        """Take the next piece of audio; return the hypothesis so far."""
        new = self.features.accept(sample_rate, samples)
        self.frames_seen += len(new)
        self.pending = np.concatenate([self.pending, new])
        while len(self.pending) >= self.stride + self.lookahead:
            self._run(self.pending[:self.stride + self.lookahead], self.encoder)
            self.pending = self.pending[self.stride:]
        return self.text()

    def finish(self) -> str:
        """Encode what is left of the audio; return the final hypothesis."""
        last = self.features.flush()
        self.frames_seen += len(last)
        self.pending = np.concatenate([self.pending, last])
        while len(self.pending) >= self.stride + self.lookahead:
            self._run(self.pending[:self.stride + self.lookahead], self.encoder)
            self.pending = self.pending[self.stride:]
        if len(self.pending):
            self._run(self.pending, self.encoder.finish)
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
    parser.add_argument("--right-context", choices=right_context_choices(),
                        help="CUSIDE models: each chunk's right context (default: simulated "
                             "with trainer.simu, else real, which waits for its frames)")
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
    hyper = load_hyper(Path(args.exp_dir) / HYPER_NAME)
    checkpoint = Path(args.checkpoint) if args.checkpoint else \
        select_checkpoint(args.exp_dir, hyper)
    fbank = experiment_front_end(hyper)
    try:
        kind = experiment_kind(args.exp_dir)
        check_command(command, kind, str(Path(args.exp_dir) / CONFIG_NAME))
        model, tokenizer = load_model(args.exp_dir, checkpoint, torch.device("cpu"),
                                      args.allow_config_change)
        encoder = streaming_encoder(model, args.chunk_size, args.right_context)
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
        recognizer = StreamingRecognizer(streaming_encoder(model, args.chunk_size,
                                                           args.right_context),
                                         searcher(model, args.chunk_size), tokenizer, fbank)
        results[key] = decode_utterance(recognizer, samples, rate, args.piece_seconds)
    info = {"checkpoint": str(checkpoint), "chunk_size": args.chunk_size, "runtime": "pytorch"}
    if encoder.right_context is not None:
        info["right_context"] = encoder.right_context
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
