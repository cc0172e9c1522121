"""Benchmark: how long importing the streaming loader takes, against a baseline revision.

Each run starts a fresh interpreter (`python -X importtime -c "import <module>"`) and
reads the total, the share of the store clients (`boto3`, `botocore`, `fsspec`,
`s3fs`), that of torch, and the total without torch (what this project's own imports
decide) from its report. The baseline is the package `cat/` of another git revision,
extracted with `git archive` into a temporary folder and imported from there, the two
trees taking turns so that the machine's load affects both alike. The fastest of
`--repeats` runs of each is printed, with the ratio.

Usage:
    python bench/import_time.py                        # baseline: the commit before storage
    python bench/import_time.py --baseline HEAD --repeats 9
    python bench/import_time.py --module cat.loading.sources
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The last commit before the store clients were imported only when a URL needs them.
DEFAULT_BASELINE = "c1bfd3f"
STORE_CLIENTS = ("boto3", "botocore", "fsspec", "s3fs")
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_report(tree: Path, module: str) -> tuple[float, float, float]:
    """(total, store clients, torch) seconds of importing `module` from `tree`."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                         cwd=tree, env=environment, capture_output=True, text=True, check=True)
    total = clients = torch = 0
    for line in run.stderr.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        cumulative, indent, name = int(match[2]), len(match[3]), match[4]
        if indent == 1:  # a top-level import of `-c`
            total += cumulative
        if name in STORE_CLIENTS:
            clients += cumulative
        if name == "torch":
            torch += cumulative
    return total / 1e6, clients / 1e6, torch / 1e6


def extract(revision: str, destination: Path) -> Path:
    """The `cat/` package of `revision`, written under `destination`."""
    archive = subprocess.run(["git", "archive", revision, "cat"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    return destination


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"git revision to compare with (default {DEFAULT_BASELINE})")
    parser.add_argument("--module", default="cat.loading.stream",
                        help="module to import (default cat.loading.stream)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each (default 7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        trees = {f"baseline {args.baseline}": extract(args.baseline, Path(folder)),
                 "this tree": ROOT}
        import_report(ROOT, args.module)  # warm the page cache
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                results[name].append(import_report(tree, args.module))
    print(f"import {args.module}, {args.repeats} runs each (fastest; median):")
    best = {}
    for name, runs in results.items():
        rest = sorted(total - torch for total, _, torch in runs)
        totals, clients, torch = (sorted(column) for column in zip(*runs, strict=True))
        best[name] = totals[0]
        print(f"  {name:20s} total {totals[0]:5.2f} s; {statistics.median(totals):5.2f} s"
              f"   store clients ({', '.join(STORE_CLIENTS)}) {clients[0]:5.2f} s; "
              f"{statistics.median(clients):5.2f} s   torch {torch[0]:5.2f} s; "
              f"{statistics.median(torch):5.2f} s   all but torch {rest[0]:5.2f} s; "
              f"{statistics.median(rest):5.2f} s")
    base_total, total = best.values()
    print(f"  ratio of the fastest totals, this tree / baseline: {total / base_total:.2f}")


if __name__ == "__main__":
    main()
