"""The suite's parallel scheduling (tests/conftest.py, as `tests/run.sh` runs it): with
pytest-xdist, a test file runs on one worker, and so do all the tests of a group
(`GROUPS`: the Slurm users, across their files), while the units spread over workers."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFTEST = REPO_ROOT / "tests" / "conftest.py"

pytest.importorskip("xdist")

# A suite laid out as this one: the Slurm group's files (and one test of
# tests/faults/test_interrupts.py), and plain files. Each test writes its worker.
TEST_BODY = """
import os
import time

import pytest


def record(name):
    time.sleep(0.2)
    with open(os.environ["WHO_RAN"], "a") as log:
        log.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""
PLAIN = TEST_BODY + """

@pytest.mark.parametrize("n", range(4))
def test_one(n):
    record(f"{__file__}")
"""
INTERRUPTS = TEST_BODY + """

@pytest.mark.parametrize(("backend", "how"), [("local", "sigterm"), ("slurm", "sigterm")])
def test_run_sh_interrupted_ends_stage_3_its_training_and_its_slurm_job(backend, how):
    record(f"{__file__}-{backend}")
"""
SLURM_FILES = ("tests/recipes/test_slurm_recipe.py", "tests/training/test_slurm_training.py",
               "tests/testing/test_slurm.py")
PLAIN_FILES = tuple(f"tests/area{n}/test_plain{n}.py" for n in range(5))


def test_a_file_and_a_group_each_run_on_one_worker_and_the_units_spread(tmp_path):
    suite = tmp_path / "suite"
    for name in (*SLURM_FILES, *PLAIN_FILES):
        (suite / name).parent.mkdir(parents=True, exist_ok=True)
        (suite / name).write_text(PLAIN)
    (suite / "tests/faults").mkdir()
    (suite / "tests/faults/test_interrupts.py").write_text(INTERRUPTS)
    (suite / "pytest.ini").write_text("[pytest]\naddopts = --import-mode=importlib\n")
    (suite / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util

        spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pytest_collection_modifyitems = module.pytest_collection_modifyitems
        pytest_xdist_make_scheduler = module.pytest_xdist_make_scheduler
        """))
    log = tmp_path / "who-ran"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST")}
    env["WHO_RAN"] = str(log)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup",
                          "-p", "no:cacheprovider"], cwd=suite, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers = collections.defaultdict(set)  # what ran -> the workers it ran on
    for line in log.read_text().splitlines():
        name, worker = line.rsplit(" ", 1)
        workers[name].add(worker)
    assert sum(1 for _ in log.read_text().splitlines()) == 4 * 8 + 2  # every test ran once
    slurm = [str(suite / name) for name in SLURM_FILES]
    slurm.append(f"{suite / 'tests/faults/test_interrupts.py'}-slurm")
    assert len(set().union(*(workers[name] for name in slurm))) == 1  # the group: one worker
    assert all(len(workers[str(suite / name)]) == 1 for name in PLAIN_FILES)  # a file: one
    assert len(set().union(*workers.values())) > 1  # and the units spread
