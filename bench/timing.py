"""What the benchmarks share: the best wall time of repeated calls, and the package of an
earlier git revision to measure as "before"."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def best_time(run: Callable[[], object], repeats: int, *,
              prepare: Callable[[], object] | None = None, warm_up: bool = True) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, each after `prepare` (untimed);
    with `warm_up`, one untimed call first (caches, lazy imports, thread pools)."""
    if warm_up:
        if prepare is not None:
            prepare()
        run()
    best = float("inf")
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def export_revision(revision: str, directory: Path) -> Path:
    """The `cat` package of git `revision`, exported under `directory` (for PYTHONPATH)."""
    directory.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "cat"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory
