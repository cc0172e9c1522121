"""Silero VAD against the CTC head's own blank posteriors as the detector that cuts a long
recording into segments: cost, segments, errors.

    python bench/vad.py real                     # the 9-minute loop of bench/long_recording.py
    cd egs/aishell
    python ../../bench/vad.py synthetic exp/synth-ctc --wav-scp data/test/wav.scp \
        --text data/test/text

The long recording is `bench/long_recording.py`'s (run it first: `real` uses its learned
model and loop, `synthetic` its 1,403 s recording of the test utterances). For each
detector, the speech probability of every 32 ms:

* `silero`: `cat.audio.vad.SileroVad`, what `--vad silero` runs;
* `ctc-blank`: the CTC head's posteriors, computed on windows of `--window` seconds (memory
  bounded as decoding is), a frame being speech when its blank posterior is below 0.5;
  CTC emits a token on a frame or two and blank between the tokens of a word, so each
  32 ms frame gets the highest speech posterior within `--spread` seconds of it.

Both go through the same planning (`cat.decoding.segments.plan_cuts`, the default
settings), the segments are written as a Kaldi `segments` file and transcribed by `python
-m cat.decode --wav-scp ... --segments ...` (each alone, in batches) and their texts
joined in order. Printed per detector: seconds computing its probabilities (and as a
real-time factor), segments and their mean length, %CER of the joined text with
insertions / deletions / substitutions, and the share of 32 ms frames both call speech
or both call pause.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.audio.vad import FRAME_SAMPLES, FRAME_SECONDS, SileroVad
from cat.core.config import HYPER_NAME, load_hyper
from cat.core.io import read_table, write_table
from cat.decoding.audio import Segmenting
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.searcher import load_model
from cat.decoding.segments import plan_cuts
from cat.features.fbank import FbankOptions, compute_fbank
from cat.scoring import score

OUT = Path(__file__).resolve().parent / "out" / "long"


def silero(samples: np.ndarray) -> np.ndarray:
    return SileroVad().probabilities(samples)


def ctc_blank(samples: np.ndarray, exp_dir: str, checkpoint: str, window: float,
              spread: float) -> np.ndarray:
    """Speech probabilities per 32 ms from the CTC head's blank posteriors (see the doc)."""
    torch.set_num_threads(1)
    model, _ = load_model(exp_dir, checkpoint, torch.device("cpu"))
    frame = model.encoder.frame_rate_factor * 0.01
    speech: list[np.ndarray] = []
    step = round(window * 16000)
    for first in range(0, len(samples), step):
        chunk = samples[first:first + step]
        if len(chunk) < 400:
            break
        features = torch.from_numpy(compute_fbank(chunk, 16000, FbankOptions()))
        with torch.inference_mode():
            log_probs, lengths = model.log_probs(features[None], torch.tensor([len(features)]))
        posteriors = 1 - log_probs[0, :int(lengths[0]), 0].exp().numpy()
        # Encoder frames of this window at their place in the recording.
        expected = round(len(chunk) / 16000 / frame)
        speech.append(np.pad(posteriors, (0, max(0, expected - len(posteriors))))[:expected])
    per_frame = np.concatenate(speech) if speech else np.zeros(0)
    times = (np.arange(len(per_frame)) + 0.5) * frame
    frames = -(-len(samples) // FRAME_SAMPLES)
    out = np.zeros(frames, np.float32)
    reach = spread + FRAME_SECONDS / 2
    for index in range(frames):
        centre = (index + 0.5) * FRAME_SECONDS
        near = per_frame[np.searchsorted(times, centre - reach):
                         np.searchsorted(times, centre + reach)]
        out[index] = near.max() if len(near) else 0.0
    return out


def transcribe(exp_dir: str, wav: Path, cuts, tmp: Path, name: str) -> tuple[str, int]:
    """The joined text of the segments of `cuts`, each decoded alone."""
    segments = {f"seg{index:05d}": ("long", cut.first / 16000, cut.end / 16000)
                for index, cut in enumerate(cuts)}
    write_table(tmp / f"{name}.scp", [("long", str(wav))])
    write_table(tmp / f"{name}.segments",
                [(utt, f"{rec} {start:.3f} {end:.3f}") for utt, (rec, start, end)
                 in segments.items()])
    subprocess.run([sys.executable, "-m", "cat.decode", exp_dir, "--nj", "1", "--wav-scp",
                    str(tmp / f"{name}.scp"), "--segments", str(tmp / f"{name}.segments"),
                    "--out", str(tmp / name)], check=True, stderr=subprocess.DEVNULL)
    hyps = read_table(tmp / name / "hyp", allow_empty_value=True)
    return "".join(hyps[utt] for utt in sorted(hyps)), len(segments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", choices=["synthetic", "real"])
    parser.add_argument("exp_dir", nargs="?")
    parser.add_argument("--wav-scp", default="data/test/wav.scp")
    parser.add_argument("--text", default="data/test/text")
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--spread", type=float, default=0.3)
    args = parser.parse_args()
    if args.input == "real":
        import os

        from cat.testing.learned_speech import loop_recording, read_real_speech

        os.chdir(OUT / "learned")
        exp_dir, wav = "exp/learned", OUT / "loop-120x0.3.wav"
        speech = read_real_speech(Path(__file__).resolve().parents[1]
                                  / "tests/decoding/real_speech")
        reference = loop_recording(speech[0], 120, 0.3).text
    else:
        exp_dir = args.exp_dir
        texts = {utt: "".join(text.split()) for utt, text in read_table(args.text).items()}
        utts = [utt for utt in read_table(args.wav_scp) if utt in texts]
        wav = OUT / f"long-{len(utts)}x1.wav"
        reference = "".join(texts[utt] for utt in utts)
    if not wav.is_file():
        raise SystemExit(f"{wav}: missing; run bench/long_recording.py {args.input} first")
    samples = soundfile.read(wav, dtype="float32")[0]
    seconds = len(samples) / 16000
    checkpoint = str(select_checkpoint(exp_dir, load_hyper(Path(exp_dir) / HYPER_NAME)))
    settings = Segmenting()
    detectors = {"silero": lambda: silero(samples),
                 "ctc-blank": lambda: ctc_blank(samples, exp_dir, checkpoint, args.window,
                                                args.spread)}
    print(f"{wav.name}: {seconds:.0f} s")
    print("| detector | seconds (RTF) | segments (mean s) | %CER | ins / del / sub | "
          "frames agreeing with silero % |")
    print("|---|---:|---:|---:|---|---:|")
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, detect in detectors.items():
            start = time.perf_counter()
            probabilities = detect()
            spent = time.perf_counter() - start
            found[name] = probabilities >= settings.vad_threshold
            cuts = plan_cuts(probabilities, len(samples), settings.max_segment,
                             settings.vad_threshold, settings.vad_min_silence, settings.target)
            text, count = transcribe(exp_dir, wav, cuts, Path(tmp), name)
            result = score({"long": reference}, {"long": text})
            mean = sum(cut.end - cut.first for cut in cuts) / 16000 / max(count, 1)
            length = min(len(found[name]), len(found["silero"]))
            agree = 100 * np.mean(found[name][:length] == found["silero"][:length])
            print(f"| {name} | {spent:.1f} ({spent / seconds:.4f}) | {count} ({mean:.1f}) | "
                  f"{result.error_rate:.2f} | {result.insertions} / {result.deletions} / "
                  f"{result.substitutions} | {agree:.1f} |")


if __name__ == "__main__":
    main()
