"""Benchmark: packing audio shards (wav, flac, opus) against feature shards, same utterances.

Synthesizes Mandarin speech as `bench/audio_bytes.py` does (espeak-ng voices, silences,
a 20-45 dB noise floor), repeats it into `--utterances` utterances of a few seconds,
and lays them out twice:

* AISHELL-like: one 16 kHz WAV file per utterance (`wav.scp` + `text`);
* WenetSpeech-like: the same audio concatenated into long Ogg Opus recordings of about
  `--recording-seconds` seconds, cut by a `segments` file.

Then it times, best of `--repeat` runs from an empty output folder (page-cached input):

* the feature path: stage 1 (`cat.features.extract`, 80-dim fbank into arks) and
  stage 2 (`pack_data`, feature shards), and the two together;
* `pack_audio` into wav, flac and opus (32 kbit/s) shards, from the WAV files and from
  the long Opus recordings, for each `--nj`.

For each it prints the seconds, the hours of audio packed per second (and the same as
a real-time factor), the MB/s of shards written, the shard MB per hour of audio, and the
speed relative to `pack_data` (which only copies features that stage 1 computed) and to
stage 1 + `pack_data` (what an audio shard replaces).

Usage:
    python bench/pack_audio.py --utterances 400 --nj 1 2 --repeat 2
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import soundfile
import torch

# Sibling benchmarks: their synthesis and timing (run as a script, bench/ is on sys.path).
from audio_bytes import make_speech
from timing import best_time

from cat.core.io import write_table
from cat.features.extract import extract
from cat.formats.audio_pack import pack_audio
from cat.formats.prep_wds import pack_data

RATE = 16000
MEGABYTE = 1e6
HOUR = 3600.0


def write_corpus(root: Path, speech: list[np.ndarray], count: int,
                 recording_seconds: float) -> tuple[Path, Path, float]:
    """The two data dirs (one WAV per utterance; long Opus recordings with segments)."""
    whole, long = root / "whole", root / "long"
    for folder in (whole / "audio", long / "audio"):
        folder.mkdir(parents=True)
    wav_scp, text, segments, recordings = {}, {}, {}, {}
    pending: list[tuple[str, np.ndarray]] = []

    def flush() -> None:
        name = f"R{len(recordings):05d}"
        path = long / "audio" / f"{name}.opus"
        soundfile.write(path, np.concatenate([a for _, a in pending]), RATE, format="OGG",
                        subtype="OPUS")
        recordings[name] = str(path)
        start = 0
        for utt, audio in pending:
            segments[utt] = f"{name} {start / RATE:.4f} {(start + len(audio)) / RATE:.4f}"
            start += len(audio)
        pending.clear()

    seconds = 0.0
    for index in range(count):
        utt = f"U{index:06d}"
        audio = speech[index % len(speech)]
        path = whole / "audio" / f"{utt}.wav"
        soundfile.write(path, audio, RATE, subtype="PCM_16")
        wav_scp[utt] = str(path)
        text[utt] = "今天 天气 很 好"
        seconds += len(audio) / RATE
        pending.append((utt, audio))
        if sum(len(a) for _, a in pending) >= recording_seconds * RATE:
            flush()
    if pending:
        flush()
    write_table(whole / "wav.scp", wav_scp.items())
    write_table(whole / "text", text.items())
    write_table(long / "wav.scp", recordings.items())
    write_table(long / "segments", segments.items())
    write_table(long / "text", text.items())
    return whole, long, seconds


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print one line per method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=400, help="utterances packed")
    parser.add_argument("--distinct", type=int, default=24,
                        help="distinct synthesized utterances (repeated up to --utterances)")
    parser.add_argument("--recording-seconds", type=float, default=120.0,
                        help="length of the long recordings of the segmented layout")
    parser.add_argument("--utts-per-file", type=int, default=50, help="utterances per shard")
    parser.add_argument("--nj", type=int, nargs="+", default=[1, 2],
                        help="process counts to measure")
    parser.add_argument("--repeat", type=int, default=2, help="runs per method; best kept")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pack-audio-"))
    try:
        speech = make_speech(args.distinct, seed=0)
        whole, long, seconds = write_corpus(workdir / "corpus", speech, args.utterances,
                                            args.recording_seconds)
        num_recordings = len((long / "wav.scp").read_text(encoding="utf-8").splitlines())
        print(f"corpus: {args.utterances} utterances, {seconds / HOUR:.3f} h of speech "
              f"({seconds / args.utterances:.1f} s each); {num_recordings} long Opus "
              f"recordings; {args.utts_per_file} utterances per shard; 1 torch thread")
        print(f"{'method':<40} {'s':>7} {'audio h/s':>9} {'xRT':>7} {'MB/s':>7} "
              f"{'MB/h':>7} {'vs pack_data':>12} {'vs stage1+pack':>14}")
        rows: list[tuple[str, float, float]] = []  # (name, seconds, shard bytes)
        fbank = workdir / "fbank"
        out = workdir / "shards"

        def clear(*paths: Path) -> Callable[[], None]:
            return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]

        def shard_bytes() -> float:
            return float(sum(p.stat().st_size for p in out.rglob("*.tar")))

        for num_jobs in args.nj:
            stage1 = best_time(lambda nj=num_jobs: extract(whole, fbank, nj=nj,
                                                            progress=False),
                                args.repeat, prepare=clear(fbank), warm_up=False)
            rows.append((f"stage 1 fbank nj={num_jobs}", stage1, 0.0))
            pack = best_time(lambda nj=num_jobs: pack_data(
                fbank / "feats.scp", fbank / "text", out, utts_per_file=args.utts_per_file,
                num_jobs=nj), args.repeat, prepare=clear(out), warm_up=False)
            rows.append((f"pack_data (features) nj={num_jobs}", pack, shard_bytes()))
            rows.append((f"stage 1 + pack_data nj={num_jobs}", stage1 + pack, shard_bytes()))
            for source, data in (("wav files", whole), ("long opus", long)):
                for audio_format in ("wav", "flac", "opus"):
                    took = best_time(lambda d=data, f=audio_format, nj=num_jobs: pack_audio(
                        d, out, f, utts_per_file=args.utts_per_file, num_jobs=nj),
                        args.repeat, prepare=clear(out), warm_up=False)
                    rows.append((f"pack_audio {audio_format} from {source} nj={num_jobs}",
                                 took, shard_bytes()))
            _print(rows, seconds, num_jobs)
            rows.clear()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _print(rows: list[tuple[str, float, float]], seconds: float, num_jobs: int) -> None:
    times = {name: took for name, took, _ in rows}
    features = times[f"pack_data (features) nj={num_jobs}"]
    both = times[f"stage 1 + pack_data nj={num_jobs}"]
    for name, took, size in rows:
        rate = seconds / HOUR / took
        written = f"{size / MEGABYTE / took:7.1f} {size / MEGABYTE / (seconds / HOUR):7.1f}" \
            if size else f"{'-':>7} {'-':>7}"
        print(f"{name:<40} {took:7.2f} {rate:9.2f} {seconds / took:7.0f} {written} "
              f"{features / took:12.2f} {both / took:14.2f}")


if __name__ == "__main__":
    main()
