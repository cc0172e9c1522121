"""Feature extraction speed: our stage-1 path and fbank alone, against kaldi-native-fbank.

Speeds are times real time per core (seconds of audio per second of one core's wall
time), measured on the same audio in the same run with one thread per process: a
warm-up, then the best of `--repeats` timed loops (the full path runs once, after a
warm-up on two utterances). Also prints the largest difference between our features and
kaldi-native-fbank's for one utterance. Without `--data-dir`, synthetic utterances
are generated.

Usage:
    python bench/fbank.py --seconds 300 --nj 1
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import kaldi_native_fbank
import numpy as np
import torch
from timing import best_time

from cat.audio.codec import resample
from cat.core.io import read_table
from cat.features.extract import extract
from cat.features.fbank import FbankOptions, compute_fbank, read_audio
from cat.testing.audio import make_data_dir, write_kaldi_data_dir


def peer_fbank(waveform: np.ndarray, options: FbankOptions, fetch: bool = True,
               ) -> np.ndarray | None:
    """kaldi-native-fbank with the options of ours: 80 bins, no dither, snip edges.

    Its Python API hands out one frame per call; `fetch=False` skips that step to
    show the cost of the computation alone.
    """
    peer_options = kaldi_native_fbank.FbankOptions()
    peer_options.frame_opts.samp_freq = options.sample_rate
    peer_options.frame_opts.dither = 0.0
    peer_options.frame_opts.snip_edges = True
    peer_options.mel_opts.num_bins = options.num_mel_bins
    fbank = kaldi_native_fbank.OnlineFbank(peer_options)
    fbank.accept_waveform(options.sample_rate, waveform * 32768.0)
    fbank.input_finished()
    if not fetch:
        return None
    return np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])


def load_waveforms(data_dir: Path, options: FbankOptions) -> list[np.ndarray]:
    """Every recording of wav.scp, at the feature sample rate."""
    waveforms = []
    for spec in read_table(data_dir / "wav.scp").values():
        waveform, rate = read_audio(spec)
        waveforms.append(resample(waveform, rate, options.sample_rate))
    return waveforms


def time_full_path(data_dir: Path, work_dir: Path, nj: int) -> float:
    """Wall time of `extract` (read + fbank + write ark) on the whole data dir."""
    wav_scp = read_table(data_dir / "wav.scp")
    warm_up = write_kaldi_data_dir(work_dir / "warm_up", dict(list(wav_scp.items())[:2]))
    extract(warm_up, work_dir / "warm_up_fbank", progress=False)
    feat_dir = work_dir / "fbank"
    shutil.rmtree(feat_dir, ignore_errors=True)
    start = time.perf_counter()
    extract(data_dir, feat_dir, nj=nj, progress=False)
    return time.perf_counter() - start


def print_table(rows: Sequence[tuple[str, float, float]], audio_seconds: float,
                peer_speed: float) -> None:
    print(f"{'path':<46} {'wall s':>8} {'xRT/core':>9} {'ours/peer':>10}")
    for name, seconds, cores in rows:
        speed = audio_seconds / seconds / cores
        print(f"{name:<46} {seconds:>8.2f} {speed:>9.1f} {speed / peer_speed:>10.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="seconds of synthetic audio (default %(default)s)")
    parser.add_argument("--utterance-seconds", type=float, default=6.0,
                        help="length of each synthetic utterance (default %(default)s)")
    parser.add_argument("--data-dir", type=Path, help="measure this Kaldi data dir instead")
    parser.add_argument("--nj", type=int, default=1, help="jobs of the full path (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops (default 3)")
    args = parser.parse_args(argv)
    # One thread per process gives a per-core figure; our jobs also use one thread each.
    torch.set_num_threads(1)
    options = FbankOptions()

    with tempfile.TemporaryDirectory(prefix="fbank-bench-") as tmp:
        work_dir = Path(tmp)
        data_dir = args.data_dir
        if data_dir is None:
            count = max(2, math.ceil(args.seconds / args.utterance_seconds))
            data_dir = make_data_dir(work_dir / "corpus", [args.utterance_seconds] * count)
        waveforms = load_waveforms(data_dir, options)
        audio_seconds = sum(len(w) for w in waveforms) / options.sample_rate

        ours = best_time(lambda: [compute_fbank(w, options.sample_rate) for w in waveforms],
                         args.repeats)
        peer = best_time(lambda: [peer_fbank(w, options) for w in waveforms], args.repeats)
        peer_compute = best_time(lambda: [peer_fbank(w, options, fetch=False) for w in waveforms],
                                 args.repeats)
        full = time_full_path(data_dir, work_dir, args.nj)
        difference = np.abs(compute_fbank(waveforms[0], options.sample_rate)
                            - peer_fbank(waveforms[0], options)).max()

    print(f"audio: {len(waveforms)} utterance(s), {audio_seconds:.1f} s; torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s) per process")
    peer_speed = audio_seconds / peer
    print_table([
        (f"ours: read + fbank + write ark (nj={args.nj})", full, args.nj),
        ("ours: fbank only (compute_fbank)", ours, 1),
        ("kaldi-native-fbank: fbank only (OnlineFbank)", peer, 1),
        ("kaldi-native-fbank: compute, frames not fetched", peer_compute, 1),
    ], audio_seconds, peer_speed)
    print(f"max |ours - kaldi-native-fbank| on utterance 1: {difference:.2e}")


if __name__ == "__main__":
    main()
