"""Benchmark: streaming audio shards (features on the fly) against feature shards, per worker.

The same utterances of synthetic Mandarin (as `bench/audio_bytes.py` makes them: espeak-ng
voices, silences, a 20-45 dB noise floor; a few seconds each) are packed as opus
(32 kbit/s) and flac audio shards (`pack_audio`) and as float32 feature shards (stage 1
fbank, then `pack_data`), and read to padded batches by:

* `stream <format> sp`   the training loader (`ShardStream`, one DataLoader worker) over
                         audio shards: decode, speed perturbation by a factor drawn from
                         0.9/1.0/1.1 per utterance, 80-dim fbank, tokenize, shuffle, sort,
                         pad; `no sp` without the speed perturbation;
* `stream features`      the same loader over the feature shards (no audio work at all);
* `wenet-style`          the baseline: a plain loop in one process over the opus shards,
                         as WeNet's UIO processors do it: `tarfile` members, decode
                         (soundfile, since torchaudio.load needs FFmpeg), speed
                         perturbation with `torchaudio.functional.resample` from
                         rate x factor to rate (torchaudio's sox effects are gone from
                         this torchaudio), then
                         `torchaudio.compliance.kaldi.fbank` per utterance (80 bins,
                         dither 0) and padding into batches of the same size.

Then the opus loader again with the shards read over HTTP (`python -m http.server` in its
own process on 127.0.0.1) and from an S3 object store (SeaweedFS on 127.0.0.1, started
by the benchmark) instead of the local disk (warm page cache).

Every loader runs with one worker process and one torch thread (the main process only
moves batches), an untimed warm-up epoch, then `--repeats` timed epochs, median kept.
Rates: utterances/s and seconds of audio per second (x real time, per core: one worker
is one core). `cores for 1,000 utt/s` = 1000 / (utterances/s of one worker).

Usage:
    python bench/audio_loader.py --utterances 600 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import statistics
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile
import torch
import torchaudio

# The synthesis and corpus layout of sibling benchmarks (bench/ is on sys.path).
from audio_bytes import make_speech
from pack_audio import write_corpus

from cat.features.extract import extract
from cat.formats.audio_pack import pack_audio
from cat.formats.prep_wds import pack_data
from cat.loading.batch import collate
from cat.loading.samples import AudioConfig, StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.loading.transport import RingLoader, SharedCollate
from cat.testing.seaweedfs import seaweedfs_s3
from cat.testing.shards import serve_directory_process
from cat.text import tokenizer as tk

RATE = 16000
SPEEDS = (0.9, 1.0, 1.1)


def _epochs(stream: ShardStream, repeats: int) -> float:
    """Median seconds of `repeats` epochs after a warm-up, one persistent worker handing
    its batches over as training does (`RingLoader` over the stream's `SharedCollate`
    rings, `cat.loading.transport`; torch's own hand-over when the stream has none)."""
    shared = stream.collate_fn if isinstance(stream.collate_fn, SharedCollate) else None
    loader = RingLoader(torch.utils.data.DataLoader(
        stream, batch_size=None, num_workers=1, persistent_workers=True,
        worker_init_fn=lambda _: torch.set_num_threads(1)), shared)
    times = []
    for epoch in range(repeats + 1):
        stream.set_epoch(epoch + 1)
        start = time.perf_counter()
        count = sum(len(batch) for batch in loader)
        times.append(time.perf_counter() - start)
        assert count > 0
    return statistics.median(times[1:])


def _stream(patterns: str, tokenizer: Path, audio: AudioConfig | None, batch: int
            ) -> ShardStream:
    """The training's stream of one worker: batches padded into a ring of shared slots
    (as `cat.training.train_data.shared_collate` sizes them: the batch of the longest
    utterance; prefetch 2 + 3 held by the loop)."""
    config = StreamConfig.with_defaults(batch_size=batch, max_frames=0, shuffle_buffer=500,
                                        sort_buffer=100, audio=audio, seed=1)
    shards = load_shard_list(patterns)
    shared = SharedCollate(batch * shards.longest * 80 * 4, 5) if shards.longest else None
    return ShardStream(shards, str(tokenizer), config, None, 80, num_workers=1,
                       collate_fn=shared or collate)


def _wenet_style(shards: list[Path], fmt: str, batch: int, repeats: int, perturb: bool
                 ) -> float:
    """Median seconds of a WeNet-style pass over the `fmt` members of `shards` (see the
    docstring), with a speed factor per utterance when `perturb`."""
    rng = np.random.default_rng(0)

    def one_pass() -> None:
        features = []
        for shard in shards:
            with tarfile.open(shard) as tar:
                for member in tar:
                    if not member.name.endswith(f".{fmt}"):
                        continue
                    data = tar.extractfile(member).read()
                    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
                    waveform = torch.from_numpy(samples).unsqueeze(0)
                    speed = float(rng.choice(SPEEDS)) if perturb else 1.0
                    if speed != 1.0:
                        # as lhotse and WeNet's fallback do: the audio read as if sampled
                        # at rate * speed, resampled to rate
                        waveform = torchaudio.functional.resample(waveform,
                                                                  round(rate * speed), rate)
                    features.append(torchaudio.compliance.kaldi.fbank(
                        waveform * 32768, num_mel_bins=80, frame_length=25, frame_shift=10,
                        dither=0.0, energy_floor=0.0, sample_frequency=rate))
                    if len(features) == batch:
                        torch.nn.utils.rnn.pad_sequence(features, batch_first=True)
                        features = []
        if features:
            torch.nn.utils.rnn.pad_sequence(features, batch_first=True)

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=600, help="utterances in the corpus")
    parser.add_argument("--distinct", type=int, default=60,
                        help="distinct synthesized utterances (repeated up to --utterances)")
    parser.add_argument("--utts-per-file", type=int, default=100, help="utterances per shard")
    parser.add_argument("--batch", type=int, default=32, help="utterances per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loader")
    parser.add_argument("--workdir", help="keep the data here (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-audio-loader-"))
    try:
        speech = make_speech(args.distinct, seed=0)
        whole, _, seconds = write_corpus(workdir / "corpus", speech, args.utterances, 60.0)
        tokenizer = workdir / "tokenizer.tknz"
        tk.save(tk.train_sentencepiece([whole / "text"], "char", 0), tokenizer)
        shards = workdir / "shards"
        for audio_format in ("opus", "flac"):
            pack_audio(whole, shards / audio_format, audio_format,
                       utts_per_file=args.utts_per_file, num_jobs=2)
        extract(whole, workdir / "fbank", nj=2, progress=False)
        pack_data(workdir / "fbank/feats.scp", workdir / "fbank/text", shards / "features",
                  utts_per_file=args.utts_per_file, num_jobs=2)
        sizes = {kind: sum(p.stat().st_size for p in (shards / kind).glob("*.tar"))
                 for kind in ("opus", "flac", "features")}
        print(f"corpus: {args.utterances} utterances, {seconds / 60:.1f} min of audio "
              f"({seconds / args.utterances:.2f} s each), {args.utts_per_file} per shard, "
              f"batches of {args.batch}; shard MB: "
              + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sizes.items()))
        sp = AudioConfig(speed_perturb=SPEEDS)
        rows: list[tuple[str, float]] = []
        for name, pattern, audio in (
                ("stream opus sp", f"{shards}/opus/data-*.tar", sp),
                ("stream opus no sp", f"{shards}/opus/data-*.tar", AudioConfig()),
                ("stream flac sp", f"{shards}/flac/data-*.tar", sp),
                ("stream features", f"{shards}/features/data-*.tar", None)):
            rows.append((name, _epochs(_stream(pattern, tokenizer, audio, args.batch),
                                       args.repeats)))
        rows.append(("wenet-style opus sp (plain loop)",
                     _wenet_style(sorted((shards / "opus").glob("data-*.tar")), "opus",
                                  args.batch, args.repeats, perturb=True)))
        names = " ".join(p.name for p in sorted((shards / "opus").glob("data-*.tar")))
        with serve_directory_process(shards / "opus") as (_, url):
            pattern = f"{url}/{{{','.join(n[:-4] for n in names.split())}}}.tar"
            rows.append(("stream opus sp over HTTP",
                         _epochs(_stream(pattern, tokenizer, sp, args.batch), args.repeats)))
        with seaweedfs_s3(workdir / "s3") as server:
            server.create_bucket("speech")
            server.upload_folder(shards / "opus", "speech", "opus")
            os.environ.update(server.environment())
            rows.append(("stream opus sp from S3",
                         _epochs(_stream("s3://speech/opus/data-*.tar", tokenizer, sp,
                                         args.batch), args.repeats)))
        _print(rows, args.utterances, seconds)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _print(rows: list[tuple[str, float]], utterances: int, seconds: float) -> None:
    times = dict(rows)
    print(f"{'loader (1 worker / 1 core)':<34} {'s/epoch':>8} {'utt/s':>7} {'x RT':>6} "
          f"{'cores for 1k utt/s':>18} {'vs features':>11} {'vs wenet':>8}")
    for name, took in rows:
        rate = utterances / took
        print(f"{name:<34} {took:>8.2f} {rate:>7.0f} {seconds / took:>6.0f} "
              f"{1000 / rate:>18.1f} {times['stream features'] / took:>11.2f} "
              f"{times['wenet-style opus sp (plain loop)'] / took:>8.2f}")


if __name__ == "__main__":
    main()
