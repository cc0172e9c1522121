"""Session-wide test settings, and how the suite runs in parallel.

`tests/run.sh` runs pytest with pytest-xdist (`-n N --dist loadgroup`). This file makes
that scheduling hand out whole units: a test file (its module fixtures, such as a trained
tiny model, are built once), or a group of tests that share one machine-wide resource
(`GROUPS`: the one-node Slurm cluster, the serving tests' trained model), which run on one
worker, one after another. The longest units start first (`tests/durations.json`), so
that the last to finish is a short one. `-n 0` (or `-p no:xdist`) runs everything
serially in one process, in the files' order.

The groups are node-id prefixes that the scheduler itself reads: xdist's own
`xdist_group` marks reach the scheduler through node ids that pytest 9 no longer lets a
plugin change. Collection fails when a test that uses a shared fixture is left out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Units of tests sharing a machine-wide resource: node-id prefixes.
GROUPS = {
    # one Slurm cluster at a time (the session's, `slurm_cluster`, and the one
    # tests/testing/test_slurm.py starts itself); its jobs share the node's CPUs
    "slurm": ("tests/recipes/test_slurm_recipe.py", "tests/training/test_slurm_training.py",
              "tests/testing/test_slurm.py",
              "tests/faults/test_interrupts.py::"
              "test_run_sh_interrupted_ends_stage_3_its_training_and_its_slurm_job[slurm-"),
    # the tone model (tests/serving/conftest.py), trained once per worker
    "serving": ("tests/serving/test_browser.py", "tests/serving/test_engines.py",
                "tests/serving/test_server.py"),
}
# A test that uses one of these fixtures must be in its group.
GROUP_OF_FIXTURE = {"slurm_cluster": "slurm", "tone": "serving"}
# Seconds each unit took in a full run, to start the longest first; rewritten by
# `bash tests/run.sh --unit-durations=tests/durations.json`.
DURATIONS = Path(__file__).with_name("durations.json")
# A unit missing from DURATIONS (a new file): this much per test, more when marked slow.
GUESS_SECONDS, GUESS_SLOW_SECONDS = 0.5, 10.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors run fastest on one thread, and tests share the machine's cores; set
    for every test, since code under test may change it (training sets `threads`)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster shared by the whole session, started on first use and
    stopped at its end (see `cat.testing.slurm`); skips when Slurm cannot run here.
    `SLURM_CONF` points every Slurm client at it meanwhile, so code under test that calls
    `sbatch` finds it."""
    from cat.testing.slurm import slurm_cluster as start_cluster
    from cat.testing.slurm import slurm_unavailable

    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with (start_cluster(tmp_path_factory.mktemp("slurm")) as cluster,
          pytest.MonkeyPatch.context() as patch):
        patch.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--unit-durations", metavar="PATH", default=None,
                     help="write the seconds each scheduling unit (a test file, or an "
                          "xdist group) took to PATH, as JSON (for tests/durations.json)")


def scheduling_unit(nodeid: str) -> str:
    """What one worker runs as a whole: the test's group, else its file."""
    for group, prefixes in GROUPS.items():
        if nodeid.startswith(prefixes):
            return group
    return nodeid.split("::", 1)[0]


class _UnitDurations:
    """Adds up the setup, call and teardown seconds of every test by unit."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        unit = scheduling_unit(report.nodeid)
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((unit, round(seconds, 1)) for unit, seconds
                               in self.seconds.items()), key=lambda pair: -pair[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--unit-durations")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller sees every report
        config.pluginmanager.register(_UnitDurations(path), "unit-durations")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check that the users of a shared fixture are in its group, and, on an xdist
    worker, order the tests longest unit first (every worker collects, and orders, the
    same way; the scheduler hands out units in this order)."""
    for item in items:
        for fixture, group in GROUP_OF_FIXTURE.items():
            if (fixture in getattr(item, "fixturenames", ())
                    and scheduling_unit(item.nodeid) != group):
                raise pytest.UsageError(f"{item.nodeid} uses the fixture {fixture}: add it "
                                        f"to GROUPS[{group!r}] in tests/conftest.py")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    known = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
    guessed: dict[str, float] = {}
    for item in items:
        unit = scheduling_unit(item.nodeid)
        slow = item.get_closest_marker("slow") is not None
        guessed[unit] = guessed.get(unit, 0.0) + (GUESS_SLOW_SECONDS if slow else GUESS_SECONDS)
    cost = {unit: known.get(unit, seconds) for unit, seconds in guessed.items()}
    items.sort(key=lambda item: -cost[scheduling_unit(item.nodeid)])  # stable


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` handing out `scheduling_unit`s (xdist's own hands out the tests
    outside a group one by one, building a file's module fixtures on every worker)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    # Hand units out in the collection's order (longest first, above), not by how many
    # tests each holds (xdist's default reordering).
    config.option.loadscopereorder = False

    class UnitScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return UnitScheduling(config, log)
