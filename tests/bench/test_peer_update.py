"""bench/peer_update.py: without ESPnet it names the install command and exits 2; with it
(installed as its docstring says), the quick mode trains both models and reports sizes
within the stated tolerances and a positive ratio, and the full-size models have the
sizes the benchmark's section quotes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cat
from cat.testing.processes import run_bounded

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "bench/peer_update.py"
TIMEOUT_SECONDS = 300
# exp/ctc-v1 with AISHELL-1's 4,233 characters (egs/aishell/README.md)
CTC_V1_PARAMETERS = 79_528_009


def _run(arguments: list[str]) -> subprocess.CompletedProcess:
    """Run the script; one that outlives the timeout is killed with its children and fails."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return run_bounded([sys.executable, str(SCRIPT), *arguments], REPO_ROOT, environment,
                       TIMEOUT_SECONDS, "bench/peer_update.py")


@pytest.fixture(scope="module")
def script() -> Any:
    """bench/peer_update.py imported in this process (its sys.path entries and the sibling
    modules it imports are removed afterwards)."""
    path, before = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("bench_peer_update", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.path[:] = path
    for name in set(sys.modules) - before:
        if name in (spec.name, "gpu", "timing", "crf_loss"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def peer(script) -> Any:
    """ESPnet's classes, or a skip that says how to install them."""
    try:
        return script.import_peer(script.PEER_SITE)
    except script.PeerMissing as error:
        pytest.skip(f"{error}; install it with: {script.INSTALL}")


def test_without_the_peer_it_prints_the_install_command_and_exits_2(script, tmp_path):
    environment_path = [entry for entry in sys.path if entry != str(script.PEER_SITE)]
    if importlib.machinery.PathFinder.find_spec("espnet2", environment_path) is not None:
        pytest.skip("ESPnet is importable from the environment itself")
    run = _run(["--quick", "--peer-site", str(tmp_path)])
    assert run.returncode == 2, run.stdout[-3000:]
    assert f"pip install --no-deps --target {tmp_path} espnet==" in run.stdout
    assert script.install_command(tmp_path) in run.stdout
    assert "Traceback" not in run.stdout
    assert "pip install --no-deps --target bench/out/peer/site espnet==" in script.INSTALL
    assert script.INSTALL in script.__doc__  # the Usage docstring holds it too


def _positive(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _within(ours: int, peer: int, tolerance: float) -> bool:
    return abs(peer - ours) <= tolerance * ours


def check_report(report: dict[str, Any], tolerance: float) -> None:
    """What a `--quick` report must hold (the assertions of the test below)."""
    assert report["device_type"] == "cpu" and report["sizes"] == "quick"
    assert report["batch_utterances"] == 2 and report["timed_steps"] >= 2
    rows = {row["ours"]: row for row in report["rows"]}
    assert set(rows) == {"ctc-v1", "conv2d"}
    for name, row in rows.items():
        assert row["mode"] == "fp32" and row["status"] == "ok"
        for side in ("ours", "peer"):
            assert math.isfinite(row[f"last_loss_{side}"]) and row[f"last_loss_{side}"] > 0
            assert len(row[f"step_times_{side}"]) == report["timed_steps"]
            assert all(_positive(t) for t in row[f"step_times_{side}"])
            assert row[f"median_seconds_{side}"] >= row[f"best_seconds_{side}"] > 0
            assert row[f"peak_mb_{side}"] is None  # not measured on the CPU
        assert _positive(row["ratio"])
        assert row["ratio"] == pytest.approx(row["median_seconds_peer"]
                                             / row["median_seconds_ours"])
        # the layers after the 4x front end have the same size on both sides
        assert _within(row["parameters_ours"] - row["front_end_ours"],
                       row["parameters_peer"] - row["front_end_peer"], tolerance), name
    # with a conv2d front end as wide as ESPnet's, the whole models
    conv2d = rows["conv2d"]
    assert conv2d["front_end_ours"] == conv2d["front_end_peer"]
    assert _within(conv2d["parameters_ours"], conv2d["parameters_peer"], tolerance)
    # ctc-v1 keeps its VGG2L front end, a different one
    assert rows["ctc-v1"]["front_end_ours"] != rows["ctc-v1"]["front_end_peer"]


@pytest.fixture(scope="module")
def quick_report(peer, tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("peer") / "peer.json"
    run = _run(["--quick", "--threads", "1", "--json", str(path)])
    assert run.returncode == 0, run.stdout[-5000:]
    assert "peer/ours" in run.stdout and "ESPnet" in run.stdout
    return json.loads(path.read_text(encoding="utf-8"))


def test_quick_mode_trains_both_models_of_the_same_size(script, quick_report):
    check_report(quick_report, script.SAME_LAYERS_TOLERANCE)


@pytest.mark.parametrize("damage", ["nan loss", "zero ratio", "peer larger", "row dropped"])
def test_report_check_rejects_a_damaged_report(script, quick_report, damage):
    """The assertions above can fail: each damage of a good report is caught."""
    report = json.loads(json.dumps(quick_report))
    row = report["rows"][-1]
    if damage == "nan loss":
        row["last_loss_peer"] = float("nan")
    elif damage == "zero ratio":
        row["ratio"] = 0.0
    elif damage == "peer larger":
        row["parameters_peer"] += row["parameters_peer"] // 10
    else:
        report["rows"].pop()
    with pytest.raises(AssertionError):
        check_report(report, script.SAME_LAYERS_TOLERANCE)


@pytest.mark.slow
def test_full_size_models_differ_only_in_the_front_end(script, peer):
    """At 12 x 512 the peer is ESPnet's conv2d front end (7.3 M parameters) larger than
    ctc-v1 (VGG2L, 1.6 M); all else agrees but for ESPnet's final LayerNorm."""
    runners = {runner.name: runner for runner in script.build_runners(
        peer, script.FULL, list(script.OURS))}
    sizes = {name: (script.count(r.model), script.count(r.front_end))
             for name, r in runners.items()}
    hdim = 512
    assert sizes["ours:ctc-v1"] == (CTC_V1_PARAMETERS, 1_570_240)
    assert sizes["ours:conv2d"][1] == sizes["peer"][1] == 7_346_176
    for name in ("ours:ctc-v1", "ours:conv2d"):
        body = sizes[name][0] - sizes[name][1]
        assert sizes["peer"][0] - sizes["peer"][1] - body == 2 * hdim  # the LayerNorm
    assert _within(CTC_V1_PARAMETERS, sizes["peer"][0], 0.08)
