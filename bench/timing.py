"""Timing shared by the benchmarks: the best wall time of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable


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
