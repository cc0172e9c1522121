"""Threads from the CPUs a process may use: affinity, cgroup v1/v2 quotas (mocked files),
the load-driven choice, and passive OpenMP waiting set before torch starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cat.core import threads
from cat.core.threads import ThreadGovernor, cgroup_cpu_limit, threads_for_load, usable_cpus

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cgroup(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    root = tmp_path / "sys/fs/cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="ascii")
    root.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text(proc, encoding="ascii")
    return root, tmp_path / "cgroup"


def test_cgroup_v2_quota_bounds_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    root, proc = _cgroup(tmp_path, {"job/cpu.max": "150000 100000\n"}, "0::/job\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cpus(root, proc) == 2  # 1.5 CPUs of quota: 2 threads, rounded up
    root, proc = _cgroup(tmp_path / "none", {"cpu.max": "max 100000\n"}, "0::/\n")
    assert cgroup_cpu_limit(root, proc) is None and usable_cpus(root, proc) == 8
    root, proc = _cgroup(tmp_path / "big", {"cpu.max": "3200000 100000\n"}, "0::/\n")
    assert usable_cpus(root, proc) == 8  # the affinity is the smaller bound


def test_cgroup_v1_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 16)
    root, proc = _cgroup(tmp_path, {"cpu,cpuacct/slurm/cpu.cfs_quota_us": "300000\n",
                                    "cpu,cpuacct/slurm/cpu.cfs_period_us": "100000\n"},
                         "4:cpu,cpuacct:/slurm\n1:memory:/slurm\n")
    assert cgroup_cpu_limit(root, proc) == 3.0 and usable_cpus(root, proc) == 3
    root, proc = _cgroup(tmp_path / "unlimited", {"cpu/cpu.cfs_quota_us": "-1\n",
                                                  "cpu/cpu.cfs_period_us": "100000\n"},
                         "3:cpu:/\n")
    assert cgroup_cpu_limit(root, proc) is None and usable_cpus(root, proc) == 16


def test_no_cgroup_files_means_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 2)
    assert usable_cpus(tmp_path / "absent", tmp_path / "absent-cgroup") == 2


def test_threads_option_and_ranks():
    assert threads.choose_threads(3, processes=2, cpus=8) == 3
    assert threads.choose_threads(0, processes=2, cpus=8) == 4
    assert threads.choose_threads(0, processes=4, cpus=2) == 1


def test_threads_follow_the_load_of_other_processes():
    assert threads_for_load(2, current=2, load=2.4) == 2      # idle but for us
    assert threads_for_load(2, current=2, load=4.1) == 1      # two CPU-bound neighbours
    assert threads_for_load(2, current=1, load=3.0) == 1
    assert threads_for_load(2, current=1, load=1.3) == 2      # they stopped
    assert threads_for_load(16, current=8, load=12.0) == 12
    assert threads_for_load(16, current=8, load=16.3, processes=2) == 8  # two ranks
    assert threads_for_load(16, current=8, load=20.0, processes=2) == 6


def test_governor_rechecks_at_most_every_interval(monkeypatch):
    import torch

    load, now = [4.0], [0.0]
    governor = ThreadGovernor(0, 1, interval=30, load=lambda: load[0], clock=lambda: now[0])
    governor.usable = governor.threads = 2  # as on a 2-CPU machine
    assert governor.check() is None  # the first look waits for the interval
    now[0] = 31
    try:
        assert governor.check() == 1 and torch.get_num_threads() == 1
        load[0] = 1.2
        now[0] = 40
        assert governor.check() is None  # not yet
        now[0] = 62
        assert governor.check() == 2 and torch.get_num_threads() == 2
        assert ThreadGovernor(2, interval=0, load=lambda: 9.0).check() is None  # fixed
    finally:
        torch.set_num_threads(1)


def test_importing_cat_makes_openmp_threads_wait_passively():
    environment = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    code = "import os, cat; print(os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", code], env=environment, text=True,
                            capture_output=True, check=True)
    assert result.stdout.strip() == "PASSIVE"
    environment["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's choice stands
    result = subprocess.run([sys.executable, "-c", code], env=environment, text=True,
                            capture_output=True, check=True)
    assert result.stdout.strip() == "ACTIVE"
