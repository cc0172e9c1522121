"""PyTorch vs onnxruntime vs sherpa-onnx on a test set: identical hypotheses, CER and
real-time factors of greedy search, side by side.

PyTorch is `python -m cat.<kind>.decode --method greedy` on stage 1's features (batched,
as stage 4 decodes); onnxruntime decodes the same features one utterance at a time with
the export (`OnnxCtcDecoder` / `OnnxRnntDecoder`); sherpa-onnx decodes the audio files
(fbank included) one at a time. All use one thread. The RNN-T search of PyTorch and
onnxruntime emits up to 3 tokens per frame, sherpa-onnx's 1.

Usage (from the recipe directory, after stage 3):
    python ../../bench/onnx_parity.py exp/synth-ctc-short ctc --set test
    python ../../bench/onnx_parity.py exp/synth-rnnt-stateless-short rnnt --set test --limit 300
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import soundfile
import torch

from cat.core.config import load_hyper, tokenizer_file
from cat.core.io import read_table
from cat.decoding.export import export, sherpa_recognizer
from cat.scoring import score
from cat.text.tokenizer import load as load_tokenizer


def _pytorch(exp: str, kind: str, data: str, out: Path,
             checkpoint: str | None) -> tuple[dict[str, str], float]:
    command = [sys.executable, "-m", f"cat.{kind}.decode", exp, "--data", data, "--out",
               str(out), "--method", "greedy", "--nj", "1", "--device", "cpu"]
    if checkpoint:
        command += ["--checkpoint", checkpoint]
    result = subprocess.run(command, capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    rtf = float(re.search(r"RTF ([0-9.]+)", result.stderr).group(1))
    return read_table(out / "hyp", allow_empty_value=True), rtf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exp")
    parser.add_argument("kind", choices=("ctc", "rnnt"))
    parser.add_argument("--set", default="test")
    parser.add_argument("--wav-scp", help="audio of the set (default: data/SET/wav.scp)")
    parser.add_argument("--checkpoint", help="checkpoint (default: stage 4's)")
    parser.add_argument("--limit", type=int, default=0, help="first N utterances (0: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = __import__(f"cat.{args.kind}.export", fromlist=["export"])
    export_dir = export(args.exp, None, args.checkpoint, kind=args.kind)
    feats_scp = Path(f"data/fbank/{args.set}/feats.scp")
    keys = sorted(read_table(feats_scp))
    if args.limit:
        keys = keys[:args.limit]
    data = Path(args.exp) / f"bench-onnx/{args.set}-data"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("feats.scp", "text", "utt2num_frames"):
        table = read_table(feats_scp.parent / name)
        (data / name).write_text("".join(f"{k} {table[k]}\n" for k in keys), encoding="utf-8")
    refs = read_table(data / "text")
    frames = read_table(data / "utt2num_frames")
    seconds = sum(int(frames[k]) for k in keys) / 100

    torch_hyps, torch_rtf = _pytorch(args.exp, args.kind, str(data),
                                     Path(args.exp) / f"bench-onnx/{args.set}-pytorch",
                                     args.checkpoint)
    runner_class = module.OnnxCtcDecoder if args.kind == "ctc" else module.OnnxRnntDecoder
    runner = runner_class(export_dir)
    hyper_path = Path(args.exp) / "hyper-p.json"
    tokenizer = load_tokenizer(tokenizer_file(load_hyper(hyper_path), str(hyper_path)))
    features = {k: np.array(m) for k, m in kaldiio.load_scp(str(data / "feats.scp")).items()}
    start = time.perf_counter()
    ort_hyps = {k: tokenizer.decode(runner.decode(features[k])) for k in keys}
    ort_rtf = (time.perf_counter() - start) / seconds

    wavs = read_table(Path(args.wav_scp or f"data/{args.set}/wav.scp"))
    audio = {k: soundfile.read(wavs[k], dtype="float32") for k in keys}
    recognizer = sherpa_recognizer(export_dir)
    start = time.perf_counter()
    sherpa_hyps = {}
    for k in keys:
        stream = recognizer.create_stream()
        stream.accept_waveform(audio[k][1], audio[k][0])
        recognizer.decode_stream(stream)
        sherpa_hyps[k] = stream.result.text
    sherpa_rtf = (time.perf_counter() - start) / seconds

    def same(hyps: dict[str, str]) -> float:
        def strip(text: str) -> str:
            return re.sub(r"\s", "", text)
        return 100 * float(np.mean([strip(hyps[k]) == strip(torch_hyps.get(k, ""))
                                    for k in keys]))

    print(f"{args.exp} ({args.kind}), {args.set}: {len(keys)} utterances, "
          f"{seconds:.0f} s of audio")
    print("| runtime | identical to PyTorch (%) | CER (%) | RTF |")
    print("|---|---:|---:|---:|")
    for name, hyps, rtf in (("PyTorch (cat decode, batched)", torch_hyps, torch_rtf),
                            ("onnxruntime (features, per utterance)", ort_hyps, ort_rtf),
                            ("sherpa-onnx (audio, per utterance)", sherpa_hyps, sherpa_rtf)):
        cer = score(refs, {k: hyps.get(k, "") for k in keys}).error_rate
        print(f"| {name} | {same(hyps):.1f} | {cer:.2f} | {rtf:.4f} |")


if __name__ == "__main__":
    main()
