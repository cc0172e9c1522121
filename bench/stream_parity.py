"""Streaming in PyTorch vs the exported `streaming.onnx` in onnxruntime: identical
hypotheses and real-time factors of chunk-by-chunk greedy decoding of a test set's audio
(fed in 0.1 s pieces, one thread).

Usage (from the recipe directory, after stage 3 of a chunk-trained experiment):
    python ../../bench/stream_parity.py exp/synth-ctc-stream ctc --chunk-size 16 --limit 100
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cat.core.config import load_hyper
from cat.core.io import read_table
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.export import OnnxChunkEncoder
from cat.decoding.online import StreamingRecognizer, _chunk_encoder, decode_utterance
from cat.decoding.searcher import load_model
from cat.features.fbank import read_audio
from cat.models.chunked import StreamingEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exp")
    parser.add_argument("kind", choices=("ctc", "rnnt"))
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--set", default="test")
    parser.add_argument("--limit", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    family = __import__(f"cat.{args.kind}.export", fromlist=["export"])
    stream = __import__(f"cat.{args.kind}.stream", fromlist=["main"])
    export_dir = family.export(args.exp, Path(args.exp) / "export-stream", None,
                               args.chunk_size)
    checkpoint = select_checkpoint(args.exp, load_hyper(Path(args.exp) / "hyper-p.json"))
    model, tokenizer = load_model(args.exp, checkpoint, args.kind, torch.device("cpu"))
    encoder = StreamingEncoder(model.encoder, args.chunk_size)
    wavs = sorted(read_table(Path(f"data/{args.set}/wav.scp")).items())
    if args.limit:
        wavs = wavs[:args.limit]
    audio = {key: read_audio(spec) for key, spec in wavs}
    seconds = sum(len(s) / r for s, r in audio.values())
    onnx_encoder = OnnxChunkEncoder(export_dir)
    onnx_decoder = family.OnnxRnntDecoder(export_dir) if args.kind == "rnnt" else None
    runs = {}
    for name in ("pytorch", "onnxruntime"):
        hyps, start = {}, time.perf_counter()
        for key, (samples, rate) in audio.items():
            if name == "pytorch":
                recognizer = StreamingRecognizer(_chunk_encoder(encoder), encoder.stride,
                                                 stream.__dict__[
                                                     "CtcChunkSearch" if args.kind == "ctc"
                                                     else "RnntChunkSearch"](model), tokenizer)
            else:
                search = (family.OnnxCtcChunkSearch() if args.kind == "ctc" else
                          family.OnnxRnntChunkSearch(onnx_decoder))
                onnx_encoder.reset()
                recognizer = StreamingRecognizer(onnx_encoder, encoder.stride, search,
                                                 tokenizer)
            hyps[key] = decode_utterance(recognizer, samples, rate).text
        runs[name] = (hyps, (time.perf_counter() - start) / seconds)
    same = sum(runs["pytorch"][0][k] == runs["onnxruntime"][0][k] for k in audio)
    print(f"{args.exp} ({args.kind}), chunk {args.chunk_size}, {args.set}: {len(audio)} "
          f"utterances, {seconds:.0f} s; identical hypotheses {100 * same / len(audio):.1f} %")
    for name, (_, rtf) in runs.items():
        print(f"| {name} streaming | RTF {rtf:.4f} |")


if __name__ == "__main__":
    main()
