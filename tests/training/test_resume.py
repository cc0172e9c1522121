"""Training killed with SIGKILL at several steps of an epoch, then `--resume`d: the epoch
trains what an uninterrupted one trains, each utterance once, in the same batches."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cat
from cat.testing.training import latest_step, write_tiny_experiment
from cat.training.checkpoint import CheckpointManager, load_checkpoint
from cat.training.cli import train

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
NAME = "exp/tiny"
KILL_STEPS = (5, 14, 23)  # of an epoch of 40 updates
TIMEOUT_SECONDS = 180


def _experiment(root: Path, data: str, workers: int):
    """`data`: a map pack, feature shards (in length buckets), or audio shards whose fbank
    the training device computes."""
    experiment = write_tiny_experiment(root, num_train=160, utts_per_shard=10, options={
        "epochs": 1, "batch_size": 4, "check_freq": 1, "keep_checkpoints": 1,
        "log_utterances": True, "workers": workers, "shuffle_buffer": 12, "sort_buffer": 8})
    if data == "features":
        experiment.use_shards()
    elif data == "features-buckets":
        experiment.use_shards(buckets=4)
    elif data == "audio-on-device":
        experiment.use_audio_shards("flac", features="device")
    return experiment


def _train_until_killed(root: Path, step: int, resume: bool) -> int:
    """Start training in a new process and SIGKILL it once a checkpoint at `step` (or
    later) exists; returns the step of the checkpoint the kill left behind."""
    command = [sys.executable, "-m", "cat.ctc.train", NAME, *(["--resume"] if resume else [])]
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=root, env=environment, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    try:
        while latest_step(root / NAME) < step:
            assert process.poll() is None, f"training ended before step {step}:\n" \
                                           f"{process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint at step {step} in time"
            time.sleep(0.005)
        process.kill()  # the training process only, as a node failure would
        process.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its DataLoader workers, if any remain
        process.stderr.close()
    return latest_step(root / NAME)


def _outcome(experiment) -> tuple[list[str], dict, dict]:
    log = experiment.exp_dir / "log"
    batches = (log / "utts/epoch-001.rank-0.txt").read_text().splitlines()
    summary = json.loads((log / "epoch-001.json").read_text())
    model = load_checkpoint(CheckpointManager(experiment.exp_dir / "check").latest())["model"]
    return batches, summary, model


@pytest.mark.slow
@pytest.mark.parametrize(("data", "workers"), [
    ("map", 1), ("map", 2), ("features", 1), ("features", 2), ("features-buckets", 2),
    ("audio-on-device", 2)])  # buckets and device features: the two-worker hand-over
def test_sigkill_at_three_steps_then_resume_trains_the_same_epoch(tmp_path, monkeypatch,
                                                                   data, workers):
    straight = _experiment(tmp_path / "straight", data, workers)
    monkeypatch.chdir(straight.root)
    train(NAME, "cat.ctc.train")
    expected_batches, expected_summary, expected_model = _outcome(straight)
    steps = expected_summary["steps"]
    # Batches of 4; length buckets leave partial batches when the epoch's stream ends.
    assert steps == len(expected_batches) and (steps == 40 or data == "features-buckets")

    killed = _experiment(tmp_path / "killed", data, workers)
    stops = [_train_until_killed(killed.root, step, resume=step != KILL_STEPS[0])
             for step in KILL_STEPS]
    assert all(a < b < steps for a, b in itertools.pairwise(stops)), stops
    monkeypatch.chdir(killed.root)
    train(NAME, "cat.ctc.train", resume=True)
    batches, summary, model = _outcome(killed)

    assert sorted(k for b in batches for k in b.split()) == \
        sorted(k for b in expected_batches for k in b.split()) == killed.train.keys
    assert summary["trained"] == 160 and summary["retrained"] == 0
    assert summary["steps"] == expected_summary["steps"]
    if workers == 1 or data == "map":
        # One worker (or map-style batches, fixed by seed and epoch): the same batches in
        # the same order, hence the same model.
        assert batches == expected_batches
        for key, value in expected_model.items():
            assert torch.equal(value, model[key]), key
