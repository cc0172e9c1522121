"""`kill -9` mid-job, then the same command again: packing gives byte-identical shards,
map-style training resumed with `--resume` ends with the same parameters as a run that
was never interrupted.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cat
from cat.formats import shard_check, shard_format
from cat.testing.features import write_feature_corpus
from cat.testing.processes import ProcessTree
from cat.testing.training import write_tiny_experiment
from cat.training.checkpoint import CheckpointManager, load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                 reason="needs Linux /proc")]

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
RUN_SECONDS = 300
GONE_WITHIN_SECONDS = 10
NUM_UTTS = 1200


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=RUN_SECONDS, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stderr


def _pack_command(corpus, out: Path) -> list[str]:
    return [sys.executable, "-m", "cat.formats.prep_wds", "pack", "--scp", str(corpus.feats_scp),
            "--text", str(corpus.text), "--out", str(out), "--nj", "2", "--utts-per-file", "2"]


def _files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A corpus and its shards from an uninterrupted run."""
    root = tmp_path_factory.mktemp("pack")
    corpus = write_feature_corpus(root / "feats", num_utts=NUM_UTTS, dim=40)
    _run(_pack_command(corpus, root / "clean"), root)
    return corpus, root / "clean"


@pytest.mark.parametrize("shards_done", [1, NUM_UTTS // 2 // 4])
def test_packing_killed_then_rerun_is_byte_identical(packed, tmp_path, shards_done):
    corpus, clean = packed
    out = tmp_path / "wds"
    with ProcessTree.start(_pack_command(corpus, out), cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: len(list(out.glob("data-*.tar"))) >= shards_done, RUN_SECONDS,
                      f"{shards_done} finished shards")
        survivors = tree.kill_parent_and_wait(GONE_WITHIN_SECONDS)
    assert not survivors, f"packing workers outlived kill -9: {sorted(survivors.values())}"
    assert not (out / shard_format.INDEX_NAME).exists(), "packing ended before it was killed"
    finished = len(list(out.glob("data-*.tar")))
    assert finished < NUM_UTTS // 2
    log = _run(_pack_command(corpus, out), tmp_path)
    print(f"killed after {finished} shards; re-run: {log.splitlines()[-1]}")
    assert _files(out) == _files(clean)
    for name in _files(clean):
        assert filecmp.cmp(out / name, clean / name, shallow=False), name
    assert shard_check.validate(out) == []


def _train(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cat.ctc.train", "exp/tiny", *extra]


def _final_model(root: Path) -> dict[str, torch.Tensor]:
    checkpoints = CheckpointManager(root / "exp/tiny/check")
    return load_checkpoint(checkpoints.latest())["model"]


def _latest_step(root: Path) -> int:
    path = root / "exp/tiny/check/checkpoints.json"
    try:
        records = json.loads(path.read_text(encoding="utf-8"))["checkpoints"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return max((record["step"] for record in records), default=0)


def test_map_style_training_killed_then_resumed_ends_with_the_same_parameters(tmp_path):
    options = {"epochs": 4, "check_freq": 3, "workers": 1}
    write_tiny_experiment(tmp_path / "whole", options=options)
    write_tiny_experiment(tmp_path / "killed", options=options)
    _run(_train(tmp_path / "whole"), tmp_path / "whole")
    killed = tmp_path / "killed"
    with ProcessTree.start(_train(killed), cwd=killed, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: _latest_step(killed) >= 9, RUN_SECONDS, "a checkpoint at step 9")
        survivors = tree.kill_parent_and_wait(GONE_WITHIN_SECONDS)
    assert not survivors, sorted(survivors.values())
    interrupted_at = _latest_step(killed)
    total = _latest_step(tmp_path / "whole")
    assert interrupted_at < total, "training ended before it was killed"
    log = _run(_train(killed, "--resume"), killed)
    assert f"step {interrupted_at}" in log
    whole, resumed = _final_model(tmp_path / "whole"), _final_model(killed)
    assert _latest_step(killed) == total
    assert whole.keys() == resumed.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name
