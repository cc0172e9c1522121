"""Progress bars advanced by pool workers (decoding, transcription)."""

import logging

from cat.core import progress
from cat.core.process import process_pool
from cat.core.progress import WorkerProgress
from cat.testing.processes import advance_progress


def test_in_process_work_advances_the_open_bar_and_nothing_after_it_closes():
    with WorkerProgress(10, "decoding dev") as bar:
        advance_progress(3)
        progress.advance(2)
    assert bar.count == 5
    progress.advance(4)  # no bar open: a no-op, not an error
    assert bar.count == 5


def test_workers_of_a_pool_advance_the_parents_bar(caplog):
    caplog.set_level(logging.INFO, logger="cat.core.progress")
    bar = WorkerProgress(60, "decoding test", log_seconds=0.2)
    with bar, process_pool(2, *bar.pool_initializer()) as pool:
        futures = [pool.submit(advance_progress, 30, 0.02) for _ in range(2)]
        assert sum(future.result() for future in futures) == 60
    assert bar.count == 60
    # Without a terminal the bar is off, so the log says how far it got while it ran.
    lines = [r.getMessage() for r in caplog.records if r.name == "cat.core.progress"]
    assert lines and all(line.startswith("decoding test: ") for line in lines)
    assert any("/60 utt in " in line for line in lines)
