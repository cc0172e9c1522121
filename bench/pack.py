"""Benchmark: tar-shard packing throughput of `pack_data` against the system `tar`, the
code of a git revision (before) and of this checkout (after) in one run.

Writes a random feature corpus (Kaldi arks + feats.scp + text), then measures, in the
same run and on the same (page-cached) data:

* baseline: the same `.npy` + `.txt` members pre-written to a directory, archived by
  `tar -cf` in shard order (no reading of arks, no conversion), without and with a
  final `sync` of the archive;
* `pack_data` with each `--nj` (reads the arks, writes the shards atomically with fsync,
  hashes them, writes the index), by the package of `--before` (a git revision, exported
  to a temporary folder) and by this checkout's, each in a fresh process; the shards of
  both are compared byte for byte;
* with `--start-workers`, also this checkout's `pack_data` with each `--nj` above 1
  starting its workers whatever `plan_workers` would decide (`CAT_PACK_START_WORKERS=1`):
  the multi-process path on a machine whose load would keep it from starting any.

Throughput is MB/s of float32 feature bytes; each line also prints the ratio to tar.
The best of `--repeat` runs is kept.

Usage:
    python bench/pack.py --size-mb 400 --nj 1 2 --before c1bfd3f
    python bench/pack.py --size-mb 400 --nj 1 2 --repeat 5 --start-workers
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from timing import REPO_ROOT, best_time, export_revision

from cat.formats import prep_wds
from cat.formats.shard_pack import START_WORKERS_VARIABLE
from cat.testing.features import utterance_ids, write_feature_corpus

MEGABYTE = 1e6

# Packs in a fresh process whose `cat` comes from argv[1]; prints the best seconds.
PACK_CHILD = """
import json, shutil, sys, time
sys.path.insert(0, sys.argv[1])
from cat.formats import prep_wds
scp, text, out, per_file, num_jobs, repeat = sys.argv[2:8]
best = float("inf")
for _ in range(int(repeat)):
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prep_wds.pack_data(scp, text, out, utts_per_file=int(per_file), num_jobs=int(num_jobs))
    best = min(best, time.perf_counter() - start)
print(json.dumps({"seconds": best, "module": prep_wds.__file__}))
"""


def pack_in_child(package_root: Path, corpus, out: Path, per_file: int, num_jobs: int,
                  repeat: int, start_workers: bool = False) -> float:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    env.pop(START_WORKERS_VARIABLE, None)
    if start_workers:
        env[START_WORKERS_VARIABLE] = "1"
    result = subprocess.run([sys.executable, "-c", PACK_CHILD, str(package_root),
                             str(corpus.feats_scp), str(corpus.text), str(out), str(per_file),
                             str(num_jobs), str(repeat)], check=True, capture_output=True,
                            text=True, env=env, cwd=out.parent)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(package_root)), report
    return report["seconds"]


def shard_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.glob("data-*.tar")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


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
    parser.add_argument("--before", default="c1bfd3f",
                        help="git revision whose pack_data is measured as 'before'")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--start-workers", action="store_true",
                        help=f"also measure this checkout with every --nj above 1 starting "
                             f"its workers ({START_WORKERS_VARIABLE}=1), labelled 'started'")
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
        before_root = export_revision(args.before, workdir / "before")

        # Baseline members are the exact shard members, so both sides write the same bytes.
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out,
                           utts_per_file=args.utts_per_file)
        listing = _write_baseline_members(workdir, out, workdir / "members")
        baseline_tar = workdir / "baseline.tar"

        def run_tar(sync: bool) -> float:
            baseline_tar.unlink(missing_ok=True)
            command = (f"tar -cf '{baseline_tar}' -C '{workdir / 'members'}' -T '{listing}'"
                       + (f" && sync '{baseline_tar}'" if sync else ""))
            return best_time(lambda: subprocess.run(command, shell=True, check=True), 1,
                             warm_up=False)

        # Repeats outermost, so that a change of the machine's load hits every variant
        # (tar included) alike. pack_data fsyncs every shard: "tar + sync" prices that in.
        variants = [(label, root, num_jobs) for num_jobs in args.nj
                    for label, root in (("before", before_root), ("after", REPO_ROOT))]
        if args.start_workers:
            variants += [("started", REPO_ROOT, num_jobs) for num_jobs in args.nj
                         if num_jobs > 1]
        best: dict[tuple[str, int], float] = {}
        digests = {}
        for _ in range(args.repeat):
            for sync in (False, True):
                seconds = run_tar(sync)
                best["tar", sync] = min(seconds, best.get(("tar", sync), seconds))
            for label, root, num_jobs in variants:
                target = workdir / f"shards-{label}"
                seconds = pack_in_child(root, corpus, target, args.utts_per_file, num_jobs, 1,
                                        start_workers=label == "started")
                best[label, num_jobs] = min(seconds, best.get((label, num_jobs), seconds))
                digests[label, num_jobs] = shard_digest(target)
                shutil.rmtree(target, ignore_errors=True)
        tar_rate = feature_bytes / MEGABYTE / best["tar", False]
        for sync, name in ((False, "system tar"), (True, "system tar + sync")):
            rate = feature_bytes / MEGABYTE / best["tar", sync]
            print(f"{name:<30} {best['tar', sync]:7.2f} s {rate:8.1f} MB/s  "
                  f"ratio {rate / tar_rate:.2f}")
        rates = {}
        for label, _, num_jobs in variants:
            seconds = best[label, num_jobs]
            rates[label, num_jobs] = feature_bytes / MEGABYTE / seconds
            print(f"{f'pack_data {label} nj={num_jobs}':<30} {seconds:7.2f} s "
                  f"{rates[label, num_jobs]:8.1f} MB/s  "
                  f"ratio {rates[label, num_jobs] / tar_rate:.2f}  "
                  f"shards {digests[label, num_jobs][:12]}", flush=True)
        first = min(args.nj)
        for label in ("before", "after", "started"):
            for num_jobs in sorted(args.nj)[1:]:
                if (label, num_jobs) in rates:
                    reference = rates["after" if label == "started" else label, first]
                    print(f"{label}: nj={first} -> nj={num_jobs}: "
                          f"{rates[label, num_jobs] / reference:.2f}x")
        for num_jobs in args.nj:
            speedup = rates["after", num_jobs] / rates["before", num_jobs]
            print(f"nj={num_jobs}: after / before {speedup:.2f}x")
        print("shards byte-identical before/after and across --nj: "
              f"{len(set(digests.values())) == 1} ({next(iter(digests.values()))[:16]})")
        shard_bytes = sum(p.stat().st_size for p in out.glob("data-*.tar"))
        print(f"shard bytes / feature bytes: {shard_bytes / feature_bytes:.3f}; "
              f"tar bytes / feature bytes: {baseline_tar.stat().st_size / feature_bytes:.3f}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
