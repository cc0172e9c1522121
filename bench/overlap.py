"""Benchmark: how long the training step waits for data, and what one loader worker delivers.

The streaming training data (`StreamTrainData`, as the training loop builds it) over
feature shards and Opus audio shards of the same length mix, iterated as training does
with a simulated step: each batch is taken, then the step "computes" for
`--step-us-per-frame` x the batch's input frames (a sleep, so that the step leaves the
cores to the loader as a GPU step does; the default 2.72 us is the fp16 update of
`exp/ctc-v1` on one H200, bench/README.md). Batches are `exp/ctc-v1`'s (128 utterances,
60,000 padded frames at most).

Parts:

1. `per worker`: utterances per second of ONE worker over the Opus shards, no step
   (epoch 2, its worker already started), with the fbank in the worker and on the
   device (`train.option.audio.features`): the batches as the worker hands them over,
   the device's fbank left out (a GPU's work; on the CPU it would take the core the
   worker does not).
2. `wait`: the share of the wall time the steps wait for their next batch, measured over
   `--epochs` epochs after a first one that starts the persistent workers, without the
   first batch of each epoch (the buffers filling: reported apart, `1st batch s`).
   Variants: `before`, the training process taking each batch when the step asks for it,
   then pinning (on CUDA), copying and featurizing it in the step's thread (the loader
   before `cat.loading.prefetch`: `Prefetcher(depth=0)`); `after`, the prefetcher as
   training runs it. Opus with the fbank in the workers (before and after) and on the
   device (after: it is new). A data-bound row says how many workers would keep up.
   `alone utt/s`: an epoch without steps (the loader's own rate); `steps utt/s`: what the
   steps alone allow.

Usage:
    python bench/overlap.py                              # about 4 minutes on 2 cores
    python bench/overlap.py --feature-utts 8000 --opus-utts 1200 --workers 2 --epochs 2
    python bench/overlap.py --quick                      # a smoke run (tests)
    python bench/overlap.py --device cuda --workers 4    # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audio_bytes import make_speech

from cat.core.config import TrainOptions, train_option_defaults
from cat.formats.audio_pack import pack_audio
from cat.loading.batch import LengthFilter
from cat.loading.prefetch import Prefetcher
from cat.loading.shardlist import load_shard_list
from cat.testing.audio import synth_waveform, write_audio, write_kaldi_data_dir
from cat.testing.features import write_feature_corpus
from cat.testing.shards import write_shards
from cat.text import tokenizer as tk
from cat.training.distributed import DistributedContext
from cat.training.train_data import StreamTrainData

FEAT_DIM = 80
RATE = 16000
#: The fp16 update of exp/ctc-v1 on one H200: 0.158 s per 58,007 input frames.
STEP_US_PER_FRAME = 2.72
#: exp/ctc-v1's batches.
BATCH_SIZE, MAX_FRAMES = 128, 60000
#: Buffers small against a worker's share of an epoch, so that the epochs measure the
#: steady state (the first batch of each, which waits for them to fill, is left out).
SHUFFLE_BUFFER, SORT_BUFFER = 64, 2 * BATCH_SIZE


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Shards of one length mix: features and Opus audio, and their tokenizer."""

    features: list[str]
    opus: list[str]
    tokenizer: str


def write_corpus(root: Path, feature_utts: int, opus_utts: int, utts_per_shard: int
                 ) -> Corpus:
    """Synthetic Mandarin (espeak-ng, 1.5-8 s with silences and noise; where espeak-ng is
    missing, sines and noise of 2-6 s) as Opus shards, and random features of the same
    lengths as feature shards."""
    if shutil.which("espeak-ng"):
        speech = make_speech(min(opus_utts, 60), seed=0)
    else:
        speech = [np.round(synth_waveform(2.0 + (i % 9) / 2, seed=i) * 32767).astype(np.int16)
                  for i in range(min(opus_utts, 60))]
    wav_scp, text = {}, {}
    for index in range(opus_utts):
        key = f"S{index % 7:04d}U{index:06d}"
        path = write_audio(root / "wav" / f"{key}.wav", speech[index % len(speech)], RATE)
        wav_scp[key], text[key] = str(path), "今天天气很好我们一起去"[:3 + index % 8]
    data = write_kaldi_data_dir(root / "data", wav_scp, text, {k: k[:5] for k in wav_scp})
    pack_audio(data, root / "opus", "opus", utts_per_file=utts_per_shard,
               num_jobs=max(1, min(4, os.cpu_count() or 1)))
    frames = [(len(speech[i % len(speech)]) - 240) // 160 for i in range(feature_utts)]
    corpus = write_feature_corpus(root / "fbank", num_utts=feature_utts, num_frames=frames,
                                  dim=FEAT_DIM)
    tokenizer = root / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([corpus.text, data / "text"], "char", 0), tokenizer)
    feature_shards = write_shards(corpus, root / "features", utts_per_shard)
    return Corpus([str(p) for p in feature_shards],
                  [str(p) for p in sorted((root / "opus").rglob("*.tar"))], str(tokenizer))


def train_data(corpus: Corpus, kind: str, workers: int, device: torch.device,
               log_dir: Path, batch: tuple[int, int] = (BATCH_SIZE, MAX_FRAMES)
               ) -> StreamTrainData:
    """The training loop's streaming data over `kind` shards (`features`, `opus-workers`,
    `opus-device`: where the fbank of audio is computed), speed perturbation 0.9/1.0/1.1,
    batches of `batch` (utterances, padded frames)."""
    audio = None
    if kind != "features":
        audio = {"speed_perturb": [0.9, 1.0, 1.1], "features": kind.split("-")[1]}
    options = TrainOptions(**{
        **train_option_defaults(), "large_dataset": True, "trset": getattr(
            corpus, "features" if kind == "features" else "opus"),
        "devset": [], "tokenizer": corpus.tokenizer, "workers": workers, "prefetch": 4,
        "batch_size": batch[0], "max_frames": batch[1], "shuffle_buffer": SHUFFLE_BUFFER,
        "sort_buffer": max(SORT_BUFFER, 2 * batch[0]), "audio": audio})
    shards = load_shard_list(options.trset)
    frames = np.arange(2 * max(shards.longest, 1000) + 1)
    length_filter = LengthFilter(None, np.maximum(((frames - 1) // 2 - 1) // 2, 0), 4,
                                 ctc=False)
    return StreamTrainData(options, length_filter, FEAT_DIM, DistributedContext(device=device),
                           log_dir, shards)


def use_variant(data: StreamTrainData, variant: str, device: torch.device) -> None:
    """`before`: each batch taken, pinned, moved and featurized in the step's thread when
    the step asks for it; `after`: the prefetcher training runs."""
    ring = data.loader.loader
    if variant == "before":
        ring.pin_memory = device.type == "cuda"
        data.loader = Prefetcher(ring, device, depth=0, workers=data.options.workers,
                                 report=False)


def run_epoch(data: StreamTrainData, epoch: int, seconds_per_frame: float,
              device: torch.device) -> dict[str, float]:
    """One epoch as training takes it: waits (without the first batch), wall time, rates."""
    data.start_epoch(epoch, None)
    waits, utterances, frames, padded = [], 0, 0, 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    iterator = iter(data)
    while True:
        begin = time.perf_counter()
        batch = next(iterator, None)
        waits.append(time.perf_counter() - begin)
        if batch is None:
            break
        data.note(batch, trained=True)
        if not len(batch):
            continue
        step_start = time.perf_counter()
        batch = batch.to(device, non_blocking=True).featurize()
        sync()
        time.sleep(max(0.0, seconds_per_frame * batch.num_frames
                       - (time.perf_counter() - step_start)))
        utterances += len(batch)
        frames += batch.num_frames
        padded += batch.feats.shape[0] * batch.feats.shape[1]
    del iterator
    data.end_epoch()
    wall = time.perf_counter() - start
    steady = wall - waits[0]
    return {"utterances": utterances, "frames": frames, "padded_frames": padded,
            "wall_seconds": wall, "first_batch_seconds": waits[0],
            "steady_seconds": steady, "steady_wait_seconds": sum(waits[1:]),
            "wait_share": sum(waits[1:]) / steady if steady > 0 else 0.0}


def measure(corpus: Corpus, kind: str, variant: str, workers: int, epochs: int,
            seconds_per_frame: float, device: torch.device, log_dir: Path,
            batch: tuple[int, int] = (BATCH_SIZE, MAX_FRAMES)) -> dict[str, Any]:
    """Part 2's row: an epoch alone (the loader's rate), then `epochs` with steps."""
    data = train_data(corpus, kind, workers, device, log_dir, batch)
    use_variant(data, variant, device)
    try:
        run_epoch(data, 1, 0.0, device)  # starts the persistent workers
        alone = run_epoch(data, 2, 0.0, device)
        runs = [run_epoch(data, 3 + e, seconds_per_frame, device) for e in range(epochs)]
    finally:
        data.close()
    steady = sum(r["steady_seconds"] for r in runs)
    waited = sum(r["steady_wait_seconds"] for r in runs)
    utterances = sum(r["utterances"] for r in runs)
    return {"shards": kind, "variant": variant, "workers": workers,
            "alone_utts_per_second": alone["utterances"] / alone["wall_seconds"],
            "steps_utts_per_second": utterances / max(
                seconds_per_frame * sum(r["frames"] for r in runs), 1e-9),
            "utts_per_second": utterances / sum(r["wall_seconds"] for r in runs),
            "wait_share": waited / steady if steady > 0 else 0.0,
            "first_batch_seconds": max(r["first_batch_seconds"] for r in runs),
            "padding_share": 1 - sum(r["frames"] for r in runs) / max(
                sum(r["padded_frames"] for r in runs), 1)}


#: Part 2's rows: (shards, variant).
ROWS = (("features", "before"), ("features", "after"), ("opus-workers", "before"),
        ("opus-workers", "after"), ("opus-device", "after"))


def workers_needed(row: dict[str, Any]) -> str:
    """Workers that would deliver what the steps take (as `LoaderRates` says it), or `-`
    when the loader keeps up."""
    if row["wait_share"] <= 0.02:
        return "-"
    return str(math.ceil(row["workers"] * row["steps_utts_per_second"]
                         / row["utts_per_second"] - 1e-6))


def per_worker(corpus: Corpus, device: torch.device, log_dir: Path,
               batch: tuple[int, int] = (BATCH_SIZE, MAX_FRAMES)) -> list[dict[str, Any]]:
    """Part 1: one worker's utterances per second over the Opus shards, no step: its
    batches as the DataLoader hands them over, the fbank of `device` batches left to the
    device (here not computed: on the CPU it would take the worker's core-mate)."""
    rows = []
    for kind in ("opus-workers", "opus-device"):
        data = train_data(corpus, kind, 1, device, log_dir, batch)
        try:
            for epoch in (1, 2):  # the first starts the persistent worker
                data.start_epoch(epoch, None)
                utterances = frames = 0
                start = time.perf_counter()
                for taken in data.loader.loader:
                    utterances += len(taken)
                    frames += taken.num_frames
                seconds = time.perf_counter() - start
                data.end_epoch()
        finally:
            data.close()
        rows.append({"features": kind.split("-")[1], "utts_per_second": utterances / seconds,
                     "audio_seconds_per_second": frames / 100 / seconds})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feature-utts", type=int, default=8000)
    parser.add_argument("--opus-utts", type=int, default=2400)
    parser.add_argument("--utts-per-shard", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per row")
    parser.add_argument("--step-us-per-frame", type=float, default=STEP_US_PER_FRAME)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.feature_utts, args.opus_utts, args.utts_per_shard, args.epochs = 60, 12, 6, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    seconds_per_frame = args.step_us_per_frame * 1e-6
    print(f"device {device}; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.2f}; step {args.step_us_per_frame:g} us per input frame; "
          f"batches of {BATCH_SIZE} utterances / {MAX_FRAMES:,} padded frames")
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as workdir:
        root = Path(workdir)
        corpus = write_corpus(root / "corpus", args.feature_utts, args.opus_utts,
                              args.utts_per_shard)
        print("\n== 1. one worker over Opus shards, no step ==")
        print(f"{'fbank on':<9} {'utt/s':>7} {'x real time':>12}")
        workers_rows = per_worker(corpus, device, root / "log")
        for row in workers_rows:
            print(f"{row['features']:<9} {row['utts_per_second']:>7.1f} "
                  f"{row['audio_seconds_per_second']:>12.1f}")
        print(f"\n== 2. data wait at the step ({args.workers} workers) ==")
        print(f"{'shards':<13} {'variant':<7} {'alone utt/s':>11} {'steps utt/s':>11} "
              f"{'utt/s':>7} {'wait share':>10} {'1st batch s':>11} {'padding':>8} "
              f"{'workers':>7}")
        rows = []
        for kind, variant in ROWS:
            row = measure(corpus, kind, variant, args.workers, args.epochs,
                          seconds_per_frame, device, root / "log")
            rows.append(row)
            print(f"{kind:<13} {variant:<7} {row['alone_utts_per_second']:>11.1f} "
                  f"{row['steps_utts_per_second']:>11.1f} {row['utts_per_second']:>7.1f} "
                  f"{row['wait_share']:>10.3f} {row['first_batch_seconds']:>11.3f} "
                  f"{row['padding_share']:>8.3f} {workers_needed(row):>7}", flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"per_worker": workers_rows, "wait": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
