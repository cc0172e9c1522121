"""A long recording of test utterances end to end, transcribed in windows, against its parts.

    cd egs/aishell
    python ../../bench/long_recording.py exp/synth-ctc [--checkpoint CKPT] \
        --wav-scp data/test/wav.scp --text data/test/text [--num-utts 0] \
        --max-segment 20 --segment-overlap 4 --repeats 1 4

Writes `bench/out/long/long-<repeats>.wav`: the utterances of `--wav-scp` (the first
`--num-utts`, 0: all) one after the other, the list `--repeats` times over, and its
reference (their transcripts in the same order). Then, each a `python -m cat.decode`
process with one job (`--nj 1`), its peak RSS from `wait4`:

* the parts: the utterances of the list decoded one by one (`--wav-scp`);
* each long recording: `--audio long-<repeats>.wav --max-segment ... --segment-overlap
  ...`, one utterance of the whole length.

Printed per run: audio seconds, %CER (insertions, deletions and substitutions), peak RSS
and wall seconds. The long recording's CER is that of one utterance of all the
characters; the windows' seams are where it can differ from the parts'.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table, write_table
from cat.utils.wer import score

OUT = Path(__file__).resolve().parent / "out" / "long"


def run(command: list[str]) -> tuple[float, float]:
    """Run a command; its peak RSS (MB) and wall seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(process.pid, 0)
    errors = process.stderr.read().decode()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command)} failed:\n{errors[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def write_long(wavs: dict[str, str], texts: dict[str, str], repeats: int) -> tuple[Path, str]:
    """The long recording (written once) and its reference text."""
    path = OUT / f"long-{len(wavs)}x{repeats}.wav"
    if not path.is_file():
        OUT.mkdir(parents=True, exist_ok=True)
        with soundfile.SoundFile(path.with_suffix(".tmp"), "w", 16000, 1, "PCM_16",
                                 format="WAV") as out:
            for _ in range(repeats):
                for utt in wavs:
                    samples, rate = soundfile.read(wavs[utt], dtype="int16")
                    if rate != 16000:
                        raise SystemExit(f"{wavs[utt]}: {rate} Hz; the bench joins 16 kHz audio")
                    out.write(np.asarray(samples))
        os.replace(path.with_suffix(".tmp"), path)
    return path, "".join(texts[utt] for utt in wavs) * repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exp_dir")
    parser.add_argument("--checkpoint")
    parser.add_argument("--wav-scp", default="data/test/wav.scp")
    parser.add_argument("--text", default="data/test/text")
    parser.add_argument("--num-utts", type=int, default=0)
    parser.add_argument("--max-segment", type=float, default=20.0)
    parser.add_argument("--segment-overlap", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    texts = {utt: "".join(text.split()) for utt, text in read_table(args.text).items()}
    wavs = {utt: spec for utt, spec in read_table(args.wav_scp).items() if utt in texts}
    if args.num_utts:
        wavs = dict(list(wavs.items())[:args.num_utts])
    decode = [sys.executable, "-m", "cat.decode", args.exp_dir, "--nj", "1"]
    if args.checkpoint:
        decode += ["--checkpoint", args.checkpoint]
    print("| input | audio s | %CER | ins / del / sub | peak RSS MB | wall s |")
    print("|---|---:|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        write_table(Path(tmp) / "wav.scp", wavs.items(), sort=False)
        peak, wall = run([*decode, "--wav-scp", str(Path(tmp) / "wav.scp"), "--out",
                          f"{tmp}/parts"])
        result = score({utt: texts[utt] for utt in wavs},
                       read_table(Path(tmp) / "parts/hyp", allow_empty_value=True))
        seconds = sum(soundfile.info(spec).duration for spec in wavs.values())
        print(f"| {len(wavs)} parts | {seconds:.0f} | {result.error_rate:.2f} | "
              f"{result.insertions} / {result.deletions} / {result.substitutions} | "
              f"{peak:.0f} | {wall:.1f} |")
        for repeats in args.repeats:
            long, reference = write_long(wavs, texts, repeats)
            out = f"{tmp}/long-{repeats}"
            peak, wall = run([*decode, "--audio", str(long), "--max-segment",
                              str(args.max_segment), "--segment-overlap",
                              str(args.segment_overlap), "--out", out])
            result = score({long.stem: reference},
                           read_table(Path(out) / "hyp", allow_empty_value=True))
            print(f"| 1 recording ({repeats} x the parts), windows of {args.max_segment:g} s "
                  f"overlapping {args.segment_overlap:g} s | "
                  f"{soundfile.info(long).duration:.0f} | {result.error_rate:.2f} | "
                  f"{result.insertions} / {result.deletions} / {result.substitutions} | "
                  f"{peak:.0f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
