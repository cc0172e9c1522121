"""Benchmark: audio shards to fbank batches per core, ours against lhotse Shar and WeNet-style.

The same utterances of synthetic Mandarin (as `bench/audio_bytes.py` makes them) in the
same encoded bytes (our packer's opus at 32 kbit/s and flac) are read to padded batches of
80-dim fbank by:

* `ours`         the training loader (`ShardStream` over `pack_audio` shards, one DataLoader
                 worker): decode, fbank as samples leave the shuffle buffer, tokenize,
                 shuffle, sort, pad;
* `ours before`  the same with the code of another checkout (`--before DIR`, e.g. a clone
                 of the previous commit), run in a child process on the same shards;
* `lhotse Shar`  lhotse (the version `requirements-dev.txt` pins) as icefall reads Shar:
                 `CutSet.from_shar` -> `DynamicCutSampler(max_cuts=batch)` ->
                 `K2SpeechRecognitionDataset(input_strategy=OnTheFlyFeatures(Fbank()))`
                 through `IterableDatasetWrapper` in one DataLoader worker; its audio
                 backend is libsndfile (`LHOTSE_AUDIO_BACKEND=LibsndfileBackend`: torchaudio
                 has no FFmpeg here). The Shar is written by lhotse's `SharWriter`, then
                 each audio member is replaced by our packer's bytes of that utterance, so
                 every loader decodes the same streams;
* `WeNet-style`  a plain loop in one process, as WeNet's UIO processors do it: `tarfile`
                 members, soundfile decode, `torchaudio.compliance.kaldi.fbank` per
                 utterance (80 bins, dither 0), padding into batches of the same size.

With `--speed-perturb`, every loader also changes each utterance's speed by a factor drawn
from 0.9/1.0/1.1 (ours: `train.option.audio.speed_perturb`; lhotse: `cut.perturb_speed`;
WeNet-style: `torchaudio.functional.resample` from rate x factor to rate).

One worker (or the one process) and one torch thread each, so one loader is one core; an
untimed epoch, then the median of `--repeats` epochs. x real time = seconds of audio per
second of that core.

Usage:
    python bench/audio_peers.py --utterances 400 --repeats 3 --before /tmp/cat-before
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("LHOTSE_AUDIO_BACKEND", "LibsndfileBackend")

import numpy as np
import torch

# Sibling benchmarks: synthesis, corpus layout, the loader's set-up (bench/ is on sys.path).
from audio_bytes import make_speech
from audio_loader import _epochs, _stream, _wenet_style
from pack_audio import write_corpus

from cat.formats.audio_pack import pack_audio
from cat.formats.shard_format import decode_key, split_member_name
from cat.loading.samples import AudioConfig
from cat.text import tokenizer as tk

FORMATS = ("opus", "flac")
SPEEDS = (0.9, 1.0, 1.1)


def _ours(shards: Path, tokenizer: Path, batch: int, repeats: int, perturb: bool
          ) -> dict[str, float]:
    audio = AudioConfig(speed_perturb=SPEEDS) if perturb else AudioConfig()
    return {fmt: _epochs(_stream(f"{shards}/{fmt}/data-*.tar", tokenizer, audio, batch),
                         repeats) for fmt in FORMATS}


def _ours_before(checkout: str, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    """`_ours` with another checkout's `cat` package, in a child process."""
    command = [sys.executable, __file__, "--ours-only", "--workdir", str(workdir),
               "--batch", str(args.batch), "--repeats", str(args.repeats)]
    if args.speed_perturb:
        command.append("--speed-perturb")
    env = {**os.environ, "PYTHONPATH": checkout}
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _member_bytes(folder: Path) -> dict[str, bytes]:
    """Utterance id -> audio member bytes of our shards in `folder`."""
    members = {}
    for shard in sorted(folder.glob("data-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                stem, extension = split_member_name(member.name)
                if extension in FORMATS:
                    members[decode_key(stem)] = tar.extractfile(member).read()
    return members


def _write_shar(whole: Path, ours: Path, out: Path, fmt: str, shard_size: int) -> None:
    """lhotse Shar of the corpus whose audio members are our packer's bytes."""
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
    from lhotse.shar import SharWriter

    texts = dict(line.split(" ", 1) for line in
                 (whole / "text").read_text(encoding="utf-8").splitlines())
    recordings, supervisions = [], []
    for line in (whole / "wav.scp").read_text(encoding="utf-8").splitlines():
        utt, path = line.split(" ", 1)
        recording = Recording.from_file(path, recording_id=utt)
        recordings.append(recording)
        supervisions.append(SupervisionSegment(utt, utt, 0.0, recording.duration,
                                               text=texts[utt].strip()))
    cuts = CutSet.from_manifests(recordings=RecordingSet.from_recordings(recordings),
                                 supervisions=SupervisionSet.from_segments(supervisions))
    out.mkdir(parents=True)
    with SharWriter(out, fields={"recording": fmt}, shard_size=shard_size) as writer:
        for cut in cuts:
            writer.write(cut)
    ours_bytes = _member_bytes(ours)
    ids = {cut.id: cut.recording.id for cut in cuts}
    for shard in sorted(out.glob("recording.*.tar")):
        rewritten = shard.with_suffix(".tmp")
        with tarfile.open(shard) as source, tarfile.open(rewritten, "w") as target:
            for member in source:
                data = source.extractfile(member).read()
                stem, extension = member.name.rsplit(".", 1)
                if extension == fmt:
                    data = ours_bytes[ids[stem]]
                    member.size = len(data)
                target.addfile(member, io.BytesIO(data))
        rewritten.replace(shard)


def _lhotse(shar: Path, batch: int, repeats: int, perturb: bool) -> float:
    from lhotse import CutSet, Fbank, FbankConfig
    from lhotse.dataset import DynamicCutSampler, K2SpeechRecognitionDataset, OnTheFlyFeatures
    from lhotse.dataset.iterable_dataset import IterableDatasetWrapper

    cuts = CutSet.from_shar(in_dir=shar)
    if perturb:
        rng = np.random.default_rng(0)
        factors = {}

        def perturbed(cut):
            factor = factors.setdefault(cut.id, float(rng.choice(SPEEDS)))
            return cut if factor == 1.0 else cut.perturb_speed(factor)
        cuts = cuts.map(perturbed)
    sampler = DynamicCutSampler(cuts, max_cuts=batch, shuffle=False)
    dataset = K2SpeechRecognitionDataset(
        input_strategy=OnTheFlyFeatures(Fbank(FbankConfig(num_mel_bins=80))))
    loader = torch.utils.data.DataLoader(
        IterableDatasetWrapper(dataset, sampler), batch_size=None, num_workers=1,
        persistent_workers=True, worker_init_fn=lambda _: torch.set_num_threads(1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        count = sum(len(b["supervisions"]["text"]) for b in loader)
        times.append(time.perf_counter() - start)
        assert count > 0
    return statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=400, help="utterances in the corpus")
    parser.add_argument("--distinct", type=int, default=60,
                        help="distinct synthesized utterances (repeated up to --utterances)")
    parser.add_argument("--utts-per-file", type=int, default=100, help="utterances per shard")
    parser.add_argument("--batch", type=int, default=32, help="utterances per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loader")
    parser.add_argument("--speed-perturb", action="store_true",
                        help="speed factor 0.9/1.0/1.1 per utterance in every loader")
    parser.add_argument("--before", help="a checkout whose `cat` is measured as 'ours before'")
    parser.add_argument("--workdir", help="keep the data here, or reuse what an earlier run "
                        "kept there (default: a temporary folder)")
    parser.add_argument("--ours-only", action="store_true",
                        help="(internal) time ours on --workdir's data, print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-audio-peers-"))
    shards, tokenizer = workdir / "shards", workdir / "tokenizer.tknz"
    if args.ours_only:
        print(json.dumps(_ours(shards, tokenizer, args.batch, args.repeats,
                               args.speed_perturb)))
        return
    try:
        made = workdir / "corpus.json"
        if made.exists():  # a kept --workdir: the same data again
            seconds = json.loads(made.read_text())["seconds"]
        else:
            speech = make_speech(args.distinct, seed=0)
            whole, _, seconds = write_corpus(workdir / "corpus", speech, args.utterances, 60.0)
            tk.save(tk.train_sentencepiece([whole / "text"], "char", 0), tokenizer)
            for fmt in FORMATS:
                pack_audio(whole, shards / fmt, fmt, utts_per_file=args.utts_per_file,
                           num_jobs=2)
                _write_shar(whole, shards / fmt, workdir / "shar" / fmt, fmt,
                            args.utts_per_file)
            made.write_text(json.dumps({"seconds": seconds}))
        print(f"corpus: {args.utterances} utterances, {seconds / 60:.1f} min of audio "
              f"({seconds / args.utterances:.2f} s each), batches of {args.batch}, speed "
              f"perturbation {'0.9/1.0/1.1' if args.speed_perturb else 'off'}; "
              f"cat from {Path(sys.modules['cat'].__file__).parent.parent}")
        rows: dict[str, dict[str, float]] = {}
        rows["ours"] = _ours(shards, tokenizer, args.batch, args.repeats, args.speed_perturb)
        if args.before:
            rows["ours before"] = _ours_before(args.before, workdir, args)
        rows["lhotse Shar, on-the-fly fbank"] = {
            fmt: _lhotse(workdir / "shar" / fmt, args.batch, args.repeats,
                         args.speed_perturb) for fmt in FORMATS}
        rows["WeNet-style loop"] = {
            fmt: _wenet_style(sorted((shards / fmt).glob("data-*.tar")), fmt, args.batch,
                              args.repeats, args.speed_perturb) for fmt in FORMATS}
        _print(rows, seconds)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _print(rows: dict[str, dict[str, float]], seconds: float) -> None:
    peers = [name for name in rows if not name.startswith("ours")]
    print(f"{'loader (1 worker = 1 core)':<32}"
          + "".join(f" {fmt + ' s':>8} {fmt + ' xRT':>9} {fmt + ' / best peer':>15}"
                    for fmt in FORMATS))
    for name, times in rows.items():
        line = f"{name:<32}"
        for fmt in FORMATS:
            best_peer = min(rows[p][fmt] for p in peers)
            line += f" {times[fmt]:>8.2f} {seconds / times[fmt]:>9.0f} " \
                    f"{best_peer / times[fmt]:>15.2f}"
        print(line)


if __name__ == "__main__":
    main()
