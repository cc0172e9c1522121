"""bench/gpu.py at tiny sizes on the CPU: every part runs and reports real figures, and a
failing part or check fails the command."""

from __future__ import annotations

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
SCRIPT = REPO_ROOT / "bench/gpu.py"
TIMEOUT_SECONDS = 300
PARTS = ("crf", "train_step", "rnnt", "loader", "ddp")


def _run(arguments: list[str]) -> subprocess.CompletedProcess:
    """Run the script; one that outlives the timeout is killed with its children and fails."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return run_bounded([sys.executable, str(SCRIPT), *arguments], REPO_ROOT, environment,
                       TIMEOUT_SECONDS, "bench/gpu.py")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[dict[str, Any], str]:
    """The JSON report and the output of one `--device cpu` run."""
    report = tmp_path_factory.mktemp("gpu") / "gpu.json"
    run = _run(["--device", "cpu", "--json", str(report)])
    assert run.returncode == 0, run.stdout[-5000:]
    return json.loads(report.read_text(encoding="utf-8")), run.stdout


def _positive(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def check_report(report: dict[str, Any]) -> None:
    """What a `--device cpu` report must hold (the assertions of this test)."""
    assert report["device_type"] == "cpu" and report["sizes"] == "tiny"
    assert report["ok"] is True
    parts = report["parts"]
    assert set(parts) == set(PARTS)
    for name in PARTS:
        assert parts[name]["status"] == "ok", (name, parts[name].get("reason"))
    assert report["checks"] and all(check["ok"] for check in report["checks"])

    crf = parts["crf"]["rows"]
    assert [row["shape"] for row in crf] == ["synth-crf", "crf-v1"]
    assert [row["classes"] for row in crf] == [153, 217]
    # synth-crf reduces the frame rate 8x, crf-v1 4x: 3.5 s and 4.5 s utterances
    assert [row["frames"] for row in crf] == [350 // 8, 450 // 4]
    for row in crf:
        assert math.isfinite(row["loss_mean"]) and row["loss_mean"] > 0
        assert row["den_arcs"] > 0 and row["utterances"] > 0
        assert "cpu_float32" not in row  # the device is the CPU: no second CPU run
        differences = row["cpu_float64"]
        assert 0 <= differences["loss_rel_diff"] <= 1e-4
        assert 0 <= differences["grad_max_diff"] <= 1e-3
        assert _positive(row["crf_seconds"]) and _positive(row["ctc_loss_seconds"])
        assert row["ratio"] == pytest.approx(row["crf_seconds"] / row["ctc_loss_seconds"])

    step = parts["train_step"]
    train = {row["label"]: row for row in step["rows"]}
    # every mode, and the attention written out (no compiled row on the CPU without
    # --compile)
    assert set(train) == {"fp32", "fp16", "bf16", "fp32+explicit"}
    assert step["training_mode"] == "fp32"
    flops = step["flops"]
    assert flops["total"] > flops["pairwise"] > 0 and flops["count_seconds"] > 0
    for mode in ("fp32", "bf16", "fp32+explicit"):
        row = train[mode]
        assert row["status"] == "ok"
        assert _positive(row["step_seconds"])
        assert len(row["step_times"]) >= 2
        assert math.isfinite(row["last_loss"])
        assert row["peak_mb"] is None  # not measured on the CPU
        assert row["flops"] == flops["total"]
        assert row["tflops"] == pytest.approx(flops["total"] / row["step_seconds"] / 1e12)
        # against the measured matrix-product rate, labelled so
        assert row["peak"].startswith("measured: ") and _positive(row["peak_flops"])
        assert row["mfu"] == pytest.approx(row["tflops"] * 1e12 / row["peak_flops"])
        assert row["audio_hours_per_hour"] == pytest.approx(
            step["batch_frames"] * 0.01 / row["step_seconds"])
    assert train["fp16"]["status"] == "ok" or train["fp16"]["reason"]
    assert len({row["parameters"] for row in train.values() if row["status"] == "ok"}) == 1
    assert step["batch_frames"] > 0
    assert train["fp32+explicit"]["attention"] == "explicit"
    # the same loss with the attention written out
    assert train["fp32+explicit"]["last_loss"] == pytest.approx(train["fp32"]["last_loss"],
                                                                rel=1e-4)
    waits = step["host_waits"]
    assert waits["count"] == 1 and "device_reads" in waits["how"]

    rnnt = {row["mode"]: row for row in parts["rnnt"]["rows"]}
    assert set(rnnt) == {"fp32", "fp16"}
    assert rnnt["fp32"]["status"] == "ok" and _positive(rnnt["fp32"]["seconds"])
    assert rnnt["fp32"]["estimate_mb"] > 0
    assert rnnt["fp16"]["status"] == "ok" or rnnt["fp16"]["reason"]

    loader = parts["loader"]
    assert _positive(loader["seconds_per_frame"]) and "fp32" in loader["step_source"]
    assert 0 <= loader["device_fbank_difference"] <= 1e-4
    assert [row["features"] for row in loader["per_worker"]] == ["workers", "device"]
    assert all(_positive(row["utts_per_second"]) for row in loader["per_worker"])
    assert [(row["shards"], row["variant"]) for row in loader["rows"]] == [
        ("features", "before"), ("features", "after"), ("opus-workers", "before"),
        ("opus-workers", "after"), ("opus-device", "after")]
    for row in loader["rows"]:
        assert _positive(row["alone_utts_per_second"]) and _positive(row["utts_per_second"])
        assert 0 <= row["wait_share"] < 1 and 0 < row["padding_share"] < 1
        # the steps could not go faster than the simulated step allows
        assert row["utts_per_second"] <= 1.01 * row["steps_utts_per_second"]

    ddp = parts["ddp"]
    assert ddp["world_size"] == 2 and ddp["backend"] == "gloo"
    assert len(ddp["ranks"]) == 2
    assert _positive(ddp["single_step_seconds"]) and _positive(ddp["ddp_step_seconds"])
    assert ddp["checksum_spread"] == 0


def test_cpu_run_reports_every_part(cpu_run):
    report, output = cpu_run
    check_report(report)
    for title in ("1. CTC-CRF loss", "2. exp/ctc-v1 update", "3. RNN-T loss",
                  "4. streaming loader", "5. DDP"):
        assert title in output
    assert "checks: " in output and "wall time: " in output


@pytest.mark.parametrize("damage", ["drop part", "skip part", "failed check", "zero time",
                                    "wait share", "no explicit row", "host waits", "mfu"])
def test_report_check_rejects_a_damaged_report(cpu_run, damage):
    """The assertions above can fail: each damage of a good report is caught."""
    report = json.loads(json.dumps(cpu_run[0]))
    if damage == "drop part":
        del report["parts"]["rnnt"]
    elif damage == "skip part":
        report["parts"]["ddp"] = {"status": "skipped", "reason": "one GPU"}
    elif damage == "failed check":
        report["checks"][0]["ok"] = False
    elif damage == "zero time":
        report["parts"]["train_step"]["rows"][0]["step_seconds"] = 0.0
    elif damage == "no explicit row":
        report["parts"]["train_step"]["rows"].pop()
    elif damage == "host waits":
        report["parts"]["train_step"]["host_waits"]["count"] = 13
    elif damage == "mfu":
        report["parts"]["train_step"]["rows"][0]["mfu"] *= 2
    else:
        report["parts"]["loader"]["rows"][1]["wait_share"] = 1.5
    with pytest.raises(AssertionError):
        check_report(report)


@pytest.fixture
def gpu_module(monkeypatch):
    """bench/gpu.py imported in this process (its sys.path entry and the sibling modules it
    imports are removed afterwards)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    for name in set(sys.modules) - before:
        if name in (spec.name, "timing", "crf_loss", "overlap", "audio_bytes"):
            del sys.modules[name]


def test_a_part_that_raises_or_fails_a_check_fails_the_command(gpu_module, monkeypatch,
                                                               capsys):
    def raises(ctx):
        raise RuntimeError("broken on purpose")

    def fails_a_check(ctx):
        ctx.check("difference", 1.0, 1e-4)
        return {}

    functions = dict(gpu_module.PART_FUNCTIONS)
    functions["rnnt"] = ("3. raises", raises)
    functions["crf"] = ("1. fails a check", fails_a_check)
    monkeypatch.setattr(gpu_module, "PART_FUNCTIONS", functions)
    assert gpu_module.main(["--device", "cpu", "--parts", "rnnt"]) == 1
    assert "FAILED: RuntimeError: broken on purpose" in capsys.readouterr().out
    assert gpu_module.main(["--device", "cpu", "--parts", "crf"]) == 1
    output = capsys.readouterr().out
    assert "CHECK FAILED: difference" in output
    assert "skipped: not selected (--parts)" in output
