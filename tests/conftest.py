"""Session-wide test settings, and how the suite runs in parallel.

`tests/run.sh` runs pytest with pytest-xdist (`-n N --dist loadgroup`). This file makes
that scheduling hand out whole test files (a file's module fixtures, such as a trained
tiny model, are built once), keeps the tests that share one machine-wide resource on one
worker, one after another (`xdist_group`: the one-node Slurm cluster, the serving tests'
trained model), and starts the longest files first (`tests/durations.json`), so that the
last file to finish is a short one. `-n 0` (or `-p no:xdist`) runs everything serially in
one process, in the files' order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Tests that use one of these fixtures run in the named xdist group: on one worker, one
# after another. The fixtures are session-wide (one Slurm cluster, one trained model per
# worker), and their users must not overlap.
GROUP_OF_FIXTURE = {
    "slurm_cluster": "slurm",  # one Slurm cluster a session; its jobs share the node
    "tone": "serving",  # tests/serving/conftest.py trains the model once per worker
}
# Seconds each scheduling unit (a file, or a group) took in a full run, to start the
# longest first; `bash tests/run.sh --unit-durations tests/durations.json` rewrites it.
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


def _unit_of_nodeid(nodeid: str) -> str:
    """`scheduling_unit` from a report's node id (xdist appends `@group`)."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    return nodeid.split("::", 1)[0]


class _UnitDurations:
    """Adds up the setup, call and teardown seconds of every test by unit."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        unit = _unit_of_nodeid(report.nodeid)
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((unit, round(seconds, 1)) for unit, seconds
                               in self.seconds.items()), key=lambda pair: -pair[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--unit-durations")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller sees every report
        config.pluginmanager.register(_UnitDurations(path), "unit-durations")


def scheduling_unit(item: pytest.Item) -> str:
    """What one worker runs as a whole: the test's xdist group, else its file."""
    groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                     for mark in item.iter_markers("xdist_group")})
    return "_".join(groups) if groups else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the users of a shared fixture in its group (before xdist reads the groups),
    and, on an xdist worker, order the tests longest unit first (every worker collects,
    and orders, the same way; the scheduler hands out units in this order)."""
    for item in items:
        for fixture, group in GROUP_OF_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    known = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
    guessed: dict[str, float] = {}
    for item in items:
        unit = scheduling_unit(item)
        slow = item.get_closest_marker("slow") is not None
        guessed[unit] = guessed.get(unit, 0.0) + (GUESS_SLOW_SECONDS if slow else GUESS_SECONDS)
    cost = {unit: known.get(unit, seconds) for unit, seconds in guessed.items()}
    items.sort(key=lambda item: -cost[scheduling_unit(item)])  # stable: files keep order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup`, with the tests outside a group handed out by file (xdist's own
    hands them out one by one, building a file's module fixtures on every worker)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)
            return group if group != nodeid else nodeid.split("::", 1)[0]

    return FileOrGroupScheduling(config, log)
