"""Stages 1 and 2 interrupted: SIGINT to the whole process group (a terminal's Ctrl-C), or
SIGTERM to the stage script alone (a scheduler, `kill`), mid-work. Within 3 s no process of
the stage is left, no file under a final name is partial, and the re-run completes with
the bytes of an uninterrupted run."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import kaldiio
import pytest

import cat
from cat.core.io import read_table, write_table
from cat.formats.shard_pack import START_WORKERS_VARIABLE
from cat.testing.audio import make_data_dir
from cat.testing.features import write_feature_corpus
from cat.testing.processes import ProcessTree, alive, wait_until

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
GONE_WITHIN_SECONDS = 3
START_SECONDS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _slow_data_dir(root: Path) -> Path:
    """16 recordings read through a command that takes 0.4 s each (stage 1 takes seconds)."""
    data = make_data_dir(root, durations=[1.0 + 0.1 * i for i in range(16)])
    wav_scp = {key: f"sleep 0.4; cat {path} |" for key, path in read_table(data / "wav.scp")
               .items()}
    write_table(data / "wav.scp", sorted(wav_scp.items()))
    return data


def _extract(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "cat.features.extract", "--nj", "2", "--no-progress",
            str(data), str(out)]


def _stage_script(tmp_path: Path, command: list[str]) -> list[str]:
    """The command run as utils/asr.sh runs a stage's command (`run` of stage_lib.sh)."""
    script = tmp_path / "stage.sh"
    script.write_text(f"set -euo pipefail\n. {REPO_ROOT}/utils/stage_lib.sh\n"
                      f"run {' '.join(command)}\necho finished\n")
    return ["bash", str(script)]


def _interrupt(tree: ProcessTree, how: str) -> None:
    """Ctrl-C (SIGINT to the group) or SIGTERM to the top process alone; then check that
    every process seen is gone within GONE_WITHIN_SECONDS."""
    tree.remember()
    if how == "sigint-group":
        os.killpg(tree.process.pid, signal.SIGINT)
    else:
        os.kill(tree.process.pid, signal.SIGTERM)
    tree.process.wait(timeout=30)
    assert tree.process.returncode != 0
    gone = wait_until(lambda: not alive(list(tree.seen)), GONE_WITHIN_SECONDS, 0.05)
    survivors = {tree.seen[i] for i in alive(list(tree.seen))}
    assert gone, f"processes outlived the interrupted stage by {GONE_WITHIN_SECONDS} s: " \
                 f"{survivors}"


@pytest.mark.parametrize("how", ["sigint-group", "sigterm-script"])
def test_stage_1_interrupted(tmp_path, how):
    data = _slow_data_dir(tmp_path / "corpus")
    clean = tmp_path / "clean"
    subprocess.run(_extract(data, clean), env=ENVIRONMENT, check=True, capture_output=True,
                   timeout=300)
    out = tmp_path / "fbank"
    command = _extract(data, out)
    if how == "sigterm-script":
        command = _stage_script(tmp_path, command)
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: any((out / "arks").glob("*.ark.tmp")), START_SECONDS,
                      "an ark being written")
        _interrupt(tree, how)
        assert "finished" not in tree.output()
    assert not (out / "feats.scp").exists()
    for ark in (out / "arks").glob("feats.*.ark"):  # a complete ark, or none
        matrices = dict(kaldiio.load_ark(str(ark)))
        assert matrices and all(m.shape[1] == 80 for m in matrices.values())
    subprocess.run(_extract(data, out), env=ENVIRONMENT, check=True, capture_output=True,
                   timeout=300)
    for name in ("arks/feats.1.ark", "arks/feats.2.ark", "utt2num_frames", "text"):
        assert filecmp.cmp(out / name, clean / name, shallow=False), name


@pytest.mark.parametrize("how", ["sigint-group", "sigterm-script"])
def test_stage_2_interrupted(tmp_path, how):
    corpus = write_feature_corpus(tmp_path / "feats", num_utts=3000, dim=80)

    def pack(out: Path) -> list[str]:
        return [sys.executable, "-m", "cat.formats.prep_wds", "pack", "--scp",
                str(corpus.feats_scp), "--text", str(corpus.text), "--out", str(out), "--nj",
                "2", "--utts-per-file", "20"]

    environment = {**ENVIRONMENT, START_WORKERS_VARIABLE: "1"}
    clean = tmp_path / "clean"
    with ProcessTree.start(pack(clean), cwd=tmp_path, env=environment) as tree:
        assert tree.process.wait(timeout=300) == 0, tree.output()[-3000:]
    out = tmp_path / "wds"
    command = pack(out) if how == "sigint-group" else _stage_script(tmp_path, pack(out))
    with ProcessTree.start(command, cwd=tmp_path, env=environment) as tree:
        tree.wait_for(lambda: len(list(out.glob("data-*.tar"))) >= 3, START_SECONDS,
                      "3 finished shards")
        _interrupt(tree, how)
    finished = sorted(out.glob("data-*.tar"))
    assert len(finished) < len(list(clean.glob("data-*.tar"))), "packing ended first"
    assert not (out / "index.jsonl").exists()
    for shard in finished:  # every shard under its final name is complete
        with tarfile.open(shard) as tar:
            assert len(tar.getmembers()) == 40
        assert filecmp.cmp(shard, clean / shard.name, shallow=False)
    with ProcessTree.start(pack(out), cwd=tmp_path, env=environment) as tree:
        assert tree.process.wait(timeout=300) == 0, tree.output()[-3000:]
    for shard in clean.glob("*"):
        if shard.is_file():
            assert filecmp.cmp(out / shard.name, shard, shallow=False), shard.name
