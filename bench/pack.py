"""Benchmark: tar-shard packing throughput of `pack_data` against the system `tar`.

Writes a random feature corpus (Kaldi arks + feats.scp + text), then measures, in the
same run and on the same (page-cached) data:

* baseline: the same `.npy` + `.txt` members pre-written to a directory, archived by
  `tar -cf` in shard order (no reading of arks, no conversion), without and with a
  final `sync` of the archive;
* `pack_data` with each `--nj` (reads the arks, writes the shards atomically with fsync,
  hashes them, writes the index).

Throughput is MB/s of float32 feature bytes; each line also prints the ratio to tar.
The best of `--repeat` runs is kept.

Usage:
    python bench/pack.py --size-mb 200 --nj 1 2
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from timing import best_time

from cat.formats import prep_wds
from cat.testing.features import utterance_ids, write_feature_corpus

MEGABYTE = 1e6


def _write_baseline_members(corpus_dir: Path, shard_dir: Path, members_dir: Path) -> Path:
    """Write each shard's members as files; return a list file in shard order."""
    members_dir.mkdir(parents=True)
    names = []
    for shard in sorted(shard_dir.glob("data-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                (members_dir / member.name).write_bytes(tar.extractfile(member).read())
                names.append(member.name)
    listing = corpus_dir / "members.txt"
    listing.write_text("\n".join(names) + "\n", encoding="utf-8")
    return listing


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print one line per method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=200.0,
                        help="float32 feature bytes in the corpus (MB)")
    parser.add_argument("--frames", type=int, default=500, help="mean frames per utterance")
    parser.add_argument("--dim", type=int, default=80, help="feature dimension")
    parser.add_argument("--utts-per-file", type=int, default=125,
                        help="utterances per shard (several shards are needed to use --nj)")
    parser.add_argument("--nj", type=int, nargs="+", default=[1, 2],
                        help="process counts to measure")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; best kept")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pack-"))
    try:
        bytes_per_utt = args.frames * args.dim * 4
        num_utts = max(1, round(args.size_mb * MEGABYTE / bytes_per_utt))
        corpus = write_feature_corpus(
            workdir / "corpus", keys=utterance_ids(num_utts, num_speakers=100), dim=args.dim,
            frame_range=(args.frames // 2, args.frames * 3 // 2), num_arks=8)
        feature_bytes = sum(f.nbytes for f in corpus.features.values())
        del corpus.features  # free memory; the arks hold them
        print(f"corpus: {num_utts} utterances, {feature_bytes / MEGABYTE:.1f} MB of float32 "
              f"features, {args.utts_per_file} utterances per shard")

        out = workdir / "shards"

        def pack(num_jobs: int) -> Callable[[], None]:
            return lambda: prep_wds.pack_data(corpus.feats_scp, corpus.text, out,
                                              utts_per_file=args.utts_per_file,
                                              num_jobs=num_jobs)

        def clear_output() -> None:
            shutil.rmtree(out, ignore_errors=True)

        # Baseline members are the exact shard members, so both sides write the same bytes.
        pack(1)()
        listing = _write_baseline_members(workdir, out, workdir / "members")
        baseline_tar = workdir / "baseline.tar"
        tar_seconds = best_time(
            lambda: subprocess.run(["tar", "-cf", str(baseline_tar), "-C",
                                    str(workdir / "members"), "-T", str(listing)], check=True),
            args.repeat, prepare=lambda: baseline_tar.unlink(missing_ok=True), warm_up=False)
        tar_rate = feature_bytes / MEGABYTE / tar_seconds
        print(f"{'system tar':<22} {tar_seconds:7.2f} s {tar_rate:8.1f} MB/s  ratio 1.00")
        # pack_data fsyncs every shard before renaming it; this line prices that in.
        synced_seconds = best_time(
            lambda: subprocess.run(f"tar -cf '{baseline_tar}' -C '{workdir / 'members'}' "
                                   f"-T '{listing}' && sync '{baseline_tar}'", shell=True,
                                   check=True),
            args.repeat, prepare=lambda: baseline_tar.unlink(missing_ok=True), warm_up=False)
        synced_rate = feature_bytes / MEGABYTE / synced_seconds
        print(f"{'system tar + sync':<22} {synced_seconds:7.2f} s {synced_rate:8.1f} MB/s  "
              f"ratio {synced_rate / tar_rate:.2f}")
        rates = {}
        for num_jobs in args.nj:
            seconds = best_time(pack(num_jobs), args.repeat, prepare=clear_output, warm_up=False)
            rates[num_jobs] = feature_bytes / MEGABYTE / seconds
            print(f"{f'pack_data nj={num_jobs}':<22} {seconds:7.2f} s "
                  f"{rates[num_jobs]:8.1f} MB/s  ratio {rates[num_jobs] / tar_rate:.2f}")
        if len(rates) > 1:
            first = min(rates)
            for num_jobs in sorted(rates)[1:]:
                print(f"scaling nj={first} -> nj={num_jobs}: "
                      f"{rates[num_jobs] / rates[first]:.2f}x")
        shard_bytes = sum(p.stat().st_size for p in out.glob("data-*.tar"))
        print(f"shard bytes / feature bytes: {shard_bytes / feature_bytes:.3f}; "
              f"tar bytes / feature bytes: {baseline_tar.stat().st_size / feature_bytes:.3f}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
