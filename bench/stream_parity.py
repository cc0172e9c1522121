"""Streaming in PyTorch vs the exported `streaming.onnx` in onnxruntime, and in sherpa-onnx's
`OnlineRecognizer` (CTC: `streaming_wenet_ctc.onnx`, model type `wenet_ctc`; RNN-T with a
stateless predictor: `streaming_encoder_lstm.onnx`, model type `lstm`): identical
hypotheses and real-time factors of chunk-by-chunk greedy decoding of a test set's audio
(fed in 0.1 s pieces, one thread), of U2 and CUSIDE models alike. sherpa-onnx decodes whole
chunks only (a chunk once a frame after it has come), so its audio is followed by 1 s of
silence (what its examples do), and it is compared with PyTorch streaming of the same
padded audio, whole chunks only as sherpa-onnx decodes them (row `pytorch, padded`: the
hypothesis before `finish`, of all but the last frame); for CTC its cache holds
`--num-left-chunks` chunks. sherpa-onnx's transducer search emits one token per frame at
most, so the transducer rows all do. CER of each runtime against the set's `text`.

Usage (from the recipe directory, after stage 3 of a chunk-trained experiment):
    python ../../bench/stream_parity.py exp/synth-ctc-stream ctc --chunk-size 16 --limit 100
    python ../../bench/stream_parity.py exp/gap-cuside ctc --chunk-size 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from cat.core.config import load_hyper
from cat.core.io import read_table
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.export import export, onnx_chunk_encoder
from cat.decoding.online import StreamingRecognizer, decode_utterance, streaming_encoder
from cat.decoding.searcher import load_model
from cat.features.fbank import experiment_front_end, read_audio
from cat.scoring import score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exp")
    parser.add_argument("kind", choices=("ctc", "rnnt"))
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--set", default="test")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--num-left-chunks", type=int, default=16,
                        help="sherpa-onnx's attention cache, in chunks")
    parser.add_argument("--sherpa-factory", action="store_true",
                        help="CTC: build sherpa-onnx's recognizer with its own factory "
                             "(OnlineRecognizer.from_wenet_ctc, its fbank defaults) instead "
                             "of export.json's fbank settings: a model of data.front_end "
                             "sherpa-onnx")
    args = parser.parse_args()
    torch.set_num_threads(1)
    family = __import__(f"cat.{args.kind}.export", fromlist=["export"])
    stream = __import__(f"cat.{args.kind}.stream", fromlist=["main"])
    export_dir = export(args.exp, Path(args.exp) / "export-stream", None, args.chunk_size,
                        kind=args.kind)
    hyper = load_hyper(Path(args.exp) / "hyper-p.json")
    checkpoint = select_checkpoint(args.exp, hyper)
    fbank = experiment_front_end(hyper)
    model, tokenizer = load_model(args.exp, checkpoint, torch.device("cpu"))
    wavs = sorted(read_table(Path(f"data/{args.set}/wav.scp")).items())
    if args.limit:
        wavs = wavs[:args.limit]
    audio = {key: read_audio(spec) for key, spec in wavs}
    seconds = sum(len(s) / r for s, r in audio.values())
    onnx_encoder = onnx_chunk_encoder(export_dir)
    onnx_decoder = family.OnnxRnntDecoder(export_dir) if args.kind == "rnnt" else None
    runs = {}
    names = ("pytorch", "onnxruntime", "pytorch, padded", "sherpa-onnx")
    if args.kind == "rnnt":
        stream.MAX_SYMBOLS_PER_FRAME = 1  # as sherpa-onnx's greedy search
        family.MAX_SYMBOLS_PER_FRAME = 1
    for name in names:
        hyps, start = {}, time.perf_counter()
        if name == "sherpa-onnx":
            sherpa = _sherpa(family, export_dir, args)
        for key, (samples, rate) in audio.items():
            if name == "sherpa-onnx":
                hyps[key] = _sherpa_decode(sherpa, samples, rate)
                continue
            if name == "pytorch, padded":  # sherpa-onnx's audio but its last frame
                samples = np.concatenate([samples, np.zeros(rate, np.float32)])[:-(rate // 100)]
            if name.startswith("pytorch"):
                recognizer = StreamingRecognizer(streaming_encoder(model, args.chunk_size),
                                                 stream.__dict__[
                                                     "CtcChunkSearch" if args.kind == "ctc"
                                                     else "RnntChunkSearch"](model), tokenizer,
                                                 fbank)
            else:
                search = (family.OnnxCtcChunkSearch() if args.kind == "ctc" else
                          family.OnnxRnntChunkSearch(onnx_decoder))
                onnx_encoder.reset()
                recognizer = StreamingRecognizer(onnx_encoder, search, tokenizer, fbank)
            if name == "pytorch, padded":  # whole chunks only: no finish()
                for begin in range(0, len(samples), rate // 10):
                    recognizer.accept_waveform(rate, samples[begin:begin + rate // 10])
                hyps[key] = recognizer.text()
                continue
            hyps[key] = decode_utterance(recognizer, samples, rate).text
        runs[name] = (hyps, (time.perf_counter() - start) / seconds)
    refs = {key: text for key, text in read_table(Path(f"data/{args.set}/text")).items()
            if key in audio}
    print(f"{args.exp} ({args.kind}), chunk {args.chunk_size}, {args.set}: {len(audio)} "
          f"utterances, {seconds:.0f} s")
    print("| runtime | identical to PyTorch on the same audio (%) | CER | RTF |\n"
          "|---|---:|---:|---:|")
    for name, (hyps, rtf) in runs.items():
        reference = runs["pytorch, padded" if name == "sherpa-onnx" else "pytorch"][0]
        same = sum(_plain(reference[k]) == _plain(hyps[k]) for k in audio)
        cer = score(refs, hyps, "char").error_rate
        print(f"| {name} | {100 * same / len(audio):.1f} | {cer:.2f} | {rtf:.4f} |")


def _sherpa(family, export_dir: Path, args: argparse.Namespace):
    """sherpa-onnx's online recognizer of the export: by its own factory, or configured with
    export.json's fbank settings."""
    if args.kind == "rnnt":
        return family.sherpa_online_recognizer(export_dir)
    if not args.sherpa_factory:
        return family.sherpa_online_recognizer(export_dir, args.num_left_chunks)
    import sherpa_onnx

    return sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
        tokens=str(export_dir / "tokens.txt"), model=str(export_dir / family.WENET_CTC_NAME),
        chunk_size=args.chunk_size, num_left_chunks=args.num_left_chunks, num_threads=1)


def _plain(text: str) -> str:
    """A hypothesis without white space or SentencePiece's word marks."""
    return "".join(text.replace("\u2581", " ").split())


def _sherpa_decode(recognizer, samples, rate: int) -> str:
    """sherpa-onnx's online result of `samples` fed in 0.1 s pieces, then 1 s of silence."""
    stream = recognizer.create_stream()
    padded = np.concatenate([samples, np.zeros(rate, np.float32)])
    piece = rate // 10
    for start in range(0, len(padded), piece):
        stream.accept_waveform(rate, padded[start:start + piece])
        while recognizer.is_ready(stream):
            recognizer.decode_stream(stream)
    stream.input_finished()
    while recognizer.is_ready(stream):
        recognizer.decode_stream(stream)
    return "".join(recognizer.get_result_all(stream).tokens)


if __name__ == "__main__":
    main()
