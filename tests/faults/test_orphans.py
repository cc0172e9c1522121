"""`kill -9` of a parent ends its worker processes within seconds, for every entry point
that starts them (feature extraction, packing, decoding, DataLoader workers, synthesis).

Workers are kept busy deterministically: their input is a named pipe that nobody writes
(an open() that blocks forever), or a pipe command that writes forever.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import cat
from cat.formats.shard_pack import START_WORKERS_VARIABLE
from cat.models.registry import build_model
from cat.testing.features import write_feature_corpus
from cat.testing.processes import ProcessTree, command_line
from cat.testing.training import write_tiny_experiment
from cat.text.tokenizer import load as load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                 reason="needs Linux /proc"),
              pytest.mark.timeout(240)]

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
# Workers must be gone this long after their parent was killed.
GONE_WITHIN_SECONDS = 10
START_SECONDS = 120
SPAWNED = "multiprocessing.spawn"


def _blocking_arks(corpus) -> None:
    """Replace the corpus arks by named pipes: a reader blocks in open() forever."""
    for ark in sorted(corpus.directory.glob("*.ark")):
        ark.unlink()
        os.mkfifo(ark)


def _spawned_workers(tree: ProcessTree) -> list[int]:
    return [pid for pid in tree.remember() if SPAWNED in command_line(pid)]


def _assert_all_end_with_parent(tree: ProcessTree) -> None:
    survivors = tree.kill_parent_and_wait(GONE_WITHIN_SECONDS)
    assert not survivors, (f"alive {GONE_WITHIN_SECONDS} s after kill -9 of their parent: "
                           f"{sorted(survivors.values())}")


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def test_process_pool_workers_end_with_their_parent(tmp_path):
    script = ("import time\nfrom cat.core.process import process_pool\n"
              "pool = process_pool(2)\n"
              "futures = [pool.submit(time.sleep, 600) for _ in range(2)]\n"
              "[f.result() for f in futures]\n")
    with ProcessTree.start(_python("-c", script), cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: len(_spawned_workers(tree)) >= 2, START_SECONDS, "2 workers")
        _assert_all_end_with_parent(tree)


# A parent whose main module takes a minute to import in its workers (as one importing
# torch takes seconds): they run it before their initializer.
_SLOW_MAIN = """
import time
if __name__ == "__mp_main__":
    time.sleep(60)
from cat.core.process import process_pool
if __name__ == "__main__":
    pool = process_pool(2)
    futures = [pool.submit(time.sleep, 600) for _ in range(2)]
    time.sleep(600)
"""


def test_process_pool_workers_end_with_a_parent_killed_while_they_start(tmp_path):
    (tmp_path / "slow_main.py").write_text(_SLOW_MAIN, encoding="utf-8")
    with ProcessTree.start(_python("slow_main.py"), cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: len(_spawned_workers(tree)) >= 2, START_SECONDS, "2 workers")
        survivors = tree.kill_parent_and_wait(GONE_WITHIN_SECONDS)
    assert not survivors, (f"alive {GONE_WITHIN_SECONDS} s after kill -9 of their parent "
                           f"while they started: {sorted(survivors.values())}")


def test_portable_parent_check_without_prctl(tmp_path):
    child = ("import time\nfrom cat.core.process import die_with_parent\n"
             "die_with_parent({parent}, poll_seconds=0.2, use_prctl=False)\n"
             "time.sleep(600)\n")
    parent = ("import os, subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {child!r}.format(parent=os.getpid())])\n"
              "time.sleep(600)\n")
    with ProcessTree.start(_python("-c", parent), cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: len(tree.remember()) >= 1, START_SECONDS, "the child")
        _assert_all_end_with_parent(tree)


def test_packing_workers_end_with_their_parent(tmp_path):
    corpus = write_feature_corpus(tmp_path / "feats", num_utts=8, dim=4)
    _blocking_arks(corpus)
    command = _python("-m", "cat.formats.prep_wds", "pack", "--scp", str(corpus.feats_scp),
                      "--text", str(corpus.text), "--out", str(tmp_path / "wds"), "--nj", "2",
                      "--utts-per-file", "2")
    # Tiny work on a busy machine starts no worker by itself: these are the drill's subject.
    environment = {**ENVIRONMENT, START_WORKERS_VARIABLE: "1"}
    with ProcessTree.start(command, cwd=tmp_path, env=environment) as tree:
        tree.wait_for(lambda: len(_spawned_workers(tree)) >= 1, START_SECONDS,
                      "a packing worker")
        _assert_all_end_with_parent(tree)


def test_feature_workers_and_their_commands_end_with_their_parent(tmp_path):
    # A pipe command writing forever: the worker reads it until it is killed.
    writer = ("import sys, time\nwhile True:\n    sys.stdout.write('RIFF' * 16)\n"
              "    sys.stdout.flush()\n    time.sleep(0.2)\n")
    command_file = tmp_path / "writer.py"
    command_file.write_text(writer, encoding="utf-8")
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text(
        "".join(f"rec{i} {sys.executable} {command_file} |\n" for i in (1, 2)),
        encoding="utf-8")
    command = _python("-m", "cat.features.extract", "--nj", "2", "--no-progress", str(data),
                      str(tmp_path / "fbank"))
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: sum(str(command_file) in command_line(pid)
                                  for pid in tree.remember()) >= 2, START_SECONDS,
                      "2 running wav.scp commands")
        _assert_all_end_with_parent(tree)


def test_decoding_workers_end_with_their_parent(tmp_path):
    experiment = write_tiny_experiment(tmp_path)
    config = json.loads((experiment.exp_dir / "config.json").read_text(encoding="utf-8"))
    vocab = load_tokenizer(experiment.exp_dir / "tokenizer.tknz").vocab_size
    checkpoint = experiment.exp_dir / "model.pt"
    torch.save({"model": build_model(config, vocab).state_dict()}, checkpoint)
    corpus = write_feature_corpus(tmp_path / "test", num_utts=4, dim=8)
    _blocking_arks(corpus)
    command = _python("-m", "cat.ctc.decode", "exp/tiny", "--data", str(corpus.directory),
                      "--checkpoint", str(checkpoint), "--out", str(tmp_path / "decode"),
                      "--nj", "2", "--batch-size", "1", "--device", "cpu")
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: len(_spawned_workers(tree)) >= 2, START_SECONDS,
                      "2 decoding workers")
        _assert_all_end_with_parent(tree)


@pytest.mark.slow
def test_dataloader_workers_end_with_their_parent(tmp_path):
    write_tiny_experiment(tmp_path, options={"workers": 2, "epochs": 1000})
    command = _python("-m", "cat.ctc.train", "exp/tiny")
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: (tmp_path / "exp/tiny/log/scalars.jsonl").is_file()
                      and len(tree.remember()) >= 2, START_SECONDS,
                      "training with 2 DataLoader workers")
        _assert_all_end_with_parent(tree)


@pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                    reason="needs espeak-ng and sox")
def test_synthesis_commands_end_with_their_parent(tmp_path):
    command = _python("-m", "cat.data.synth", "aishell", str(tmp_path / "corpus"),
                      "--num-utts", "400", "--num-chars", "300", "--utts-per-speaker", "10",
                      "--nj", "2")
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: any("espeak-ng" in command_line(pid) for pid in tree.remember()),
                      START_SECONDS, "an espeak-ng process")
        _assert_all_end_with_parent(tree)
