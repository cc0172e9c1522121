"""Benchmark: reading gzip-compressed WeNet shards (`.tar.gz`) against the same shards plain.

Writes WeNet-style shards of synthetic 16-bit WAV utterances (`cat.testing.uio`) twice,
plain and gzip-compressed (level 6, as `tarfile` and `tar czf` write them), then times
reading every member of every shard with the loader's reader (`cat.loading.sources.
read_shard`: tar parsing, and for `.tar.gz` the decompression of `cat.loading.gunzip`),
from the page cache, and the CRC-32 the loader adds. Prints MB/s of tar data and the
ratio, and the bytes on disk.

Usage:
    python bench/gzip_shards.py                 # 8 shards of 100 utterances (about 1 min)
    python bench/gzip_shards.py --shards 2 --repeats 1
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from timing import best_time

from cat.loading.sources import read_shard
from cat.testing.uio import make_uio_corpus


def read_all(shards: list[Path]) -> int:
    """Bytes of all members of `shards`, read as the loader reads them."""
    return sum(len(data) for shard in shards for _, data in read_shard(str(shard)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8, help="shards (default 8)")
    parser.add_argument("--utts-per-shard", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = {f"BAC009S{i:04d}": "今天天气很好" for i in range(args.shards * args.utts_per_shard)}
    with tempfile.TemporaryDirectory() as folder:
        corpora = {kind: make_uio_corpus(Path(folder) / kind, texts, args.utts_per_shard,
                                         gzip=kind == "gzip")
                   for kind in ("plain", "gzip")}
        size = read_all(corpora["plain"].shards)
        print(f"{args.shards} shards of {args.utts_per_shard} WAV utterances, "
              f"{size / 1e6:.1f} MB of members; fastest of {args.repeats}:")
        seconds = {}
        for kind, corpus in corpora.items():
            on_disk = sum(p.stat().st_size for p in corpus.shards)
            seconds[kind] = best_time(lambda c=corpus: read_all(c.shards), args.repeats)
            print(f"  {kind:6s} {on_disk / 1e6:7.1f} MB on disk, read at "
                  f"{size / 1e6 / seconds[kind]:7.0f} MB/s of members")
        print(f"  gzip / plain time: {seconds['gzip'] / seconds['plain']:.1f}")


if __name__ == "__main__":
    main()
